"""Validated at the door: every field, any JSON in any position, a 400 naming the field.

No model: a body that fails validation never reaches the engine, so the app runs with no LLM.
The property tests compare the server's validation with an independent validator (jsonschema)
reading the OpenAPI document the server publishes: the two must agree on every body, and every
rejection must name a field that is in the body (or the required one that is missing).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import jinja2
import jsonschema
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentserve.server.app import ServerState, build_app
from agentserve.server.chat import build_chat_prompt
from agentserve.server.errors import APIError
from agentserve.server.protocol import ChatCompletionRequest
from agentserve.server.tool_parsers import get_parser

M = "m"
USER = [{"role": "user", "content": "hi"}]
CHAT: dict[str, Any] = {
    "model": M, "max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop": ["x"], "seed": 1,
    "n": 1, "stream": False, "stream_options": {"include_usage": True}, "logprobs": False,
    "ignore_eos": False, "min_tokens": 0, "return_token_ids": False, "session_id": "s",
    "trajectory_id": "t", "cache_salt": "c", "tool_choice": "auto", "max_completion_tokens": 8,
    "parallel_tool_calls": True,
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "u"},
        {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}],
    "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}],
}
CHAT_NAMED: dict[str, Any] = {
    **CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}, "stop": "x", "logprobs": None,
    "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "b"}]},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "c2", "function": {"name": "f", "arguments": {"a": "x"}}}]}]}
COMPLETION: dict[str, Any] = {"model": M, "prompt": [1, 2, 3], "max_tokens": 4, "echo": False, "stop": "x"}
COMPLETION_TEXT: dict[str, Any] = {"model": M, "prompt": ["text"], "seed": 3, "top_k": -1, "stream": True}


class _NoModel:
    """Validation runs before the model is touched; anything that gets further fails loudly."""


@pytest.fixture(scope="module")
def app():
    return build_app(ServerState(llm=_NoModel(), model_name=M, tool_parser=get_parser("auto")))


@pytest.fixture(scope="module")
def client(app):
    return TestClient(app, raise_server_exceptions=False)  # no `with`: no lifespan, no engine


def post(client: TestClient, path: str, body: Any) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # ASCII: escapes surrogates
    return client.post(path, content=raw, headers={"content-type": "application/json"})


BAD = [  # (body, param, words in the message)
    ({"model": M, "messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]},
     "messages[0].content[0].text", "must be a string, got 123"),
    ({"model": M, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "text-only model"),
    ({"model": M, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "messages[0].content[0]", "input_audio content parts are not supported"),
    ({"model": M, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "messages[0].content[0]", "of type 'text'"),
    ({"model": M, "messages": [{"role": "user", "content": 7}]}, "messages[0].content", "got 7"),
    ({"model": M, "messages": USER, "max_tokens": "5"}, "max_tokens", "must be an integer"),
    ({"model": M, "messages": USER, "max_tokens": True}, "max_tokens", "must be an integer, got true"),
    ({"model": M, "messages": USER, "max_tokens": 2.5}, "max_tokens", "must be an integer"),
    ({"model": M, "messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
    ({"model": M, "messages": USER, "temperature": 2.5}, "temperature", "at most 2.0"),
    ({"model": M, "messages": USER, "temperature": "0"}, "temperature", "must be a number"),
    ({"model": M, "messages": USER, "top_p": 0}, "top_p", "greater than 0.0"),
    ({"model": M, "messages": USER, "top_k": -3}, "top_k", "at least -1"),
    ({"model": M, "messages": USER, "min_tokens": -1}, "min_tokens", "at least 0"),
    ({"model": M, "messages": USER, "seed": 2**63}, "seed", "at most 9223372036854775807"),
    ({"model": M, "messages": USER, "stream": "true"}, "stream", "must be a boolean"),
    ({"model": M, "messages": USER, "stream": 1}, "stream", "must be a boolean"),
    ({"model": M, "messages": USER, "stop": [""]}, "stop[0]", "is empty"),
    ({"model": M, "messages": USER, "stop": ["s"] * 17}, "stop", "at most 16 items"),
    ({"model": M, "messages": USER, "stop": "x" * 513}, "stop", "at most 512 characters"),
    ({"model": M, "messages": USER, "stop": {"a": 1}}, "stop", "a string, an array of strings or null"),
    ({"model": M, "messages": USER, "session_id": "x" * 257}, "session_id", "at most 256"),
    ({"model": M, "messages": USER, "session_id": ""}, "session_id", "is empty"),
    ({"model": M, "messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content", "surrogate"),
    ({"model": M, "messages": USER, "tool_choice": "any"}, "tool_choice", "'none', 'auto' or 'required'"),
    ({"model": M, "messages": USER, "tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function", "must name the function"),
    ({"model": M, "messages": USER, "tools": [{"function": {"name": "f", "parameters": {
        "a": json.loads("[" * 40 + "]" * 40)}}}]}, "tools[0].function.parameters", "nested more than 32"),
    ({"model": M, "messages": [{"role": "user"}, {"content": "x"}]}, "messages[1].role", "is required"),
    ({"messages": USER}, "model", "model is required"),
    ({"model": M, "messages": USER, "temperature": None}, "temperature", "must be a number, got null"),
]


@pytest.mark.parametrize("body, param, words", BAD, ids=[b[1] + ":" + b[2][:20] for b in BAD])
def test_bad_chat_field_is_a_400_naming_it(client, body, param, words):
    r = post(client, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and words in err["message"] and err["message"].startswith(param), err


BAD_PROMPTS = [("", "prompt", "prompt is empty"), ([], "prompt", "prompt is empty"),
               ([1, "a"], "prompt[1]", "must be an integer"), ([1, -1], "prompt[1]", "at least 0"),
               ([True], "prompt[0]", "must be an integer, got true"), (["a", "b"], "prompt", "at most 1 item"),
               ([[1], [2]], "prompt", "at most 1 item"), ([[]], "prompt[0]", "is empty"),
               ({"text": "x"}, "prompt", "one-element array"), (None, "prompt", "got null")]


@pytest.mark.parametrize("prompt, param, words", BAD_PROMPTS, ids=[repr(p[0])[:12] for p in BAD_PROMPTS])
def test_bad_prompt_is_a_400_naming_it(client, prompt, param, words):
    r = post(client, "/v1/completions", {"model": M, "prompt": prompt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.json()


@pytest.mark.parametrize("raw, words", [
    (b'{"model": "m", "messages": [', "malformed JSON"), (b"\xff\xfe\x00", "not UTF-8"), (b"{\"a\": \"\x80\"}", "not UTF-8"),
    (b'{"model": "m", "n": ' + b"9" * 5000 + b"}", "malformed JSON"),
    (b"[" * 100_000, "malformed JSON"), (b"[1, 2]", "must be a JSON object, got an array"),
    (b'{"model": "m", "messages": [{"role": "user"}], "temperature": NaN}', "temperature must be a finite number"),
    (b'{"model": "m", "messages": [{"role": "user"}], "top_p": Infinity}', "top_p must be a finite number"),
    (b"", "request body is required"),
])
def test_unreadable_body_is_a_400(client, raw, words):
    r = post(client, "/v1/chat/completions", raw)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_body_that_is_not_json_is_a_400(client):
    r = client.post("/v1/chat/completions", content=b"hello", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]


def test_openapi_documents_the_errors_and_the_stream(app):
    doc = app.openapi()
    assert "Error" in doc["components"]["schemas"] and "HTTPValidationError" not in doc["components"]["schemas"]
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            assert "422" not in op["responses"], (path, method)
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "409", "500"} <= set(chat)
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletion"}
    assert doc["components"]["schemas"]["ChatChoice"]["properties"]["finish_reason"]["enum"] == [
        "stop", "length", "tool_calls", "abort"]
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain; version=0.0.4"}


# --- the server's validation against jsonschema on the published document ------------------

KEYS = st.sampled_from(["type", "text", "name", "role", "content", "id", "function", "arguments", "x"])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6) | st.sampled_from(["text", "function", "user", "auto", "", "f", "c1"]),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(KEYS | st.text(max_size=4), kids, max_size=3),
    max_leaves=6)


def _paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at] if at else []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        out += _paths(v, (*at, k))
    return out


def _mutate(body: dict[str, Any], path: tuple[Any, ...], value: Any, op: str, key: str) -> dict[str, Any]:
    """`op` at `path`: replace its value, delete it, or add `key` to it (when it is an object)."""
    body = copy.deepcopy(body)
    node = body
    for k in path[:-1]:
        node = node[k]
    if op == "delete":
        del node[path[-1]]
    elif op == "add" and isinstance(node[path[-1]], dict):
        node[path[-1]][key] = value
    else:
        node[path[-1]] = value
    return body


def _resolves(param: str, body: Any) -> bool:
    """`param` (messages[0].content) names a position that is in the body, or a key one level
    below one (a required field that is missing)."""
    node = body
    for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", param):
        if index:
            if not (isinstance(node, list) and int(index) < len(node)):
                return False
            node = node[int(index)]
        elif isinstance(node, dict):
            node = node.get(key)
        else:
            return False
    return True


def _check_agreement(app, client, route: str, model: str, body: dict[str, Any]) -> None:
    doc = app.openapi()
    schema = {"$ref": f"#/components/schemas/{model}", "components": doc["components"]}
    documented = jsonschema.Draft202012Validator(schema).is_valid(body)
    from agentserve.server import protocol
    try:
        getattr(protocol, model).model_validate(body)
        accepted = True
    except Exception:
        accepted = False
    assert accepted == documented, (body, accepted, documented)
    if not accepted:
        r = post(client, route, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] is None or _resolves(err["param"], body), (err, body)


def _mutations(*bases: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A base body with one position replaced by any JSON value, deleted, or given a new key."""
    where = st.sampled_from([(base, path) for base in bases for path in _paths(base)])
    return st.builds(lambda at, value, op, key: _mutate(at[0], at[1], value, op, key), where, JSON_VALUES,
                     st.sampled_from(["replace", "delete", "add"]), KEYS)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_mutations(CHAT, CHAT_NAMED))
def test_chat_validation_matches_the_documented_schema(app, client, body):
    _check_agreement(app, client, "/v1/chat/completions", "ChatCompletionRequest", body)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_mutations(COMPLETION, COMPLETION_TEXT))
def test_completion_validation_matches_the_documented_schema(app, client, body):
    _check_agreement(app, client, "/v1/completions", "CompletionRequest", body)


# --- the chat template and the tokenizer ---------------------------------------------------

class _Tokenizer:
    """A tokenizer whose template or encoder raises what real ones raise on odd input."""

    def __init__(self, render: Exception | None = None, encode: Exception | None = None) -> None:
        self.render_error, self.encode_error = render, encode

    def apply_chat_template(self, messages: Any, **_: Any) -> str:
        if self.render_error is not None:
            raise self.render_error
        return "".join(str(m["content"]) for m in messages)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.encode_error is not None:
            raise self.encode_error
        return [ord(c) for c in text]


@pytest.mark.parametrize("tokenizer", [
    _Tokenizer(render=jinja2.exceptions.TemplateError("Conversation roles must alternate")),
    _Tokenizer(render=TypeError("can only concatenate str (not \"NoneType\") to str")),
    _Tokenizer(render=KeyError("tool_calls")), _Tokenizer(render=IndexError("list index out of range")),
    _Tokenizer(render=RecursionError("maximum recursion depth exceeded")),
    _Tokenizer(encode=TypeError("TextEncodeInput must be Union[...]")), _Tokenizer(encode=ValueError("bad")),
], ids=["TemplateError", "TypeError", "KeyError", "IndexError", "RecursionError", "encode TypeError",
        "encode ValueError"])
def test_what_the_template_or_tokenizer_raises_is_a_400_naming_messages(tokenizer):
    req = ChatCompletionRequest.model_validate({"model": M, "messages": USER})
    with pytest.raises(APIError) as info:
        build_chat_prompt(req, tokenizer)
    assert info.value.status == 400 and info.value.param == "messages"
    assert "chat template" in info.value.message or "tokenizer" in info.value.message


def test_call_arguments_that_json_cannot_convert_are_a_400():
    deep = "[" * 5000 + "]" * 5000
    for arguments, words in [("{oops", "not valid JSON"), ('{"a": ' + "1" * 5000 + "}", "not valid JSON"),
                             (deep, "not valid JSON"), ('{"a": ' + "[" * 40 + "]" * 40 + "}", "nested more"),
                             ('"just a string"', "must be a JSON object")]:
        req = ChatCompletionRequest.model_validate({"model": M, "messages": [
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": arguments}}]}]})
        with pytest.raises(APIError) as info:
            build_chat_prompt(req, _Tokenizer())
        assert info.value.status == 400 and words in info.value.message, info.value.message
        assert info.value.param == "messages[0].tool_calls[0].function.arguments"
