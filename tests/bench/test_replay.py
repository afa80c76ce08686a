"""Replay against a fake OpenAI-compatible server, in process (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from agentserve.bench.replay import ReplayConfig, Replayer
from agentserve.bench.replay_cli import summarize
from agentserve.cli import main
from agentserve.workload.claude_code import read_claude_code
from agentserve.workload.load import take_sessions

CC = Path(__file__).parent.parent / "fixtures" / "traces" / "claude-code"


class FakeServer:
    """Streams max_tokens ids (prompt length + i) and usage; caches nothing but the last
    prompt per session, reporting the common prefix as cached."""

    def __init__(self, fail_every: int = 0) -> None:
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.fail_every = fail_every
        self.last: dict[str, list[int]] = {}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return httpx.Response(500, text="boom")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.001)
        self.in_flight -= 1
        prompt, n = body["prompt"], body["max_tokens"]
        prev = self.last.get(body["session_id"], [])
        cached = next((i for i, (a, b) in enumerate(zip(prev, prompt)) if a != b), min(len(prev), len(prompt)))
        ids = [len(prompt) + i for i in range(n)]
        self.last[body["session_id"]] = prompt + ids
        chunks = [{"choices": [{"index": 0, "text": "x", "token_ids": [t]}]} for t in ids]
        chunks.append({"choices": [], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": cached},
            "agentserve": {"reused_tokens": cached, "prefilled_tokens": len(prompt) - cached, "generated_tokens": n}}})
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


def replay(workload, server, **kw):
    cfg = ReplayConfig("http://127.0.0.1:9", time_scale=0.0, token_scale=1 / 64, vocab_size=5000, **kw)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
            return await Replayer(workload, cfg, client).run()

    return asyncio.run(go())


def test_open_loop_records_every_request_and_appends_replies():
    w = take_sessions(read_claude_code([CC]), 3)
    server = FakeServer()
    records = replay(w, server)
    assert len(records) == w.num_requests == len(server.bodies)
    assert all(r.error is None and r.mode == "open-loop" and r.ttft_s is not None for r in records)
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] for b in server.bodies)
    # a turn that extends the previous prompt carries the previous prompt and the generated ids
    by_session: dict[str, list[dict]] = {}
    for b in server.bodies:
        by_session.setdefault(b["session_id"], []).append(b)
    spliced = 0
    for bodies in by_session.values():
        for a, b in zip(bodies, bodies[1:]):
            gen = [len(a["prompt"]) + i for i in range(a["max_tokens"])]
            if b["prompt"][: len(a["prompt"]) + len(gen)] == a["prompt"] + gen:
                spliced += 1
    assert spliced > 0
    s = summarize(records)
    assert s["errors"] == 0 and s["cached_fraction"] > 0.5 and s["mode"] == "open-loop"


def test_closed_loop_limits_concurrency_and_is_labelled():
    w = take_sessions(read_claude_code([CC]), 5)
    server = FakeServer()
    records = replay(w, server, closed_loop=1)
    assert server.max_in_flight == 1
    assert {r.mode for r in records} == {"closed-loop(1)"}


def test_server_errors_are_recorded_and_the_run_goes_on():
    w = take_sessions(read_claude_code([CC]), 2)
    records = replay(w, FakeServer(fail_every=3))
    errors = [r for r in records if r.error]
    assert len(records) == w.num_requests and errors
    assert all("HTTP 500: boom" in r.error for r in errors)


def test_replay_cli_names_a_missing_file(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--target", "http://127.0.0.1:9"]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err


def test_replay_rejects_bad_closed_loop():
    with pytest.raises(ValueError, match="closed loop concurrency must be >= 1"):
        ReplayConfig("http://x", closed_loop=0)
