"""Every route, error and streaming path, in-process (httpx ASGI transport) on SmolLM2."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.slow

M = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}


def chat(content="Say hello.", **kw):
    return {"model": M, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **kw}


def events(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_health_models_metrics(run_with_client):
    async def go(c, state):
        assert (await c.get("/health")).json() == {"status": "ok"}
        models = (await c.get("/v1/models")).json()
        assert models["data"][0]["id"] == M
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200
        metrics = (await c.get("/metrics")).text
        for name in ("agentserve_requests_total", "agentserve_prompt_tokens_total",
                     "agentserve_reused_tokens_total", "agentserve_time_to_first_token_seconds_bucket",
                     "agentserve_kv_blocks{state=\"free\"}", "agentserve_requests_running",
                     "agentserve_queue_time_seconds_count", "agentserve_inter_token_latency_seconds_count"):
            assert name in metrics, name
    run_with_client(go)


def test_chat_usage_and_reuse(run_with_client):
    async def go(c, state):
        long = "You are a helpful assistant. " * 20
        r1 = (await c.post("/v1/chat/completions", json=chat(long + "Hi"))).json()
        r2 = (await c.post("/v1/chat/completions", json=chat(long + "Hi"))).json()
        assert r1["choices"][0]["message"]["role"] == "assistant"
        assert r1["choices"][0]["finish_reason"] in ("stop", "length")
        u = r2["usage"]
        assert u["prompt_tokens_details"]["cached_tokens"] == u["agentserve"]["reused_tokens"]
        assert u["agentserve"]["reused_tokens"] >= (u["prompt_tokens"] - 1) // 16 * 16
        assert u["agentserve"]["prefilled_tokens"] == u["prompt_tokens"] - u["agentserve"]["reused_tokens"]
        assert u["agentserve"]["time_to_first_token_ms"] > 0 and u["agentserve"]["queue_ms"] >= 0
    run_with_client(go)


def test_stream_chat_with_usage(run_with_client):
    async def go(c, state):
        r = await c.post("/v1/chat/completions", json=chat(stream=True, stream_options={"include_usage": True}))
        ev = events(r.text)
        assert ev[-1] == "[DONE]"
        assert ev[0]["choices"][0]["delta"]["role"] == "assistant"
        assert ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] >= 1
        assert ev[-3]["choices"][0]["finish_reason"] in ("stop", "length")
        streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-2])
        full = (await c.post("/v1/chat/completions", json=chat())).json()
        assert streamed == full["choices"][0]["message"]["content"]
    run_with_client(go)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_forces_a_valid_call(run_with_client, choice):
    async def go(c, state):
        body = chat("What's the weather in Paris for 3 days?", tools=[WEATHER, TIME], tool_choice=choice,
                    max_tokens=60)
        r = (await c.post("/v1/chat/completions", json=body)).json()
        msg = r["choices"][0]["message"]
        assert r["choices"][0]["finish_reason"] == "tool_calls", r
        (call,) = msg["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        tool = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
        if isinstance(choice, dict):
            assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
        # streamed: the same call arrives as a tool_calls delta
        s = events((await c.post("/v1/chat/completions", json={**body, "stream": True})).text)
        deltas = [e["choices"][0]["delta"]["tool_calls"][0] for e in s[:-1] if e["choices"][0]["delta"].get("tool_calls")]
        assert [d["function"] for d in deltas] == [call["function"]]
        assert s[-2]["choices"][0]["finish_reason"] == "tool_calls"
    run_with_client(go)


def test_completions_text_and_token_ids(run_with_client):
    async def go(c, state):
        ids = state.tokenizer.encode("def add(a, b):")
        body = {"model": M, "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "min_tokens": 6, "return_token_ids": True}
        r = (await c.post("/v1/completions", json=body)).json()
        ch = r["choices"][0]
        assert ch["prompt_token_ids"] == ids and len(ch["token_ids"]) == 6
        assert r["usage"]["completion_tokens"] == 6
        s = events((await c.post("/v1/completions", json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}})).text)
        streamed_ids = [t for e in s[:-2] for t in e["choices"][0]["token_ids"]]
        assert streamed_ids == ch["token_ids"]
        assert s[-3]["choices"][0]["prompt_token_ids"] == ids
        assert "".join(e["choices"][0]["text"] for e in s[:-2]) == ch["text"]
        t = (await c.post("/v1/completions", json={"model": M, "prompt": "Hello", "max_tokens": 3})).json()
        assert t["choices"][0]["text"] is not None
    run_with_client(go)


def test_sessions_are_recorded_and_closed(run_with_client):
    async def go(c, state):
        r = await c.post("/v1/chat/completions", json=chat(session_id="s1", trajectory_id="task-9"))
        assert r.json()["usage"]["agentserve"]["session_id"] == "s1"
        r = await c.post("/v1/chat/completions", json=chat(), headers={"X-Session-Id": "s1"})
        info = (await c.get("/v1/sessions/s1")).json()
        assert info["trajectory_id"] == "task-9" and info["num_requests"] == 2 and info["prompt_tokens"] > 0
        assert (await c.post("/v1/sessions/s1/close")).json()["closed"] is not None
        r = await c.post("/v1/chat/completions", json=chat(session_id="s1"))
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_closed"
        r = await c.post("/v1/sessions/nope/close")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    run_with_client(go)


BAD = [
    ("malformed json", "/v1/chat/completions", b'{"model": "x", "messages": [', 400, "malformed JSON"),
    ("wrong type", "/v1/chat/completions", {"model": M, "messages": "hi"}, 400, "messages"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
     404, "not served"),
    ("empty messages", "/v1/chat/completions", {"model": M, "messages": []}, 400, "messages"),
    ("unknown role", "/v1/chat/completions", {"model": M, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("orphan tool message", "/v1/chat/completions", {"model": M, "messages": [
        {"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c1", "content": "42"}]},
     400, "answers no earlier assistant tool call"),
    ("invalid tool schema", "/v1/chat/completions", {**chat(), "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]}, 400, "invalid JSON schema"),
    ("forced call with min_tokens", "/v1/chat/completions", chat(tools=[WEATHER], tool_choice="required",
                                                                 min_tokens=30, max_tokens=40), 400,
     "min_tokens cannot be combined with a forced tool call"),
    ("required without tools", "/v1/chat/completions", chat(tool_choice="required"), 400, "needs tools"),
    ("unknown named tool", "/v1/chat/completions", chat(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "nope"}}), 400, "not among the tools"),
    ("max_tokens zero", "/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens must be at least 1"),
    ("max_tokens negative", "/v1/completions", {"model": M, "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("n > 1", "/v1/chat/completions", chat(n=2), 400, "n=2 is not supported"),
    ("logprobs", "/v1/chat/completions", chat(logprobs=True), 400, "logprobs are not supported"),
    ("prompt over context", "/v1/completions", {"model": M, "prompt": [1] * 3000}, 400, "context is 2048"),
    ("token out of range", "/v1/completions", {"model": M, "prompt": [1, 10**7]}, 400, "out of range"),
    ("empty prompt", "/v1/completions", {"model": M, "prompt": []}, 400, "prompt is empty"),
    ("bad arguments json", "/v1/chat/completions", {"model": M, "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                               "function": {"name": "f", "arguments": "{oops"}}]}]},
     400, "arguments are not valid JSON"),
]


@pytest.mark.parametrize("name, path, body, status, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error_and_server_keeps_serving(run_with_client, name, path, body, status, message):
    async def go(c, state):
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        r = await c.post(path, **kw)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert message in err["message"], err
        ok = await c.post("/v1/chat/completions", json=chat())
        assert ok.status_code == 200
    run_with_client(go)
