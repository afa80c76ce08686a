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
RT = ToolCall("run_tests", json.dumps({"target": "tests/", "n": 2}))
RF_JSON = '{"name": "read_file", "arguments": {"path": "src/a.py"}}'
RT_JSON = '{"name": "run_tests", "arguments": {"target": "tests/", "n": 2}}'
XML_RF = "<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n</function>\n</tool_call>"
XML_RT = ("<tool_call>\n<function=run_tests>\n<parameter=target>\ntests/\n</parameter>\n"
          "<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>")
# Several calls in one reply, in each format; then replies that are not wholly calls.
PARALLEL = [
    ("json", f"{RF_JSON}\n{RT_JSON}", None, [RF, RT]),  # what Qwen2.5-Coder-0.5B writes after a tool result
    ("json", f"{RF_JSON}\n\n{RT_JSON}\n{RF_JSON}\n", None, [RF, RT, RF]),
    ("json", f"```json\n{RF_JSON}\n{RT_JSON}\n```", None, [RF, RT]),
    ("json", f"```json\n{RF_JSON}\n```\n\n```json\n{RT_JSON}\n```", None, [RF, RT]),
    ("json", f"```\n{RF_JSON}\n\n{RT_JSON}", None, [RF, RT]),  # the reply ended inside the fence
    ("json", f"[{RF_JSON}, {RT_JSON}]", None, [RF, RT]),
    ("json", f"[{RF_JSON}]\n{RT_JSON}", None, [RF, RT]),
    ("hermes", f"<tool_call>\n{RF_JSON}\n</tool_call>\n<tool_call>\n{RT_JSON}\n</tool_call>", None, [RF, RT]),
    ("hermes", f"Two steps.\n<tool_call>\n{RF_JSON}\n{RT_JSON}\n</tool_call>\n<tool_call>\n{RF_JSON}",
     "Two steps.", [RF, RT, RF]),
    ("qwen3_xml", f"{XML_RF}\n{XML_RT}", None, [RF, RT]),
    ("qwen3_xml", f"Both.\n{XML_RT}\n{XML_RF}\n{XML_RT}", "Both.", [RT, RF, RT]),
    ("qwen3_xml", f"{XML_RF}\n{XML_RT.replace('run_tests', 'rm_rf')}", None, [RF]),
    ("qwen3_xml", XML_RT.replace("run_tests", "rm_rf"), XML_RT.replace("run_tests", "rm_rf"), []),
    # JSON values that are not calls next to calls are left out: an imagined tool result, a call
    # to a tool not offered, a call max_tokens cut off
    ("json", f'{RF_JSON}\n{{"text": "print(1)"}}', None, [RF]),
    ("json", f'{RF_JSON}\n{{"name": "rm_rf", "arguments": {{}}}}\n[1, {RT_JSON}]', None, [RF]),
    ("json", f'{RF_JSON}\n{RT_JSON}\n{{"name": "run_tests", "arguments": {{"target": "a}}[', None, [RF, RT]),
    ("hermes", f'<tool_call>\n{RF_JSON}\n</tool_call>\n<tool_call>\n{{"name": "run_tests", "arg', None, [RF]),
    # not wholly calls (prose, another language's fence, a broken value) or no call at all: content
    ("json", f"{RF_JSON}\nThen I will run the tests.", f"{RF_JSON}\nThen I will run the tests.", []),
    ("json", f"I will read it:\n{RF_JSON}", f"I will read it:\n{RF_JSON}", []),
    ("json", f"```python\n{RF_JSON}\n```", f"```python\n{RF_JSON}\n```", []),
    ("json", f"```json\n{RF_JSON}\n```\nDone.", f"```json\n{RF_JSON}\n```\nDone.", []),
    ("json", f'{RF_JSON}\n{{"name": "x"}} }}\n{RT_JSON}', f'{RF_JSON}\n{{"name": "x"}} }}\n{RT_JSON}', []),
    ("json", f'{RF_JSON}\n{{"broken": }}\n{RT_JSON}', f'{RF_JSON}\n{{"broken": }}\n{RT_JSON}', []),
    ("json", '{"path": "src/a.py"}\n[1, 2]', '{"path": "src/a.py"}\n[1, 2]', []),
    ("json", '{"name": "read_file", "arguments": {"path": "src/a', '{"name": "read_file", "arguments": {"path": "src/a', []),
    ("hermes", f"<tool_call>\n{RF_JSON}\n</tool_call>\n<tool_call>\n{RF_JSON} and more\n</tool_call>",
     f"<tool_call>\n{RF_JSON}\n</tool_call>\n<tool_call>\n{RF_JSON} and more\n</tool_call>", []),
]
FIXTURES += PARALLEL
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


def test_a_parser_that_fails_leaves_the_reply_as_content():
    from agentserve.server.tool_parsers import extract, get_parser

    deep = '{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}"
    out = extract(get_parser("auto"), deep, {"f": {}})
    assert out.calls == () and out.content == deep
