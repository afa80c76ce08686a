"""An in-process server on SmolLM2, driven through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from agentserve.api import LLM
from agentserve.server.app import ServerState, build_app
from agentserve.server.async_engine import AsyncEngine
from agentserve.server.tool_parsers import get_parser


@pytest.fixture(scope="session")
def smol_llm() -> LLM:
    llm = LLM("smollm2-135m", dtype="float32", num_kv_blocks=512, max_model_len=2048)
    return llm


@contextlib.asynccontextmanager
async def client_for(llm: LLM, ledger_options=None) -> AsyncIterator[tuple[httpx.AsyncClient, ServerState]]:
    from agentserve.server.ledger_service import LedgerOptions

    state = ServerState(llm=llm, model_name="smollm2-135m", tool_parser=get_parser("auto"),
                        ledger_options=ledger_options or LedgerOptions())
    app = build_app(state)
    state.engine = AsyncEngine(llm.engine, on_step=state.metrics.on_step)
    state.engine.start(asyncio.get_running_loop())
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            yield client, state
    finally:
        state.engine.shutdown()
        if state.ledger is not None:
            state.ledger.close()
        assert not llm.engine.has_unfinished()
        llm.engine.scheduler.pool.check()


def runner_for(llm: LLM):
    """runner(async_fn) runs async_fn(client, state) against a fresh app on `llm`."""
    def runner(fn):
        async def main():
            async with client_for(llm) as (client, state):
                return await fn(client, state)
        return asyncio.run(main())
    return runner


@pytest.fixture
def run_with_client(smol_llm):
    """run_with_client(async_fn) runs async_fn(client, state) against a fresh app."""
    return runner_for(smol_llm)


@contextlib.contextmanager
def http_server(llm: LLM, config=None):
    """The app on a real uvicorn server on a free 127.0.0.1 port, in a thread of this process
    (its engine on another, as `build_app`'s lifespan runs it). Yields (base_url, state)."""
    import socket
    import threading
    import time

    import uvicorn

    from agentserve.config import ServerConfig

    state = ServerState(llm=llm, model_name="smollm2-135m", tool_parser=get_parser("auto"),
                        config=config or ServerConfig())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not llm.engine.has_unfinished()
        llm.engine.scheduler.pool.check()
