"""tool_choice required / named: the grammar of one or more calls, and what the model then writes.

The grammar is checked string by string through llguidance (as decoding feeds it tokens); the
model's constrained output is parsed by the server and every call's arguments are validated
with jsonschema, an independent validator."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import pytest

from agentserve.engine.request import Guide
from agentserve.model.guided import GuidedDecoding
from agentserve.model.loader import default_cache_root, load_tokenizer, resolve_model_dir
from agentserve.server.chat import call_schema, calls_grammar
from agentserve.server.protocol import Tool

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
# a schema with local $refs: they must still resolve once the parameters sit under "arguments"
MOVE = {"type": "function", "function": {"name": "move", "parameters": {
    "type": "object", "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}},
                                          "required": ["x"], "additionalProperties": False}},
    "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME, MOVE)}
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
UTC = '{"name": "get_time", "arguments": {"tz": "UTC"}}'


@pytest.fixture(scope="module")
def ll_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(load_tokenizer(resolve_model_dir("smollm2-135m", default_cache_root())))


def accepts(ll_tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer, GuidedDecoding.grammar(Guide.lark(grammar)))
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(ll_tokenizer.tokenize_str(text)) and matcher.is_accepting()


def tools(*raw: dict) -> list[Tool]:
    return [Tool(**t) for t in raw]


@pytest.mark.parametrize("parallel, text, ok", [
    (True, PARIS, True),
    (True, f"{PARIS}\n{UTC}\n{PARIS}", True),
    (False, PARIS, True),
    (False, f"{PARIS}\n{UTC}", False),  # parallel_tool_calls false: exactly one call
    (True, f"{PARIS}\n\n{UTC}", False),  # one per line
    (True, '{"name":"get_time","arguments":{"tz":"UTC"}}', False),  # whitespace as json.dumps writes it
    (True, '{\n  "name": "get_time", "arguments": {"tz": "UTC"}}', False),
    (True, '{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}', False),  # maximum 7
    (True, '{"name": "get_weather", "arguments": {"city": "Paris"}}', False),  # days is required
    (True, '{"name": "get_time", "arguments": {"tz": "PST"}}', False),  # not in the enum
    (True, '{"name": "get_date", "arguments": {}}', False),  # not a tool
    (True, f"Sure.\n{PARIS}", False),
    (True, "", False),
])
def test_required_grammar(ll_tokenizer, parallel, text, ok):
    assert accepts(ll_tokenizer, calls_grammar(tools(WEATHER, TIME), parallel), text) is ok


def test_named_grammar_is_one_call_of_that_function(ll_tokenizer):
    grammar = calls_grammar(tools(TIME), parallel=False)
    assert accepts(ll_tokenizer, grammar, UTC)
    assert not accepts(ll_tokenizer, grammar, PARIS)
    assert not accepts(ll_tokenizer, grammar, f"{UTC}\n{UTC}")


def test_refs_resolve_under_arguments(ll_tokenizer):
    grammar = calls_grammar(tools(MOVE, WEATHER), parallel=True)
    assert accepts(ll_tokenizer, grammar, '{"name": "move", "arguments": {"to": {"x": 3}}}')
    assert not accepts(ll_tokenizer, grammar, '{"name": "move", "arguments": {"to": {"x": "3"}}}')


def test_rebasing_touches_refs_only():
    params = {"type": "object", "$defs": {"p": {"type": "integer"}}, "properties": {
        "default": {"$ref": "#/$defs/p"}, "e": {"enum": [{"$ref": "#/$defs/p"}]}, "r": {"$ref": "other.json#/p"}}}
    args = call_schema(Tool(function={"name": "f", "parameters": params}))["properties"]["arguments"]
    assert args["properties"]["default"] == {"$ref": "#/properties/arguments/$defs/p"}  # a property, not the keyword
    assert args["properties"]["e"] == params["properties"]["e"]  # enum values are data
    assert args["properties"]["r"] == {"$ref": "other.json#/p"}
    assert args["$defs"] == params["$defs"]


def events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def streamed_calls(evs: list) -> list[dict]:
    return [d["function"] for e in evs for d in e["choices"][0]["delta"].get("tool_calls", []) if e["choices"]]


def validated(calls: list[dict]) -> list[str]:
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    return [c["name"] for c in calls]


CHOICES = [  # tool_choice, parallel_tool_calls, how many calls may come back
    ("required", True, range(1, 20)),
    ("required", False, range(1, 2)),
    ({"type": "function", "function": {"name": "get_time"}}, True, range(1, 2)),
]


@pytest.mark.slow
@pytest.mark.parametrize("choice, parallel, count", CHOICES)
def test_constrained_output_parses_and_validates(run_with_client, choice, parallel, count):
    async def go(c, state):
        body = {"model": "smollm2-135m", "temperature": 0, "max_tokens": 120, "tool_choice": choice,
                "parallel_tool_calls": parallel, "tools": [WEATHER, TIME, MOVE],
                "messages": [{"role": "user", "content": "Weather in Paris for 3 days, and the time in UTC?"}]}
        r = (await c.post("/v1/chat/completions", json=body)).json()
        choice0 = r["choices"][0]
        assert choice0["finish_reason"] == "tool_calls", r
        calls = [t["function"] for t in choice0["message"]["tool_calls"]]
        assert len(calls) in count
        names = validated(calls)
        if isinstance(choice, dict):
            assert names == ["get_time"]
        s = events((await c.post("/v1/chat/completions", json={**body, "stream": True})).text)
        assert streamed_calls(s) == calls
        assert s[-1]["choices"][0]["finish_reason"] == "tool_calls"
    run_with_client(go)
