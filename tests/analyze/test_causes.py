"""Every break cause on hand-built sessions with known answers, on both bundled models' templates
and on a Qwen3-style template. What each template really does decides the answer: SmolLM2's
ignores tools and tool calls, Qwen2.5's renders tools in the system turn and ignores
`reasoning_content`, the Qwen3-style one drops the reasoning of earlier rounds."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest

from agentserve.analyze.causes import Cause
from agentserve.analyze.render import Renderer
from tests.analyze.scenarios import (
    ANSWER,
    THANKS,
    TOOLS,
    USER,
    Message,
    base_messages,
    rows_of,
    system,
    three_requests,
    tool,
)

# (request, message index, cause, words in the detail) of the first break; None: no break.
Expected = tuple[int, int, Cause, str] | None


def _tools_variant(change: Callable[[list[Message]], None]) -> list[Message]:
    tools = copy.deepcopy(TOOLS)
    change(tools)
    return three_requests(base_messages(), third_tools=tools)


def _edit(index: int, **fields: object) -> list[Message]:
    messages = base_messages()
    messages[index] = {**messages[index], **fields}
    return three_requests(messages)


def _agent_id(before: str, after: str) -> list[Message]:
    earlier = [system(text=f"You are agent {before}."), *base_messages()[1:]]
    return three_requests(
        earlier, third_system=system(text=f"You are agent {after}."), earlier=earlier
    )


def _counted(attempt: int) -> list[Message]:
    """The task carries an attempt counter; the third request counts up."""
    earlier = base_messages()
    earlier[1] = {"role": "user", "content": f"Attempt 1: {USER['content']}"}
    third = copy.deepcopy(earlier)
    third[1] = {"role": "user", "content": f"Attempt {attempt}: {USER['content']}"}
    return three_requests(third, earlier=earlier)


def _arguments_reordered() -> list[Message]:
    messages = base_messages()
    messages[2]["tool_calls"][0]["function"]["arguments"] = (
        '{"limit": 40, "path": "tests/test_add.py"}'
    )
    return three_requests(messages)


def _keys_reordered(tools: list[Message]) -> None:
    function = tools[0]["function"]
    tools[0]["function"] = {k: function[k] for k in ("name", "parameters", "description")}


def _describe(tools: list[Message]) -> None:
    tools[1]["function"]["description"] = "Run the tests."


def _fourth_with_result(content: str) -> list[Message]:
    messages = base_messages()
    requests = three_requests(copy.deepcopy(messages))
    messages[5]["content"] = content
    requests.append({"tools": TOOLS, "messages": [*messages, ANSWER, THANKS]})
    return requests


def _truncated() -> list[Message]:
    lines = base_messages()[5]["content"].splitlines()
    return _fourth_with_result("\n".join(lines[:8]) + "\n... [32 lines truncated]")


def _turn_removed() -> list[Message]:
    talk = [
        system(),
        {"role": "user", "content": "What does add do?"},
        {"role": "assistant", "content": "It adds two numbers and returns the sum."},
        {"role": "user", "content": "And sub?"},
        {"role": "assistant", "content": "It subtracts the second number from the first."},
        {"role": "user", "content": "Thanks. Now mul?"},
    ]
    return [
        {"messages": talk[:2], "response": talk[2]},
        {"messages": talk[:4], "response": talk[4]},
        {"messages": [talk[0], *talk[3:]]},
    ]


def _think_dropped_by_harness() -> list[Message]:
    think = {
        "role": "assistant",
        "content": "<think>\nCheck the file first.\n</think>\n\nLet me look at the test.",
    }
    shown = {**think, "content": "Let me look at the test."}
    ok = {"role": "user", "content": "ok"}
    return [
        {"messages": [system(), USER], "response": think},
        {"messages": [system(), USER, think, ok], "response": ANSWER},
        {"messages": [system(), USER, shown, ok, ANSWER, THANKS]},
    ]


def _reply_changed() -> list[Message]:
    messages = base_messages()
    messages[4]["tool_calls"][0]["function"]["arguments"] = '{"target": "tests"}'
    return three_requests(messages)


_NO_TOOLS = {"smollm2": None}  # SmolLM2's template ignores tools: nothing to see, no break
_REASONING_FIRST = (4, 2, Cause.REASONING_DROPPED, "template")  # a new user message comes first
SCENARIOS: dict[str, tuple[Callable[[], list[Message]], dict[str, Expected]]] = {
    "clean": (lambda: three_requests(base_messages()), {}),
    "timestamp": (
        lambda: three_requests(base_messages(), third_system=system("10:00:42")),
        {"*": (3, 0, Cause.VOLATILE, "'10:00:00' → '10:00:42'")},
    ),
    "counter in the task": (
        lambda: _counted(2),
        {"*": (3, 1, Cause.VOLATILE, "counter '1' → '2'")},
    ),
    "random id in the system prompt": (
        lambda: _agent_id("run-8f3a2b1c", "run-91ffe0a7"),
        {"*": (3, 0, Cause.VOLATILE, "id 'run-8f3a2b1c' → 'run-91ffe0a7'")},
    ),
    "tools reordered": (
        lambda: three_requests(base_messages(), third_tools=TOOLS[::-1]),
        {"*": (3, 0, Cause.TOOLS_REORDERED, "read_file, run_tests, write_file →"), **_NO_TOOLS},
    ),
    "tool added": (
        lambda: three_requests(base_messages(), third_tools=[*TOOLS, tool("grep", "Search.")]),
        {"*": (3, 0, Cause.TOOLS_ADDED, "grep"), **_NO_TOOLS},
    ),
    "tool removed": (
        lambda: three_requests(base_messages(), third_tools=TOOLS[:2]),
        {"*": (3, 0, Cause.TOOLS_REMOVED, "write_file"), **_NO_TOOLS},
    ),
    "tool changed": (
        lambda: _tools_variant(_describe),
        {"*": (3, 0, Cause.TOOLS_CHANGED, "run_tests"), **_NO_TOOLS},
    ),
    "tool keys reordered": (
        lambda: _tools_variant(_keys_reordered),
        {"*": (3, 0, Cause.SERIALIZATION, "tool definitions"), **_NO_TOOLS},
    ),
    "arguments keys reordered": (  # SmolLM2's template does not render tool calls
        _arguments_reordered,
        {"*": (3, 2, Cause.SERIALIZATION, "keys"), **_NO_TOOLS},
    ),
    "result whitespace": (
        lambda: _edit(3, content="def test_add():\n  assert add(1, 2) == 4\n"),
        {"*": (3, 3, Cause.SERIALIZATION, "whitespace")},
    ),
    "reasoning_content dropped": (  # only the Qwen3-style template renders it
        lambda: _edit(2, reasoning_content=None),
        {"qwen3_style": (3, 2, Cause.REASONING_DROPPED, "the harness")},
    ),
    "inline reasoning dropped": (  # the Qwen3-style template already dropped it itself
        _think_dropped_by_harness,
        {
            "*": (3, 2, Cause.REASONING_DROPPED, "the harness"),
            "qwen3_style": (2, 2, Cause.REASONING_DROPPED, "the template"),
        },
    ),
    "tool result truncated": (
        _truncated,
        {
            "*": (4, 5, Cause.TOOL_RESULT_REWRITTEN, "truncated: 1896 → 374"),
            "qwen3_style": _REASONING_FIRST,
        },
    ),
    "tool result summarized": (
        lambda: _fourth_with_result("1 test failed: assertion add(1, 2) == 4"),
        {"*": (4, 5, Cause.TOOL_RESULT_REWRITTEN, "summarized"), "qwen3_style": _REASONING_FIRST},
    ),
    "turn removed": (_turn_removed, {"*": (3, 1, Cause.TURN_REMOVED, "messages 1-2")}),
    "system prompt changed": (
        lambda: _edit(0, content=system(text="You are a careful coding agent.")["content"]),
        {"*": (3, 0, Cause.SYSTEM_PROMPT_CHANGED, "changed")},
    ),
    "user message edited": (
        lambda: _edit(1, content="The test in tests/test_add.py fails. Please fix it."),
        {"*": (3, 1, Cause.MESSAGE_EDITED, "(user) was changed")},
    ),
    "reply sent back changed": (
        _reply_changed,
        {"*": (3, 4, Cause.MESSAGE_EDITED, "not the reply"), **_NO_TOOLS},
    ),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_break_cause(scenario: str, any_template: tuple[str, Renderer]) -> None:
    name, renderer = any_template
    build, expected_by_template = SCENARIOS[scenario]
    expected = expected_by_template.get(name, expected_by_template.get("*"))
    rows = rows_of(renderer, build())
    breaks = [(r.request, r.prefix_break) for r in rows if r.prefix_break is not None]
    if expected is None:
        assert breaks == []
        return
    request, message_index, cause, words = expected
    assert breaks, f"no break found, expected {cause}"
    found_request, brk = breaks[0]
    assert (found_request, brk.message_index, brk.cause) == (request, message_index, cause)
    assert words in brk.detail
    assert brk.old != brk.new
    row = rows[request - 1]
    assert row.reusable_tokens == brk.position
    assert row.prefill_tokens == row.prompt_tokens - brk.position
    assert row.hybrid_reusable_tokens <= row.reusable_tokens


def test_volatile_break_position_is_the_first_differing_token(
    any_template: tuple[str, Renderer],
) -> None:
    name, renderer = any_template
    rows = rows_of(renderer, three_requests(base_messages(), third_system=system("10:00:42")))
    brk = rows[2].prefix_break
    previous = renderer.text([*base_messages()[:4], base_messages()[4]], TOOLS, generation=False)
    differs_at = previous.index("10:00:00") + len("10:00:")  # "0" → "4"
    assert brk.char == differs_at
    if name != "qwen3_style":  # the bundled tokenizers split digits: the break is that digit
        assert brk.position == len(renderer.tokenizer.encode(previous[:differs_at]))
    assert "10:00:00" in brk.old and "10:00:42" in brk.new


def test_append_only_session_reuses_the_whole_previous_sequence(
    any_template: tuple[str, Renderer],
) -> None:
    _, renderer = any_template
    messages = base_messages()
    rows = rows_of(renderer, three_requests(messages))
    expected = [(messages[:2], messages[2]), (messages[:4], messages[4])]
    for row, (prompt, reply) in zip(rows[1:], expected, strict=True):
        full = renderer.rendering([*prompt, reply], TOOLS, generation=False)
        assert row.reusable_tokens == row.hybrid_reusable_tokens == len(full)
        assert row.prefix_break is None
