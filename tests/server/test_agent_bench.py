"""The agent-4x6 client against our in-process server, on a small workload of the same shape."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from agentserve.bench.agent_bench import run_agent_bench
from agentserve.server.app import ServerState, build_app
from agentserve.server.async_engine import AsyncEngine
from agentserve.server.tool_parsers import get_parser

pytestmark = pytest.mark.slow


def small_workload(path, rng: random.Random):
    def ids(n):
        return [rng.randrange(100, 40000) for _ in range(n)]
    sets = {name: {"prefix": ids(40), "sessions": [{"task": ids(10), "tool_results": [ids(8)]} for _ in range(2)]}
            for name in ("A", "B")}
    path.write_text(json.dumps({"sets": sets, "model": "smollm2-135m"}))


def test_agent_protocol_reuses_prefix_and_previous_turns(smol_llm, tmp_path):
    small_workload(tmp_path / "w.json", random.Random(0))

    async def main():
        state = ServerState(llm=smol_llm, model_name="smollm2-135m", tool_parser=get_parser("auto"))
        app = build_app(state)
        state.engine = AsyncEngine(smol_llm.engine, on_step=state.metrics.on_step)
        state.engine.start(asyncio.get_running_loop())
        try:
            return await run_agent_bench("http://test", tmp_path / "w.json", think_s=0.0, n_out=8,
                                         transport=httpx.ASGITransport(app=app))
        finally:
            state.engine.shutdown()

    results, records = asyncio.run(main())
    assert [r.set_name for r in results] == ["A", "B"]
    assert len(records) == 8 and all(r.generated == 8 for r in records)
    for r in records:
        if r.turn == 2:  # previous prompt (50) + 7 computed reply tokens -> 3 full blocks
            assert r.cached_tokens == 48
    # the second session of each set reuses the shared 40-token prefix (2 full blocks)
    assert sorted(r.cached_tokens for r in records if r.turn == 1 and r.set_name == "A") == [0, 32]
