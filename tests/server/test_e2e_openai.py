"""The real server as a subprocess on a loopback port, driven by the real `openai` client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time

import httpx
import jsonschema
import openai
import pytest

from agentserve.bench.served import served

pytestmark = pytest.mark.slow
M = "smollm2-135m"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served_server():
    with served(["--model", M, "--dtype", "float32", "--max-model-len", "2048"]) as s:
        yield s


@pytest.fixture(scope="module")
def server(served_server):
    return served_server.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_plain_and_streamed_chat(client):
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=M, messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model=M, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_required_tool_call_validates(client):
    r = client.chat.completions.create(
        model=M, messages=[{"role": "user", "content": "Weather in Oslo in Celsius?"}], tools=[WEATHER],
        tool_choice="required", max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_three_turn_agent_session_reuses_previous_turn(client):
    messages = [{"role": "system", "content": "You are a terse coding agent. " * 8},
                {"role": "user", "content": "What is in src/?"}]
    previous = None
    for turn in range(3):
        r = client.chat.completions.create(model=M, messages=messages, max_tokens=12, temperature=0,
                                           extra_body={"session_id": "agent-1"})
        u = r.usage
        if previous is not None:
            covered = (previous.prompt_tokens + previous.completion_tokens - 1) // 16 * 16
            assert u.prompt_tokens_details.cached_tokens >= covered, (u, previous)
        previous = u
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"Result {turn}: a.py b.py. Next?"}]


def test_eight_concurrent_streams(server):
    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        stream = await c.chat.completions.create(
            model=M, messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=16,
            temperature=0, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def main() -> list[str]:
        c = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(c, i) for i in range(8)))

    texts = asyncio.run(main())
    assert len(texts) == 8 and all(texts)


def _gauge(metrics: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", metrics, re.MULTILINE)
    assert m, name
    return float(m.group(1))


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"model": M, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
            "min_tokens": 1500, "stream": True}
    with httpx.Client(base_url=server, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(x.startswith("data: ") for x in got)
            m = h.get("/metrics").text
            assert _gauge(m, "agentserve_requests_running") == 1
            assert _gauge(m, 'agentserve_kv_blocks{state="used"}') > 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            m = h.get("/metrics").text
            if _gauge(m, "agentserve_requests_running") == 0 and _gauge(m, 'agentserve_kv_blocks{state="used"}') == 0:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"blocks not freed after disconnect:\n{m}")


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="per-thread affinity on Linux, two CPUs")
def test_serve_pins_its_compute_threads_and_no_other(served_server, client):
    # a forced call first: the compile workers and the mask pool are threads too
    client.chat.completions.create(model=M, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                   tools=[WEATHER], tool_choice="required", max_tokens=20, temperature=0)
    pid, allowed = served_server.proc.pid, set(os.sched_getaffinity(0))
    masks = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")}
    pinned = {t: m for t, m in masks.items() if m != allowed}
    assert len(masks[pid]) == 1  # the step loop's thread, the team's master
    assert all(len(m) == 1 for m in pinned.values())  # the team, one CPU each ...
    assert len({min(m) for m in pinned.values()}) == len(pinned)  # ... on distinct CPUs
    assert len(pinned) < len(masks)  # the event loop, the compile workers: every CPU
