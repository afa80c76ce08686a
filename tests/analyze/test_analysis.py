"""Per-request accounting on real renderings: the hybrid rule with breaks before, on and after
a checkpoint, and causes that are never named unless the renderings show them."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentserve.analyze.causes import Cause
from agentserve.analyze.render import HFChatTokenizer, Renderer
from tests.analyze.scenarios import (
    ANSWER,
    TOOLS,
    Message,
    base_messages,
    rows_of,
    system,
    three_requests,
)


def _lengths(renderer: Renderer, prompt: list[Message], reply: Message) -> tuple[int, int]:
    """(prompt tokens, full sequence tokens): the two checkpoints a request leaves."""
    return (
        len(renderer.rendering(prompt, TOOLS, generation=True)),
        len(renderer.rendering([*prompt, reply], TOOLS, generation=False)),
    )


def test_hybrid_break_before_every_checkpoint(qwen25: HFChatTokenizer) -> None:
    renderer = Renderer(qwen25)
    rows = rows_of(renderer, three_requests(base_messages(), third_system=system("10:00:42")))
    assert rows[2].reusable_tokens > 0
    assert rows[2].hybrid_reusable_tokens == 0
    assert rows[2].hybrid_prefill_tokens == rows[2].prompt_tokens


def test_hybrid_break_on_the_prompt_end_checkpoint(qwen25: HFChatTokenizer) -> None:
    """The second request sends back a different reply than the first generated: the texts
    part at the reply's first token, exactly the end of the first prompt."""
    renderer = Renderer(qwen25)
    messages = base_messages()
    other = {"role": "assistant", "content": "Sure, reading it."}
    requests = [
        {"tools": TOOLS, "messages": messages[:2], "response": ANSWER},
        {"tools": TOOLS, "messages": [*messages[:2], other, {"role": "user", "content": "Go."}]},
    ]
    prompt_end, _ = _lengths(renderer, messages[:2], ANSWER)
    second = rows_of(renderer, requests)[1]
    assert second.reusable_tokens == prompt_end
    assert second.hybrid_reusable_tokens == prompt_end
    assert second.prefix_break.cause == Cause.MESSAGE_EDITED


def test_hybrid_break_after_the_prompt_end_checkpoint(qwen25: HFChatTokenizer) -> None:
    """The reply comes back with other arguments: the break is inside the reply, after the
    checkpoint at the end of the prompt and before the one at the end of the reply."""
    renderer = Renderer(qwen25)
    messages = base_messages()
    changed = copy.deepcopy(messages)
    changed[4]["tool_calls"][0]["function"]["arguments"] = '{"target": "tests"}'
    rows = rows_of(renderer, three_requests(changed))
    prompt_end, full_end = _lengths(renderer, messages[:4], messages[4])
    assert prompt_end < rows[2].reusable_tokens < full_end
    assert rows[2].hybrid_reusable_tokens == prompt_end


def test_hybrid_resumes_from_a_checkpoint_of_an_earlier_request(qwen25: HFChatTokenizer) -> None:
    """A break in what the second request appended leaves the first request's reply-end
    checkpoint as the last one on the cached path."""
    renderer = Renderer(qwen25)
    messages = base_messages()
    changed = copy.deepcopy(messages)
    changed[3]["content"] = "def test_add():\n    assert add(1, 2) == 3\n"
    rows = rows_of(renderer, three_requests(changed))
    _, first_full = _lengths(renderer, messages[:2], messages[2])
    second_prompt, _ = _lengths(renderer, messages[:4], messages[4])
    assert first_full < rows[2].reusable_tokens < second_prompt
    assert rows[2].hybrid_reusable_tokens == first_full


def test_no_break_resumes_at_the_end_of_the_reply(qwen25: HFChatTokenizer) -> None:
    renderer = Renderer(qwen25)
    messages = base_messages()
    rows = rows_of(renderer, three_requests(messages))
    _, full_end = _lengths(renderer, messages[:4], messages[4])
    assert rows[2].reusable_tokens == rows[2].hybrid_reusable_tokens == full_end
    assert (
        rows[2].generated_tokens
        == len(renderer.rendering([*messages, ANSWER], TOOLS, generation=False))
        - rows[2].prompt_tokens
    )


def _reword_system(m: list[Message], tools: list[Message]) -> None:
    m[0] = {**m[0], "content": m[0]["content"].replace("a coding", "a careful coding")}


def _timestamp(m: list[Message], tools: list[Message]) -> None:
    m[0] = {**m[0], "content": m[0]["content"].replace("10:00:00", "10:07:13")}


def _reverse_tools(m: list[Message], tools: list[Message]) -> None:
    tools.reverse()


def _tool_keys(m: list[Message], tools: list[Message]) -> None:
    for t in tools:
        t["function"] = dict(reversed(list(t["function"].items())))


def _argument_keys(m: list[Message], tools: list[Message]) -> None:
    m[2]["tool_calls"][0]["function"]["arguments"] = '{"limit": 40, "path": "tests/test_add.py"}'


def _result_spacing(m: list[Message], tools: list[Message]) -> None:
    m[3]["content"] = m[3]["content"].replace("    assert", "  assert")


def _call_ids(m: list[Message], tools: list[Message]) -> None:
    m[2]["tool_calls"][0]["id"] = m[3]["tool_call_id"] = "call_77f01c"


def _drop_reasoning(m: list[Message], tools: list[Message]) -> None:
    m[2] = {k: v for k, v in m[2].items() if k != "reasoning_content"}


# Each edit of the third request, and the causes its renderings may show (none: invisible).
MUTATIONS = {
    "system": (_reword_system, {Cause.SYSTEM_PROMPT_CHANGED}),
    "timestamp": (_timestamp, {Cause.VOLATILE}),
    "tool order": (_reverse_tools, {Cause.TOOLS_REORDERED}),
    "tool keys": (_tool_keys, {Cause.SERIALIZATION}),
    "argument keys": (_argument_keys, {Cause.SERIALIZATION}),
    "result spacing": (_result_spacing, {Cause.SERIALIZATION}),
    "call ids": (_call_ids, set()),  # no template here renders tool-call ids
    "reasoning": (_drop_reasoning, {Cause.REASONING_DROPPED}),
}


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(chosen=st.sets(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=3))
def test_causes_come_only_from_what_the_renderings_show(
    chosen: set[str], any_template: tuple[str, Renderer]
) -> None:
    _, renderer = any_template
    earlier = base_messages()
    third, tools = copy.deepcopy(earlier), copy.deepcopy(TOOLS)
    for name in chosen:
        MUTATIONS[name][0](third, tools)
    rows = rows_of(renderer, three_requests(third, third_tools=tools))
    brk = rows[2].prefix_break
    old = renderer.text([*earlier[:4], earlier[4]], TOOLS, generation=False)
    new = renderer.text(third, tools, generation=True)
    if new.startswith(old):  # nothing the template renders changed
        assert brk is None
        return
    assert brk is not None
    allowed = set().union(*(MUTATIONS[name][1] for name in chosen))
    assert brk.cause in allowed, (chosen, brk)
    if brk.cause in (Cause.TOOLS_REORDERED, Cause.SERIALIZATION):
        assert brk.old != brk.new
