"""Rendering through real templates: message spans, the tools region, and tokenizers or
templates that cannot be used."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentserve.analyze.messages import content_text
from agentserve.analyze.render import (
    HFChatTokenizer,
    Renderer,
    TemplateError,
    TokenizerError,
    load_tokenizer_dir,
)
from agentserve.analyze.spans import MessageSpans, tools_region
from tests.analyze.scenarios import ANSWER, THANKS, TOOLS, base_messages
from tests.analyze.tiny_tokenizer import write_tokenizer_dir


def _spans(renderer: Renderer, messages: list[dict[str, object]]) -> MessageSpans:
    text = renderer.text(messages, TOOLS, generation=True)
    return MessageSpans(renderer, messages, TOOLS, text)


def test_every_message_text_lies_in_its_own_span(any_template: tuple[str, Renderer]) -> None:
    _, renderer = any_template
    messages = [*base_messages(), ANSWER, THANKS]
    spans = _spans(renderer, messages)
    ends = [spans.bound(i) for i in range(len(messages))]
    assert ends == sorted(ends) and ends[-1] < len(spans.text)
    for index, message in enumerate(messages):
        content = content_text(message.get("content"))
        if content:
            at = spans.text.index(content, spans.span(index)[0])
            assert spans.locate(at) == index
            assert spans.locate(at + len(content) - 1) == index
    assert spans.locate(len(spans.text) - 1) == len(messages)  # the generation prompt


def test_spans_when_the_template_renders_the_last_message_differently(
    qwen3_style: HFChatTokenizer,
) -> None:
    """Rendered last, message 4 keeps its reasoning; in the whole rendering it does not (a user
    message follows), so its end is found from the tail both renderings share."""
    renderer = Renderer(qwen3_style)
    messages = [*base_messages(), ANSWER, THANKS]
    spans = _spans(renderer, messages)
    assert "<think>" not in spans.text
    start, end = spans.span(4)
    assert spans.text[start:end].endswith("</tool_call><|im_end|>\n")
    assert spans.text[end:].startswith("<|im_start|>user\n<tool_response>")


def test_tools_region_only_where_the_template_renders_tools(
    any_template: tuple[str, Renderer],
) -> None:
    name, renderer = any_template
    messages = base_messages()
    text = renderer.text(messages, TOOLS, generation=True)
    region = tools_region(renderer, messages, TOOLS, text, generation=True)
    if name == "smollm2":
        assert region is None
        return
    shown = text[region[0] : region[1]]
    assert all(f'"name": "{t["function"]["name"]}"' in shown for t in TOOLS)
    assert "You are a coding agent" not in shown
    assert tools_region(renderer, messages, None, text, generation=True) is None


def test_renderer_memoizes(qwen25: HFChatTokenizer) -> None:
    renderer = Renderer(qwen25)
    messages = base_messages()
    first = renderer.rendering(messages, TOOLS, generation=True)
    assert renderer.rendering(messages, TOOLS, generation=True) is first
    assert first.text.endswith("<|im_start|>assistant\n")


def test_template_that_raises_names_its_complaint(raising_dir: Path) -> None:
    renderer = Renderer(load_tokenizer_dir(raising_dir))
    with pytest.raises(TemplateError, match="tool messages are not supported"):
        renderer.text(base_messages(), None, generation=True)


def test_unusable_tokenizer_directories(no_template_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no chat template"):
        load_tokenizer_dir(no_template_dir)
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        load_tokenizer_dir(tmp_path)
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer_dir(tmp_path / "missing")


USER_LAST_TEMPLATE = """
{%- if messages[-1].role != 'user' %}{{ raise_exception('end with a user message') }}{% endif %}
{%- for m in messages %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def test_spans_fall_back_to_message_text_when_the_template_refuses_prefixes(
    tmp_path: Path,
) -> None:
    """This template refuses any list not ending with a user message, so the end of an
    assistant message is found by the message's own text."""
    renderer = Renderer(load_tokenizer_dir(write_tokenizer_dir(tmp_path, USER_LAST_TEMPLATE)))
    messages = [base_messages()[1], ANSWER, THANKS]
    text = renderer.text(messages, None, generation=True)
    spans = MessageSpans(renderer, messages, None, text)
    assert spans.bound(1) == text.index(ANSWER["content"]) + len(ANSWER["content"])
    assert [spans.locate(text.index(m["content"])) for m in messages] == [0, 1, 2]
