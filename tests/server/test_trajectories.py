"""Trajectories through the real server (SmolLM2, `--residency on`): identity from what clients
send or from the prompt alone, pauses inferred from tool calls, advice and decision receipts,
lifecycle events with every kind of bad input, cancel, session close, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from agentserve.api import LLM
from tests.server.conftest import runner_for

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}
SYSTEM = "You are a helpful assistant that uses tools to answer questions about the weather. " * 4


@pytest.fixture(scope="module")
def residency_llm() -> LLM:
    return LLM(MODEL, dtype="float32", num_kv_blocks=512, max_model_len=2048, residency="on")


@pytest.fixture
def run(residency_llm):
    return runner_for(residency_llm)


def first_turn(city: str = "Paris", **extra):
    """Tests share one server: a test that matches prompts by content asks about its own city."""
    return {"model": MODEL, "temperature": 0, "max_tokens": 40, "tools": [WEATHER], "tool_choice": "required",
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"What is the weather in {city}?"}], **extra}


def next_turn(first: dict, reply: dict, **extra):
    msg = reply["choices"][0]["message"]
    call = msg["tool_calls"][0]
    messages = [*first["messages"], {"role": "assistant", "content": msg["content"] or "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"}]
    body = {k: v for k, v in first.items() if k not in ("tool_choice", "messages")}
    return {**body, "messages": messages, "tool_choice": "none", "max_tokens": 8, **extra}


async def get(client, tid, **params):
    r = await client.get(f"/v1/trajectories/{tid}", params=params)
    return r.status_code, r.json()


async def wait_for(client, tid, pred, **params):
    """Responses reach the policy on the engine thread, a moment after the reply."""
    for _ in range(200):
        code, view = await get(client, tid, **params)
        if code == 200 and pred(view):
            return view
        await asyncio.sleep(0.01)
    raise AssertionError(f"{tid}: never reached the expected state: {view}")


def test_tool_call_pauses_and_the_next_turn_returns_with_a_receipt(run):
    async def go(client, state):
        body = first_turn(trajectory_id="t-tool")
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["choices"][0]["finish_reason"] == "tool_calls"
        assert reply["usage"]["agentserve"]["trajectory_id"] == "t-tool"
        view = await wait_for(client, "t-tool", lambda v: v["state"] == "paused_tool")
        assert view["pause_class"] == "get_weather" and view["protected"] and view["blocks"] > 0
        assert view["advice"]["action"] == "retain" and 0 < view["advice"]["p_return"] <= 1
        assert view["receipts"] == []
        r = await client.post("/v1/chat/completions", json=next_turn(body, reply, trajectory_id="t-tool"))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= view["blocks"] * 16 - 16
        view = await wait_for(client, "t-tool", lambda v: v["state"] == "waiting_human")
        (receipt,) = view["receipts"]
        assert receipt["outcome"] == "returned" and receipt["blocks"] == receipt["resident_blocks"]
        assert receipt["recomputed_tokens"] == 0 and receipt["gap_s"] >= 0
        assert receipt["regret_s"] == 0  # kept, and it came back to all of it
        assert view["pause_class"] == "human"
        stats = (await client.get("/v1/trajectories/stats")).json()
        assert stats["mode"] == "on" and stats["classes"]["get_weather"]["returns"] == 1
        metrics = (await client.get("/metrics")).text
        assert 'agentserve_residency_receipts_total{class="get_weather",outcome="returned"} 1.0' in metrics
        assert 'agentserve_residency_mode{mode="on"} 1.0' in metrics
    run(go)


def test_an_anonymous_trajectory_is_found_from_its_prompt(run):
    async def go(client, state):
        body = first_turn("Lyon")
        reply = (await client.post("/v1/chat/completions", json=body)).json()
        tid = reply["usage"]["agentserve"]["trajectory_id"]
        assert tid.startswith("anon-")
        await wait_for(client, tid, lambda v: v["state"] == "paused_tool")
        again = (await client.post("/v1/chat/completions", json=next_turn(body, reply))).json()
        assert again["usage"]["agentserve"]["trajectory_id"] == tid  # the same trajectory returned
        view = await wait_for(client, tid, lambda v: v["receipts"])
        assert view["num_requests"] == 2
        # an unrelated prompt starts another one
        other = (await client.post("/v1/chat/completions", json={**body, "messages": [
            {"role": "user", "content": "Something else entirely"}]})).json()
        assert other["usage"]["agentserve"]["trajectory_id"] not in (tid, None)
    run(go)


@pytest.mark.parametrize("how", ["session_body", "session_header", "prompt_cache_key", "codex_header", "user"])
def test_identity_from_what_clients_already_send(run, how):
    async def go(client, state):
        extra, headers, expect = {}, {}, f"id-{how}"
        if how == "session_body":
            extra = {"session_id": expect}
        elif how == "session_header":
            headers = {"X-Session-Id": expect}
        elif how == "prompt_cache_key":
            extra = {"prompt_cache_key": expect}
        elif how == "codex_header":
            headers = {"X-Codex-Session-Id": expect}
        else:
            extra = {"user": expect}
        r = await client.post("/v1/chat/completions", json=first_turn(**extra), headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["agentserve"]["trajectory_id"] == expect
        await wait_for(client, expect, lambda v: v["state"] == "paused_tool")
    run(go)


def test_events_apply_count_duplicates_and_reject_bad_input(run):
    async def go(client, state):
        url = "/v1/trajectories/ev/events"

        async def send(**body):
            r = await client.post(url, json=body)
            return r.status_code, r.json()

        code, out = await send(event="tool_started")
        assert code == 404 and out["error"]["code"] == "trajectory_not_found"
        assert (await send(event="model_started"))[1]["outcome"] == "applied"  # opens it
        assert (await send(event="model_started"))[1]["outcome"] == "duplicate"
        assert (await send(event="tool_finished"))[1]["outcome"] == "duplicate"  # running already
        body = first_turn(trajectory_id="ev")
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        await wait_for(client, "ev", lambda v: v["state"] == "paused_tool")
        now_ms = time.time() * 1e3
        code, out = await send(event="tool_started", tool_class="browser", expected_duration_ms=5000,
                               emitted_at_ms=now_ms)
        assert (code, out["outcome"]) == (200, "applied")
        view = (await get(client, "ev"))[1]
        assert view["pause_class"] == "browser" and "hint" in view["advice"]["reason"]
        assert (await send(event="tool_started"))[1]["outcome"] == "duplicate"
        assert (await send(event="tool_finished"))[1]["outcome"] == "applied"
        assert (await send(event="tool_finished"))[1]["outcome"] == "duplicate"
        assert (await send(event="trajectory_finished"))[1]["outcome"] == "applied"
        assert (await send(event="trajectory_finished"))[1]["outcome"] == "duplicate"
        assert (await send(event="tool_started"))[1]["outcome"] == "out_of_order"
        view = (await get(client, "ev"))[1]
        assert view["state"] == "finished" and not view["protected"]
        # another tenant's trajectory of the same id does not exist
        code, out = await send(event="trajectory_cancelled", cache_salt="someone-else")
        assert code == 404
        assert (await get(client, "ev", cache_salt="someone-else"))[0] == 404
        # bad input: 400 with what is allowed, serving continues
        code, out = await send(event="tool_exploded")
        assert code == 400 and "model_started" in out["error"]["message"] and "trajectory_cancelled" in out["error"]["message"]
        for bad in ({"expected_duration_ms": -1}, {"expected_duration_ms": 1e15}, {"emitted_at_ms": -5},
                    {"emitted_at_ms": 1.0}, {"emitted_at_ms": now_ms + 3_600_000}, {"tool_class": ""},
                    {"tool_class": "x" * 300}):
            code, out = await send(event="tool_started", **bad)
            assert code == 400, (bad, out)
            assert out["error"]["message"]
        metrics = (await client.get("/metrics")).text
        assert 'agentserve_trajectory_events_total{event="tool_finished",outcome="duplicate"} 2.0' in metrics
        assert "agentserve_residency_hint_lag_seconds_count 1.0" in metrics
        assert (await client.post("/v1/chat/completions", json=first_turn())).status_code == 200
    run(go)


def test_a_flood_of_tool_classes_stays_bounded(run):
    async def go(client, state):
        res = state.trajectories.residency
        n = res.estimator.max_classes + 4  # trajectories, each paused on a tool name nobody used before
        for i in range(n):
            r = await client.post("/v1/chat/completions", json=first_turn(
                trajectory_id=f"flood-{i}", agent_hints={"tool_class": f"tool-{i}"}))
            assert r.status_code == 200, r.text
        await wait_for(client, f"flood-{n - 1}", lambda v: v["state"] == "paused_tool")
        stats = (await client.get("/v1/trajectories/stats")).json()
        assert len(stats["classes"]) <= res.estimator.max_classes and "other" in stats["classes"]
        assert (await get(client, f"flood-{n - 1}"))[1]["pause_class"] == "other"
        metrics = (await client.get("/metrics")).text
        assert f'class="tool-{n - 1}"' not in metrics and 'class="other"' in metrics
    run(go)


def test_cancel_aborts_the_trajectorys_running_request(run):
    async def go(client, state):
        body = {"model": MODEL, "temperature": 0, "max_tokens": 1500, "ignore_eos": True, "stream": True,
                "trajectory_id": "to-cancel", "messages": [{"role": "user", "content": "Count to a thousand."}]}

        async def stream():
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                n = 0
                with contextlib.suppress(Exception):
                    async for _ in r.aiter_lines():
                        n += 1
                return n

        task = asyncio.create_task(stream())
        for _ in range(500):
            if state.trajectories.running:
                break
            await asyncio.sleep(0.01)
        r = await client.post("/v1/trajectories/to-cancel/events", json={"event": "trajectory_cancelled"})
        assert r.status_code == 200 and r.json()["aborted_requests"] == 1
        lines = await asyncio.wait_for(task, 60)
        assert lines < 1500  # it stopped early
        view = await wait_for(client, "to-cancel", lambda v: v["state"] == "cancelled")
        assert not view["protected"]
    run(go)


def test_session_close_releases_protection(run):
    async def go(client, state):
        body = first_turn(session_id="sess-close")
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        await wait_for(client, "sess-close", lambda v: v["protected"])
        assert (await client.post("/v1/sessions/sess-close/close")).status_code == 200
        view = await wait_for(client, "sess-close", lambda v: not v["protected"])
        assert view["state"] == "finished"
        (receipt,) = view["receipts"]
        assert receipt["outcome"] == "finished" and receipt["recomputed_tokens"] == 0
    run(go)


def test_residency_off_says_how_to_turn_it_on(run_with_client):
    async def go(client, state):
        r = await client.get("/v1/trajectories/stats")
        assert r.status_code == 404 and "--residency" in r.json()["error"]["message"]
        r = await client.post("/v1/trajectories/x/events", json={"event": "model_started"})
        assert r.status_code == 404
    run_with_client(go)
