"""Bounded under overload (in-process, SmolLM2): past a bound a request gets 429 with
Retry-After before its body is read, or 413; every accepted request completes; a streaming
client that stops reading is dropped and its blocks freed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from agentserve.config import ServerConfig
from agentserve.server.app import ServerState, build_app
from agentserve.server.async_engine import AsyncEngine
from agentserve.server.tool_parsers import get_parser

pytestmark = pytest.mark.slow
M = "smollm2-135m"


def chat(content: str = "Say hi.", **kw) -> dict:
    return {"model": M, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, **kw}


def run_app(llm, config: ServerConfig, fn):
    async def main():
        state = ServerState(llm=llm, model_name=M, tool_parser=get_parser("auto"), config=config)
        app = build_app(state)
        state.engine = AsyncEngine(llm.engine, on_step=state.metrics.on_step)
        state.engine.start(asyncio.get_running_loop())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=120) as c:
                return await fn(c, state, app)
        finally:
            state.engine.shutdown()
            assert not llm.engine.has_unfinished() and llm.engine.scheduler.pool.stats().num_used == 0
            assert state.admission.num_queued == 0 and state.admission.num_queued_tokens == 0
    return asyncio.run(main())


def test_a_burst_past_the_queue_bound_is_shed_with_429_and_the_rest_complete(smol_llm):
    async def go(c, state, app):
        rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=chat(f"Say {i}.")) for i in range(12)))
        codes = [r.status_code for r in rs]
        assert set(codes) == {200, 429} and codes.count(429) >= 8
        shed = next(r for r in rs if r.status_code == 429)
        assert int(shed.headers["retry-after"]) >= 1
        assert shed.json()["error"]["type"] == "rate_limit_error"
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        metrics = (await c.get("/metrics")).text
        assert f'agentserve_request_errors_total{{status="429"}} {codes.count(429)}.0' in metrics
    run_app(smol_llm, ServerConfig(max_queued_requests=2), go)


def test_queued_prompt_tokens_are_bounded_but_a_request_alone_runs(smol_llm):
    async def go(c, state, app):
        big = chat("word " * 400)
        alone = await c.post("/v1/chat/completions", json=big)  # over the bound, alone: runs
        assert alone.status_code == 200
        rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=big) for _ in range(3)))
        assert sorted(r.status_code for r in rs)[0] == 200 and 429 in [r.status_code for r in rs]
    run_app(smol_llm, ServerConfig(max_queued_prompt_tokens=100), go)


def test_a_body_over_the_limit_is_413_without_being_parsed(smol_llm):
    async def go(c, state, app):
        r = await c.post("/v1/chat/completions", json=chat("x" * 5000))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        async def chunks():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b" " * 1000
        r = await c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    run_app(smol_llm, ServerConfig(max_request_body_bytes=4096), go)


def test_a_streaming_client_that_stops_reading_is_dropped_and_its_blocks_freed(smol_llm):
    """Drives the ASGI app directly with a `send` that blocks forever once the stream has
    begun: what a client that stopped reading (full socket buffers) does to the server."""
    async def go(c, state, app):
        reaper = asyncio.create_task(state.reap_stalled())
        body = json.dumps(chat("Tell a long story.", max_tokens=2000, min_tokens=2000,
                               ignore_eos=True, stream=True)).encode()
        sent = []
        blocked = asyncio.Event()

        async def receive():
            if not sent:
                sent.append(1)
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # never disconnects

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                blocked.set()
                await asyncio.Event().wait()  # the client reads nothing more

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "headers": [(b"content-type", b"application/json"),
                                                  (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "scheme": "http", "root_path": ""}
        task = asyncio.create_task(app(scope, receive, send))
        sch = state.llm.engine.scheduler
        try:
            await asyncio.wait_for(blocked.wait(), 60)
            for _ in range(1200):  # until it generates: its blocks are held
                await asyncio.sleep(0.05)
                if any(r.first_token_time is not None for r in sch.requests.values()):
                    break
            assert sch.requests and sch.pool.stats().num_used > 0
            for _ in range(400):  # then the reaper drops it after the 1 s stall timeout
                await asyncio.sleep(0.05)
                if not sch.requests and sch.pool.stats().num_used == 0:
                    break
            assert not sch.requests and sch.pool.stats().num_used == 0
            assert not state.live
        finally:
            task.cancel()
            reaper.cancel()
            await asyncio.gather(task, reaper, return_exceptions=True)
    run_app(smol_llm, ServerConfig(stream_stall_timeout_s=1.0), go)
