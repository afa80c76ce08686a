"""The peers' client: a failure is the turn's, recorded, never the harness's."""

from __future__ import annotations

import asyncio
import json

import httpx

from agentserve.bench.peers.client import Dialect, run_script
from agentserve.bench.peers.workloads import Script, Step


def test_a_server_gone_while_ids_are_recovered_ends_the_script_with_a_recorded_error() -> None:
    # llama.cpp's stream withheld one id (a token ending inside a UTF-8 character); the second,
    # non-streamed request that reads the ids back finds the server gone
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if not body["stream"]:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        chunks = [{"tokens": [5], "stop": False},
                  {"tokens": [], "stop": True, "timings": {"cache_n": 0}, "tokens_predicted": 2}]
        return httpx.Response(200, text="".join(f"data: {json.dumps(c)}\n\n" for c in chunks))

    script = Script("s", (Step((1, 2, 3), 2), Step((4,), 2, think_s=0.0, keep_output=True)))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://peer") as client:
            return await run_script(client, Dialect("llama.cpp", "m"), script, 0.0, lambda: 0.0)

    records = asyncio.run(go())
    assert len(records) == 1  # the script stops at its failed turn; the next is never sent
    assert records[0].error.startswith("recovering ids: RemoteProtocolError: Server disconnected")
    assert records[0].generated == 2 and not records[0].recovered


def _bodies(dialect: Dialect, script: Script, name: str | None) -> list[dict]:
    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        n = body["max_tokens"]
        chunks = [{"choices": [{"token_ids": list(range(7, 7 + n))}]},
                  {"choices": [], "usage": {"completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}}]
        return httpx.Response(200, text="".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://peer") as client:
            return await run_script(client, dialect, script, 0.0, lambda: 0.0, trajectory=name)

    records = asyncio.run(go())
    assert [r.error for r in records] == [None] * len(script.steps)
    return sent


def test_the_events_dialect_names_the_trajectory_and_ends_it_with_its_last_request_only() -> None:
    script = Script("s", (Step((1, 2, 3), 2), Step((4,), 2), Step((5,), 3)))
    events = _bodies(Dialect("openai-events", "m"), script, "cc-c8/s")
    assert [b.get("trajectory_id") for b in events] == ["cc-c8/s"] * 3
    assert [b.get("agent_hints") for b in events] == [None, None, {"last_turn": True}]
    assert events[2]["prompt"] == [1, 2, 3, 7, 8, 4, 7, 8, 5]  # the context as the plain dialect builds it
    # the peers' dialect sends neither, whatever the harness knows
    plain = _bodies(Dialect("openai", "m"), script, "cc-c8/s")
    assert all("trajectory_id" not in b and "agent_hints" not in b for b in plain)
    assert [{k: v for k, v in b.items() if k not in ("trajectory_id", "agent_hints")} for b in events] == plain
