"""Breaks that templates make themselves: earlier reasoning dropped at a new user message
(Qwen3-style), a message rendered differently once others follow, and a break no rule explains
(named `unexplained`, never guessed)."""

from __future__ import annotations

import json
from pathlib import Path

from agentserve.analyze.analysis import analyze_session
from agentserve.analyze.causes import Cause
from agentserve.analyze.render import HFChatTokenizer, Renderer, load_tokenizer_dir
from agentserve.analyze.transcript import parse_transcript
from tests.analyze.scenarios import ANSWER, THANKS, TOOLS, USER, base_messages, rows_of
from tests.analyze.tiny_tokenizer import write_tokenizer_dir


def test_template_drops_earlier_reasoning_at_a_new_user_message(
    qwen3_style: HFChatTokenizer, smollm2: HFChatTokenizer, qwen25: HFChatTokenizer
) -> None:
    """A whole session (replies inline): only the Qwen3-style template drops reasoning, and it
    does so at the first request after the new user message, at the first reasoning."""
    answer = {**ANSWER, "reasoning_content": "So the test is wrong, not add."}
    session = {
        "tools": TOOLS,
        "messages": [*base_messages(), answer, THANKS, {"role": "assistant", "content": "Done."}],
    }
    transcript = parse_transcript(json.dumps(session), "s.json")
    for tokenizer, expect_break in ((qwen3_style, True), (smollm2, False), (qwen25, False)):
        rows = analyze_session(Renderer(tokenizer), transcript.sessions[0]).rows
        assert [r.prefix_break is not None for r in rows] == [False, False, False, expect_break]
        if expect_break:
            brk = rows[3].prefix_break
            assert (brk.message_index, brk.cause) == (2, Cause.REASONING_DROPPED)
            assert "<think>" in brk.old and "<think>" not in brk.new
            # Resumable only at the end of the first prompt: its reply held the first reasoning.
            assert rows[3].hybrid_reusable_tokens == rows[0].prompt_tokens


FINAL_MARK_TEMPLATE = """
{%- for m in messages %}
{{- '<|im_start|>' + m.role + '\\n' + m.content }}
{%- if loop.last and m.role == 'assistant' %}{{- ' [final]' }}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def test_template_that_rewrites_a_message_once_others_follow(tmp_path: Path) -> None:
    """This template marks the final assistant message; once the reply is history the mark
    goes, and the same message data renders differently."""
    renderer = Renderer(load_tokenizer_dir(write_tokenizer_dir(tmp_path, FINAL_MARK_TEMPLATE)))
    requests = [
        {"messages": [USER], "response": ANSWER},
        {"messages": [USER, ANSWER, THANKS]},
    ]
    brk = rows_of(renderer, requests)[1].prefix_break
    assert (brk.message_index, brk.cause) == (1, Cause.TEMPLATE_REWRITE)
    assert "[final]" in brk.old and "[final]" not in brk.new


def test_a_break_no_rule_explains_is_unexplained(qwen3_style: HFChatTokenizer) -> None:
    """A retry of the first request without thinking: the generation prompt's empty think block
    parts from the reply the template rendered. No message changed, no rule applies."""
    renderer = Renderer(qwen3_style, {"enable_thinking": False})
    requests = [{"messages": [USER], "response": ANSWER}, {"messages": [USER]}]
    brk = rows_of(renderer, requests)[1].prefix_break
    assert brk.cause == Cause.UNEXPLAINED
    assert brk.message_index == 1  # the generation prompt
    assert "<think>" in brk.new and "<think>" not in brk.old
