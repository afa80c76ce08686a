"""Faults over HTTP (in-process, SmolLM2): unlucky parameters are safe, one request's failure
stays its own, and an engine failure fails everything clearly and turns /health to 503."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentserve.engine.engine import RunResult

pytestmark = pytest.mark.slow
M = "smollm2-135m"


def chat(content: str, **kw) -> dict:
    return {"model": M, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **kw}


class Injected:
    """Wraps the real runner: fails the row of any request with seed 666, raises (an
    unrecoverable step failure) when a request with seed 999 is in the batch."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def run(self, batch) -> RunResult:
        if any(c.sampling.seed == 999 for c in batch.chunks):
            raise RuntimeError("injected device failure")
        result = self.inner.run(batch)
        bad = {c.request_id for c in batch.chunks if c.sample and c.sampling.seed == 666}
        return RunResult({r: t for r, t in result.sampled.items() if r not in bad},
                         {**result.failed, **{r: "injected row failure" for r in bad}})


@pytest.fixture
def injected(smol_llm, monkeypatch):
    monkeypatch.setattr(smol_llm.engine, "runner", Injected(smol_llm.engine.runner))


QUESTIONS = ["Name a fruit.", "Say hi.", "Count to three.", "What is 2+2?"]


def test_tiny_temperature_beside_normal_requests(run_with_client):
    async def go(c, state):
        alone = [(await c.post("/v1/chat/completions", json=chat(q))).json() for q in QUESTIONS]
        together = await asyncio.gather(
            *(c.post("/v1/chat/completions", json=chat(q)) for q in QUESTIONS),
            c.post("/v1/chat/completions", json=chat("Tell a story.", temperature=1e-40, seed=1)))
        assert [r.status_code for r in together] == [200] * 5
        for a, r in zip(alone, together):
            assert r.json()["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    run_with_client(go)


def test_one_failing_request_gets_its_error_and_the_others_finish(run_with_client, injected):
    async def go(c, state):
        alone = [(await c.post("/v1/chat/completions", json=chat(q))).json() for q in QUESTIONS]
        together = await asyncio.gather(
            *(c.post("/v1/chat/completions", json=chat(q)) for q in QUESTIONS),
            c.post("/v1/chat/completions", json=chat("Fail.", seed=666)),
            c.post("/v1/chat/completions", json=chat("Fail.", seed=666, stream=True)))
        for a, r in zip(alone, together):
            assert r.status_code == 200
            assert r.json()["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
        failed = together[4]
        assert failed.status_code == 500
        err = failed.json()["error"]
        assert err["code"] == "request_failed" and "injected row failure" in err["message"]
        events = [line[6:] for line in together[5].text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "injected row failure" in json.loads(events[-2])["error"]["message"]
        assert (await c.get("/health")).status_code == 200
        metrics = (await c.get("/metrics")).text
        assert 'agentserve_request_errors_total{status="500"} 1.0' in metrics
    run_with_client(go)


def test_an_engine_failure_fails_every_request_and_health(run_with_client, injected):
    async def go(c, state):
        long = chat("Write a long poem.", max_tokens=200, stream=True)
        streams = [asyncio.ensure_future(c.post("/v1/chat/completions", json=long)) for _ in range(2)]
        await asyncio.sleep(0.5)  # the two are running
        boom = await c.post("/v1/chat/completions", json=chat("Crash.", seed=999))
        assert boom.status_code == 503 and boom.json()["error"]["code"] == "engine_failed"
        for s in await asyncio.gather(*streams):
            events = [line[6:] for line in s.text.splitlines() if line.startswith("data: ")]
            assert "injected device failure" in json.loads(events[-2])["error"]["message"]
        health = await c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "injected device failure" in health.json()["reason"]
        after = await c.post("/v1/chat/completions", json=chat("Anyone there?"))
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_failed"
    run_with_client(go)
