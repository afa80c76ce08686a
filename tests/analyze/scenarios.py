"""Hand-built agent sessions for the analyzer's tests: a coding agent that reads a file and runs
the tests, and helpers to run a list of requests through the analysis."""

from __future__ import annotations

import copy
import json

from agentserve.analyze.analysis import RequestRow, analyze_session
from agentserve.analyze.render import Renderer
from agentserve.analyze.transcript import parse_transcript

Message = dict[str, object]


def tool(name: str, description: str, **properties: str) -> Message:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": v} for k, v in properties.items()},
                "required": list(properties),
            },
        },
    }


TOOLS = [
    tool("read_file", "Read a file of the repository.", path="string"),
    tool("run_tests", "Run the test suite and return its output.", target="string"),
    tool("write_file", "Write a file of the repository.", path="string", text="string"),
]


def system(time: str = "10:00:00", text: str = "You are a coding agent.") -> Message:
    return {
        "role": "system",
        "content": f"{text} Current time: 2025-01-02 {time} UTC.\n"
        "Work step by step and keep answers short.",
    }


def call(call_id: str, name: str, arguments: str, reasoning: str | None = None) -> Message:
    message: Message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ],
    }
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def result(call_id: str, content: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


USER = {"role": "user", "content": "The test in tests/test_add.py fails. Fix it."}
CALL_READ = call(
    "c1",
    "read_file",
    '{"path": "tests/test_add.py", "limit": 40}',
    reasoning="First read the failing test to see what it expects.",
)
FILE = result("c1", "def test_add():\n    assert add(1, 2) == 4\n")
CALL_RUN = call(
    "c2",
    "run_tests",
    '{"target": "tests/test_add.py"}',
    reasoning="The test expects 4 for 1 + 2; run it to see the failure.",
)
PYTEST_LINES = [f"tests/test_add.py:{n}: assertion detail line {n}" for n in range(1, 41)]
PYTEST = result("c2", "\n".join(["FAILED tests/test_add.py::test_add", *PYTEST_LINES]))
ANSWER = {"role": "assistant", "content": "The test is wrong: 1 + 2 is 3. I will fix the test."}
THANKS = {"role": "user", "content": "Good, go ahead."}


def base_messages() -> list[Message]:
    """system, user, call, result, call, result: the prompt of the third request."""
    return copy.deepcopy([system(), USER, CALL_READ, FILE, CALL_RUN, PYTEST])


def three_requests(
    third: list[Message],
    third_tools: list[Message] | None = None,
    third_system: Message | None = None,
    earlier: list[Message] | None = None,
) -> list[Message]:
    """Requests 1 and 2 over `earlier` (default: the base session), then a third request with
    `third` as its messages (its system message replaced by `third_system` when given)."""
    messages = copy.deepcopy(earlier) if earlier is not None else base_messages()
    if third_system is not None:
        third = [third_system, *third[1:]]
    return [
        {"tools": TOOLS, "messages": messages[:2], "response": messages[2]},
        {"tools": TOOLS, "messages": messages[:4], "response": messages[4]},
        {
            "tools": TOOLS if third_tools is None else third_tools,
            "messages": third,
            "response": ANSWER,
        },
    ]


def rows_of(renderer: Renderer, requests: list[Message]) -> list[RequestRow]:
    """The analysis rows of `requests` (one JSONL line each)."""
    text = "\n".join(json.dumps(r) for r in requests) + "\n"
    transcript = parse_transcript(text, "test.jsonl", "requests")
    assert transcript.problems == ()
    analysis = analyze_session(renderer, transcript.sessions[0])
    assert analysis.problems == ()
    return list(analysis.rows)
