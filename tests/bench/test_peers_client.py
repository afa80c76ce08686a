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
