"""Tool parsers: fixtures parsed at once and streamed split at every boundary agree."""

from __future__ import annotations

import json

import pytest

from agentserve.server.tool_parsers import StreamingToolParser, ToolCall, extract, get_parser

TOOLS = {
    "read_file": {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
    "run_tests": {"name": "run_tests", "parameters": {"type": "object", "properties": {
        "target": {"type": "string"}, "verbose": {"type": "boolean"}, "n": {"type": "integer"}}}},
}
RF = ToolCall("read_file", json.dumps({"path": "src/a.py"}))

# (parser, text, expected content, expected calls)
FIXTURES = [
    ("hermes", '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/a.py"}}\n</tool_call>', None, [RF]),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "src/a.py"}}', "Let me look.", [RF]),
    ("hermes", '<tool_call>{"name": "read_file", "arguments": {"path": "src/a.py"}}</tool_call>\n'
               '<tool_call>{"name": "run_tests", "arguments": {}}</tool_call>', None,
     [RF, ToolCall("run_tests", "{}")]),
    ("json", '{"name": "read_file", "arguments": {"path": "src/a.py"}}', None, [RF]),
    ("json", '```json\n{"name": "read_file", "arguments": {"path": "src/a.py"}}\n```', None, [RF]),
    ("json", '\n[{"name": "read_file", "parameters": {"path": "src/a.py"}}]', None, [RF]),
    ("json", '{"name": "unknown_tool", "arguments": {}}', '{"name": "unknown_tool", "arguments": {}}', []),
    ("json", "The file is fine.  ", "The file is fine.  ", []),
    ("json", "```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    ("qwen3_xml", "<tool_call>\n<function=run_tests>\n<parameter=target>\ntests/x.py\n</parameter>\n"
                  "<parameter=verbose>\ntrue\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>",
     None, [ToolCall("run_tests", json.dumps({"target": "tests/x.py", "verbose": True, "n": 3}))]),
    ("qwen3_xml", "Checking.\n<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n</function>",
     "Checking.", [RF]),
    ("hermes", "No tools needed: 2 < 3 and <tool_ is not a tag.", "No tools needed: 2 < 3 and <tool_ is not a tag.", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
]
CASES = FIXTURES + [("auto", t, c, k) for _, t, c, k in FIXTURES]


def streamed(parser_name: str, pieces: list[str]):
    sp = StreamingToolParser(get_parser(parser_name), TOOLS)
    content = "".join(sp.feed(p) for p in pieces)
    rest, parsed = sp.finish()
    return (content + rest) or None, list(parsed.calls)


@pytest.mark.parametrize("parser_name, text, content, calls", CASES)
def test_one_shot(parser_name, text, content, calls):
    out = extract(get_parser(parser_name), text, TOOLS)
    assert out.content == content
    assert list(out.calls) == calls


@pytest.mark.parametrize("parser_name, text, content, calls", CASES)
def test_streamed_at_every_split_matches_one_shot(parser_name, text, content, calls):
    assert streamed(parser_name, list(text)) == (content, calls)  # one character at a time
    for i in range(len(text) + 1):
        assert streamed(parser_name, [text[:i], text[i:]]) == (content, calls)


def test_plain_text_streams_before_the_end():
    sp = StreamingToolParser(get_parser("auto"), TOOLS)
    assert sp.feed("The answer ") == "The answer"
    assert sp.feed("is 4. <tool") == " is 4."
    assert sp.feed("_call>") == ""


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="unknown tool parser 'x'"):
        get_parser("x")
