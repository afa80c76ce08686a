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
async def client_for(llm: LLM) -> AsyncIterator[tuple[httpx.AsyncClient, ServerState]]:
    state = ServerState(llm=llm, model_name="smollm2-135m", tool_parser=get_parser("auto"))
    app = build_app(state)
    state.engine = AsyncEngine(llm.engine, on_step=state.metrics.on_step)
    state.engine.start(asyncio.get_running_loop())
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            yield client, state
    finally:
        state.engine.shutdown()
        assert not llm.engine.has_unfinished()
        llm.engine.scheduler.pool.check()


@pytest.fixture
def run_with_client(smol_llm):
    """run_with_client(async_fn) runs async_fn(client, state) against a fresh app."""
    def runner(fn):
        async def main():
            async with client_for(smol_llm) as (client, state):
                return await fn(client, state)
        return asyncio.run(main())
    return runner
