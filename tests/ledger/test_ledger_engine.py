"""The ledger on the tiny engine: every miss reason caused for real, turns and attempts, and
rows that equal the engine's own outputs (tokens by tier, recompute) and its step time."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from agentserve.config import TierConfig
from agentserve.engine.request import FinishReason, SamplingParams
from agentserve.kv.tombstones import Tombstones
from agentserve.ledger.ledger import Tag
from agentserve.trajectory.registry import State, TrajectoryKey
from agentserve.trajectory.residency import build_residency
from tests.model.hf_tiny import tiny_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
BS = 4
NUM_BLOCKS = 40  # 160 tokens: two fillers of 60 push a finished 68-token sequence out


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 256) for _ in range(n)]


def book(**kw):
    engine, _ = tiny_engine("qwen2", block_size=BS, num_blocks=kw.pop("num_blocks", NUM_BLOCKS), ledger=True, **kw)
    rows = []
    engine.ledger.on_row.append(rows.append)
    return engine, rows


def turn(engine, rows, prompt, trajectory=None, salt=None, sampling=GREEDY):
    """Run one request to its end, bound to `trajectory`; its output tokens, last output, row."""
    rid = engine.add(prompt, sampling, cache_salt=salt)
    if trajectory is not None:
        engine.ledger.bind(engine.scheduler.requests[rid], Tag((salt or "", trajectory), session_id="s1"))
    out, last = [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                out.extend(o.new_token_ids)
                last = o
    row = next(r for r in reversed(rows) if r.request_id == rid)
    return out, last, row


def test_first_turn_is_cold_then_the_next_turn_misses_only_the_old_tail():
    engine, rows = book()
    rng = random.Random(1)
    first = tokens(rng, 60)
    out, last, row = turn(engine, rows, first, "t")
    assert row.miss.reason == "cold" and row.miss.block == 0 and row.eligible_tokens == 0
    assert (row.turn, row.attempt, row.session_id) == (1, 1, "s1")
    second = first + out + tokens(rng, 10)
    _, last2, row2 = turn(engine, rows, second, "t")
    # the old sequence is 68 tokens; its last token has no KV, so it cached 16 blocks (64 tokens)
    assert row2.reused_device == 64 == last2.num_reused_tokens
    assert row2.miss.reason == "partial_block" and row2.miss.block == 16
    assert row2.eligible_tokens == 64 and row2.rebuilt_tokens == 0
    assert (row2.turn, row2.attempt) == (2, 1)


def test_evicted_under_pressure_names_the_policy_and_counts_the_rebuild():
    engine, rows = book()
    rng = random.Random(2)
    first = tokens(rng, 60)
    out, _, _ = turn(engine, rows, first, "t")
    for _ in range(3):  # other traffic: LRU evicts the paused trajectory's blocks
        turn(engine, rows, tokens(rng, 60))
    _, last, row = turn(engine, rows, first + out + tokens(rng, 10), "t")
    assert row.miss.reason == "evicted" and row.miss.cause == "capacity" and row.miss.policy == "lru"
    assert row.miss.evicted_s is not None and abs(row.miss.evicted_s - time.time()) < 60
    assert row.eligible_tokens == 64
    assert row.rebuilt_tokens == 64 - row.reused_tokens == 64 - last.num_reused_tokens


def test_a_prompt_that_rewrites_history_is_diverged_at_the_exact_token():
    engine, rows = book()
    rng = random.Random(3)
    first = tokens(rng, 60)
    out, _, _ = turn(engine, rows, first, "t")
    edited = first[:30] + [(first[30] + 1) % 250 + 2] + first[31:] + out + tokens(rng, 10)
    _, _, row = turn(engine, rows, edited, "t")
    assert row.miss.reason == "diverged" and row.miss.token == 30 and row.miss.exact
    assert row.miss.block == 7 and row.reused_tokens == 28  # blocks 0-6 are unchanged
    assert row.eligible_tokens == 28 and row.rebuilt_tokens == 0


def test_same_tokens_under_another_tenant_is_an_identity_miss():
    engine, rows = book()
    prompt = tokens(random.Random(4), 40)
    _, _, a = turn(engine, rows, prompt, "t", salt="tenant-a")
    _, _, b = turn(engine, rows, prompt, "u", salt="tenant-b")
    assert a.miss.reason == "cold"
    assert b.miss.reason == "identity" and b.miss.cause == "tenant differs" and b.reused_tokens == 0
    assert a.tenant != b.tenant and "tenant-a" not in a.tenant  # a digest, never the salt


def test_a_block_whose_tombstone_aged_out_is_evicted_unknown_never_cold():
    engine, rows = book()
    engine.scheduler.pool.tombstones.capacity = 1  # evictions forget almost at once
    rng = random.Random(5)
    first = tokens(rng, 60)
    out, _, _ = turn(engine, rows, first, "t")
    for _ in range(3):
        turn(engine, rows, tokens(rng, 60))
    _, _, row = turn(engine, rows, first + out + tokens(rng, 10), "t")
    assert row.miss.reason == "evicted" and row.miss.cause == "unknown"


@pytest.mark.parametrize("why", ["session_closed", "trajectory_finished", "protection_expired"])
def test_eviction_after_protection_ends_names_why_it_ended(why):
    residency, eviction = build_residency("on", NUM_BLOCKS, BS, time.monotonic)
    engine, rows = book(eviction=eviction)
    residency.attach(engine.scheduler.pool)
    key = TrajectoryKey("", "t")
    rng = random.Random(6)
    first = tokens(rng, 60)
    residency.on_request(key)
    out, last, _ = turn(engine, rows, first, "t")
    residency.on_response(key, last.block_hashes, State.PAUSED_TOOL, "bash")
    assert key in residency.protected
    if why == "protection_expired":
        residency.config = dataclasses.replace(residency.config, max_idle_s=0.001)
        time.sleep(0.01)
        residency.expire()
    else:
        residency.on_end(key, State.FINISHED, "session_closed" if why == "session_closed" else None)
    assert key not in residency.protected
    for _ in range(3):
        turn(engine, rows, tokens(rng, 60))
    _, _, row = turn(engine, rows, first + out + tokens(rng, 10), "t")
    assert row.miss.reason == "evicted" and row.miss.cause == why


def test_a_preempted_requests_blocks_evicted_by_its_preemptor_say_preemption():
    stones = Tombstones(time.monotonic)
    stones.note([11, 12], "preemption")
    stones.record([11, 13], "capacity", "lru")
    assert stones.get(11).cause == "preemption" and stones.get(13).cause == "capacity"
    stones.revive([12])  # computed again: the note is gone with it
    stones.record([12], "capacity", "lru")
    assert stones.get(12).cause == "capacity"


def test_preemption_on_a_small_pool_rows_count_the_recompute_exactly():
    engine, rows = book(num_blocks=24, max_num_batched_tokens=16)
    rng = random.Random(7)
    sampling = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = [engine.add(tokens(rng, 40), sampling) for _ in range(2)]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    by_id = {r.request_id: r for r in rows}
    assert sum(r.preemptions for r in rows) >= 1
    for rid in ids:
        o, r = outs[rid], by_id[rid]
        assert (r.prompt_tokens, r.reused_tokens, r.generated_tokens, r.recomputed_tokens) == \
            (o.num_prompt_tokens, o.num_reused_tokens, o.num_generated_tokens, o.num_recomputed_tokens)
        assert r.trajectory_id is None and r.route == "offline"
    assert engine.ledger.totals.recomputed == sum(o.num_recomputed_tokens for o in outs.values()) > 0


def test_turns_and_attempts_retries_and_aborts():
    engine, rows = book()
    rng = random.Random(8)
    first = tokens(rng, 30)
    out, _, r1 = turn(engine, rows, first, "t")
    _, _, r2 = turn(engine, rows, first, "t")  # the same prompt again: a retry of turn 1
    assert (r1.turn, r1.attempt, r2.turn, r2.attempt) == (1, 1, 1, 2)
    second = first + out + tokens(rng, 5)
    rid = engine.add(second, GREEDY)
    engine.ledger.bind(engine.scheduler.requests[rid], Tag(("", "t")))
    engine.step()
    engine.abort(rid)
    aborted = rows[-1]
    assert (aborted.turn, aborted.attempt, aborted.finish_reason) == (2, 1, "abort")
    _, _, r4 = turn(engine, rows, second + [7], "t")  # after a failed attempt: the same turn again
    assert (r4.turn, r4.attempt) == (2, 2)
    _, _, r5 = turn(engine, rows, tokens(rng, 20), "t")
    assert (r5.turn, r5.attempt) == (3, 1)
    assert {r.finish_reason for r in rows} == {"length", "abort"}


def test_busy_seconds_split_every_step_and_sum_to_the_engine_time():
    engine, rows = book()
    rng = random.Random(9)
    measured = []
    run = engine.runner.run

    def timed(batch):
        t0 = time.monotonic()
        try:
            return run(batch)
        finally:
            measured.append((time.monotonic() - t0, [(c.request_id, len(c.token_ids)) for c in batch.chunks]))

    engine.runner.run = timed
    ids = [engine.add(tokens(rng, n), GREEDY) for n in (10, 50, 30)]
    while engine.has_unfinished():
        engine.step()
    assert {r.request_id for r in rows} == set(ids)
    assert sum(r.busy_s for r in rows) == pytest.approx(engine.ledger.busy_s, rel=1e-9)
    assert engine.ledger.busy_s == pytest.approx(sum(t for t, _ in measured), rel=0.05, abs=1e-3)
    expected = dict.fromkeys(ids, 0.0)  # each step's time split by the tokens each request computed
    for t, chunks in measured:
        total = sum(n for _, n in chunks)
        for rid, n in chunks:
            expected[rid] += t * n / total
    for r in rows:
        assert r.busy_s == pytest.approx(expected[r.request_id], rel=0.05, abs=2e-4)


def test_tier_restores_are_split_by_tier_in_the_row(tmp_path):
    engine, rows = book(tiers=TierConfig(host_bytes=1 << 22))
    rng = random.Random(10)
    first = tokens(rng, 60)
    out, _, _ = turn(engine, rows, first, "t")
    for _ in range(3):
        turn(engine, rows, tokens(rng, 60))
    _, last, row = turn(engine, rows, first + out + tokens(rng, 10), "t")
    assert row.reused_host == last.num_host_tokens > 0
    assert row.reused_device + row.reused_host + row.reused_disk == last.num_reused_tokens
    assert row.kv_token_s.get("host", 0) > 0  # its blocks sat in host while it was away
    engine.tiers.close()


def test_an_unreadable_disk_copy_is_the_cause_of_the_miss(tmp_path):
    from tests.engine.test_tiers_exact import KEY

    tiers = TierConfig(disk_dir=tmp_path / "kv", disk_bytes=1 << 24, key=KEY)
    engine, rows = book(tiers=tiers)
    rng = random.Random(11)
    first = tokens(rng, 60)
    out, _, _ = turn(engine, rows, first, "t")
    assert engine.tiers.worker.drain()
    engine.tiers.close()
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    assert files
    for f in files:  # every file corrupt: none may be used
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    engine, rows = book(tiers=tiers)  # a restart on the same directory
    _, last, row = turn(engine, rows, first + out + tokens(rng, 10), None)
    assert last.num_disk_tokens == 0 and row.reused_tokens == 0
    assert row.miss.reason == "evicted" and row.miss.cause == "lower_tier_unreadable"
    engine.tiers.close()


def test_a_finished_finish_reason_error_is_a_row_too():
    engine, rows = book()
    rid = engine.add(tokens(random.Random(12), 10), GREEDY)
    engine.scheduler.finish(rid, FinishReason.ERROR, "boom")
    assert rows[-1].finish_reason == "error" and rows[-1].error == "boom" and rows[-1].miss is None


def test_with_the_prefix_cache_off_every_miss_says_so_and_rows_still_add_up():
    engine, rows = book(enable_prefix_caching=False)
    prompt = tokens(random.Random(13), 40)
    turn(engine, rows, prompt, "t")
    _, last, row = turn(engine, rows, prompt, "t")
    assert row.miss.reason == "cold" and row.miss.cause == "prefix caching off"
    assert row.reused_tokens == last.num_reused_tokens == 0 and engine.ledger.num_errors == 0


def test_a_ledger_bug_never_fails_the_request(monkeypatch):
    engine, rows = book()
    monkeypatch.setattr(engine.ledger, "_first_chunk", lambda r: 1 / 0)
    out, last, _ = turn(engine, rows, tokens(random.Random(14), 20), "t")
    assert last.finished and len(out) == GREEDY.max_tokens and engine.ledger.num_errors == 1
