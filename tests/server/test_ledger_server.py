"""The ledger through the real server (SmolLM2, `--residency on`): rows equal each response's
usage and the server's counters, across streaming and a client that went away; the decision
that applied, a diverged prompt located to its message, outcomes and cost per success, the
JSONL file, /metrics names, and bad input."""

from __future__ import annotations

import asyncio
import contextlib
import re

import pytest

from agentserve.api import LLM
from agentserve.ledger.reader import read_ledger
from agentserve.server.ledger_service import LedgerOptions
from tests.server.conftest import client_for
from tests.server.test_trajectories import MODEL, SYSTEM, WEATHER, next_turn

@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, dtype="float32", num_kv_blocks=512, max_model_len=2048, residency="on")


def run(llm, fn, options: LedgerOptions | None = None):
    async def main():
        async with client_for(llm, ledger_options=options) as (client, state):
            return await fn(client, state)
    return asyncio.run(main())


def first_turn(city: str, tid: str, **extra):
    return {"model": MODEL, "temperature": 0, "max_tokens": 40, "tools": [WEATHER], "tool_choice": "required",
            "trajectory_id": tid, "messages": [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": f"What is the weather in {city}?"}],
            **extra}


async def ledger_of(client, tid, **params):
    for _ in range(200):  # the row is made on the engine thread as the request ends
        r = await client.get(f"/v1/trajectories/{tid}/ledger", params=params)
        if r.status_code == 200:
            return r.json()
        await asyncio.sleep(0.01)
    raise AssertionError(r.text)


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def stream_usage(client, body):
    usage = None
    async with client.stream("POST", "/v1/chat/completions",
                             json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                import json

                usage = json.loads(line[6:]).get("usage") or usage
    return usage


def test_rows_equal_usage_and_the_servers_counters(llm):
    async def body(client, state):
        before = (await client.get("/metrics")).text
        first = first_turn("Oslo", "led-1", session_id="sess-led-1")
        r1 = (await client.post("/v1/chat/completions", json=first)).json()
        u2 = await stream_usage(client, next_turn(first, r1))
        view = await ledger_of(client, "led-1")
        while len(view["rows"]) < 2:
            view = await ledger_of(client, "led-1")
        after = (await client.get("/metrics")).text
        return r1["usage"], u2, view, before, after

    u1, u2, view, before, after = run(llm, body)
    rows = view["rows"]
    assert [(r["turn"], r["attempt"]) for r in rows] == [(1, 1), (2, 1)]
    for row, u in zip(rows, (u1, u2)):
        a = u["agentserve"]
        assert row["prompt_tokens"] == u["prompt_tokens"]
        assert row["generated_tokens"] == u["completion_tokens"]
        assert row["reused_device"] + row["reused_host"] + row["reused_disk"] == u["prompt_tokens_details"]["cached_tokens"]
        assert row["reused_device"] == a["reused_tokens_by_tier"]["device"]
        assert row["fresh_tokens"] == a["prefilled_tokens"]
        assert row["recomputed_tokens"] == a["recomputed_tokens"]
        assert row["session_id"] == "sess-led-1" and row["trajectory_id"] == "led-1"
    assert rows[0]["miss"]["reason"] in ("cold", "partial_block")
    assert rows[1]["reused_device"] > 0 and rows[1]["decision"]["action"] in ("retain", "offload", "release")
    assert rows[1]["decision"]["pause_class"] == "get_weather"
    # the ledger's vLLM-named counters moved by exactly the rows; the server's own agree
    for name, field in (("agentserve:prompt_tokens_total", "prompt_tokens"),
                        ("agentserve:generation_tokens_total", "generated_tokens")):
        assert metric(after, name) - metric(before, name) == sum(r[field] for r in rows)
    assert metric(after, "agentserve_prompt_tokens_total") == sum(r["prompt_tokens"] for r in rows)
    hits = metric(after, "agentserve:prefix_cache_hits_total") - metric(before, "agentserve:prefix_cache_hits_total")
    assert hits == sum(r["reused_device"] + r["reused_host"] + r["reused_disk"] for r in rows)
    assert metric(after, "agentserve:request_prefill_time_seconds_count") >= 2
    totals = view["summary"]["totals"]
    assert totals["attempts"] == 2 and totals["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)


def test_a_client_that_went_away_is_an_aborted_attempt_the_next_is_a_retry(llm):
    async def body(client, state):
        before = (await client.get("/metrics")).text
        first = first_turn("Lima", "led-2", tool_choice="none", max_tokens=200, ignore_eos=True)
        task = asyncio.create_task(client.post("/v1/chat/completions", json={**first, "stream": True}))
        sched = state.llm.engine.scheduler
        while not any(r.first_token_time is not None for r in list(sched.requests.values())):
            await asyncio.sleep(0.005)
        task.cancel()  # the client goes away after its first token
        with contextlib.suppress(asyncio.CancelledError):
            await task
        view = await ledger_of(client, "led-2")
        again = (await client.post("/v1/chat/completions", json={**first, "max_tokens": 4})).json()
        for _ in range(200):
            view = await ledger_of(client, "led-2")
            if len(view["rows"]) == 2:
                break
            await asyncio.sleep(0.01)
        after = (await client.get("/metrics")).text
        return view, again, before, after

    view, again, before, after = run(llm, body)
    aborted, retry = view["rows"]
    assert aborted["finish_reason"] == "abort" and aborted["generated_tokens"] < 200
    assert (aborted["turn"], aborted["attempt"], retry["turn"], retry["attempt"]) == (1, 1, 1, 2)
    assert retry["prompt_tokens"] == again["usage"]["prompt_tokens"]
    # the ledger counts every attempt; the server's request counters only the finished one
    ledger_prompt = metric(after, "agentserve:prompt_tokens_total") - metric(before, "agentserve:prompt_tokens_total")
    assert ledger_prompt == metric(after, "agentserve_prompt_tokens_total") + aborted["prompt_tokens"]
    aborts = metric(after, "agentserve:request_success_total", '{finished_reason="abort"}') - \
        metric(before, "agentserve:request_success_total", '{finished_reason="abort"}')
    assert aborts == 1


def test_a_rewritten_message_is_diverged_in_that_message_with_the_text_only_when_asked(llm):
    async def body(client, state, tid, old, new):
        first = first_turn(old, tid)
        r1 = (await client.post("/v1/chat/completions", json=first)).json()
        second = next_turn(first, r1)
        second["messages"][1] = {"role": "user", "content": f"What is the weather in {new}?"}
        await client.post("/v1/chat/completions", json=second)
        for _ in range(200):
            view = await ledger_of(client, tid)
            if len(view["rows"]) == 2:
                return view["rows"][1]
            await asyncio.sleep(0.01)

    plain = run(llm, lambda c, s: body(c, s, "led-3", "Rome", "Turin"))
    assert plain["miss"]["reason"] == "diverged" and plain["miss"]["exact"]
    assert plain["miss"]["message_index"] == 1 and plain["miss"]["role"] == "user"
    assert plain["miss"]["old"] is None and plain["miss"]["new"] is None  # no text by default
    shown = run(llm, lambda c, s: body(c, s, "led-4", "Bern", "Graz"), LedgerOptions(text_window=True))
    assert shown["miss"]["reason"] == "diverged"
    assert "Graz" in shown["miss"]["new"] and "Bern" in shown["miss"]["old"]


def test_outcomes_give_cost_per_success_and_bad_input_is_named(llm, tmp_path):
    path = tmp_path / "ledger.jsonl"

    async def body(client, state):
        for tid, city in (("task-ok", "Kyiv"), ("task-bad", "Riga")):
            await client.post("/v1/chat/completions", json=first_turn(city, tid))
            await ledger_of(client, tid)
        out = []
        for tid, ok in (("task-ok", True), ("task-bad", False)):
            r = await client.post(f"/v1/trajectories/{tid}/events", json={"event": "trajectory_finished",
                                                                          "success": ok})
            out.append((r.status_code, r.json()))
        missing = await client.post("/v1/trajectories/never-seen/events",
                                    json={"event": "trajectory_finished", "success": True})
        wrong = await client.post("/v1/trajectories/task-ok/events", json={"event": "tool_started", "success": True})
        nobool = await client.post("/v1/trajectories/task-ok/events",
                                   json={"event": "trajectory_finished", "success": "yes"})
        unknown = await client.get("/v1/trajectories/never-seen/ledger")
        other_tenant = await client.get("/v1/trajectories/task-ok/ledger", params={"cache_salt": "someone-else"})
        views = [await ledger_of(client, t) for t in ("task-ok", "task-bad")]
        return out, missing, wrong, nobool, unknown, other_tenant, views

    out, missing, wrong, nobool, unknown, other_tenant, views = run(llm, body, LedgerOptions(path=path))
    assert [c for c, _ in out] == [200, 200] and out[0][1]["success"] is True
    assert missing.status_code == 404 and "never-seen" in missing.json()["error"]["message"]
    assert wrong.status_code == 400 and "trajectory_finished" in wrong.json()["error"]["message"]
    assert nobool.status_code == 400 and "success" in nobool.json()["error"]["message"]
    assert unknown.status_code == 404 and other_tenant.status_code == 404
    ok = views[0]
    assert ok["trajectory"]["outcome"] is True and ok["summary"]["successes"] == 1
    assert ok["summary"]["cost_per_success"] == pytest.approx(ok["summary"]["totals"]["cost"])
    # the file has the same rows and both outcomes, readable by the report's reader
    book = read_ledger([path])
    assert not book.problems
    mine = [r for r in book.rows if r.trajectory_id in ("task-ok", "task-bad")]
    assert len(mine) == 2 and {o.trajectory_id: o.success for o in book.outcomes} == {"task-ok": True, "task-bad": False}
    served = dict(views[0]["rows"][0])
    cost = served.pop("cost")
    assert mine[0].as_dict() == served
    assert cost == pytest.approx(views[0]["summary"]["totals"]["cost"])  # one attempt: its cost is the task's
    text = path.read_text()
    assert SYSTEM[:30] not in text and "Kyiv" not in text  # no prompt text in the file by default


def test_cache_receipts_describe_the_reused_prefix_per_tenant(llm):
    async def body(client, state):
        out = {}
        for salt in ("tenant-a", "tenant-b"):
            req = {**first_turn("Quito", f"rcpt-{salt}"), "cache_salt": salt, "cache_receipt": True, "max_tokens": 2,
                   "tool_choice": "none"}
            first = (await client.post("/v1/chat/completions", json=req)).json()
            second = (await client.post("/v1/chat/completions", json=req)).json()
            out[salt] = (first["usage"], second["usage"])
        plain = (await client.post("/v1/chat/completions", json={**first_turn("Quito", "rcpt-c"), "max_tokens": 2,
                                                                  "tool_choice": "none"})).json()
        bad = await client.post("/v1/chat/completions", json={**first_turn("Quito", "rcpt-d"), "cache_receipt": "yes"})
        return out, plain, bad

    out, plain, bad = run(llm, body)
    (a1, a2), (b1, b2) = out["tenant-a"], out["tenant-b"]
    assert a1["agentserve"]["cache_receipt"]["objects"] == [] == b1["agentserve"]["cache_receipt"]["objects"]
    receipt = a2["agentserve"]["cache_receipt"]
    (obj,) = receipt["objects"]
    assert obj["tier"] == "device" and obj["tokens"] == a2["prompt_tokens_details"]["cached_tokens"] > 0
    assert obj["generation"] == 1 and obj["created_s"] <= obj["last_access_s"]
    assert receipt["identity_digest"] == obj["identity_digest"] and len(obj["prefix_digest"]) == 64
    other = b2["agentserve"]["cache_receipt"]["objects"][0]
    assert other["tokens"] == obj["tokens"]  # the same prompt, the same prefix length ...
    assert other["prefix_digest"] != obj["prefix_digest"] and other["object_id"] != obj["object_id"]  # ... keyed apart
    assert "cache_receipt" not in plain["usage"]["agentserve"]  # opt-in
    assert bad.status_code == 400 and "cache_receipt" in bad.json()["error"]["message"]


def test_offline_generate_binds_its_turns_to_a_trajectory(llm):
    from agentserve.engine.request import SamplingParams

    rows = []
    llm.ledger.on_row.append(rows.append)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=8)
        first = llm.encode("Offline: list three prime numbers. " * 6)
        (a,) = llm.generate([first], greedy, trajectory_id="offline-1")
        (b,) = llm.generate([first + list(a.token_ids) + llm.encode(" And three more.")], greedy,
                            trajectory_id="offline-1")
    finally:
        llm.ledger.on_row.remove(rows.append)
    r1, r2 = (next(r for r in rows if r.request_id == o.request_id) for o in (a, b))
    assert (r1.trajectory_id, r1.turn, r2.turn, r2.route) == ("offline-1", 1, 2, "offline")
    assert r2.reused_tokens == b.num_reused_tokens > 0 and r2.miss.reason == "partial_block"
