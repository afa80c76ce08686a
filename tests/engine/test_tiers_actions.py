"""The residency policy's tier actions executed for real on the tiny engine: tool_finished
prefetches a paused trajectory back into the pool (from host, and from disk after a restart),
the next turn then hits the pool and stays exact against transformers; a trajectory that ends
has its own blocks deleted from host and disk while a prefix other protected trajectories hold
stays; the advice names the costs it compared."""

from __future__ import annotations

import time

from agentserve.config import TierConfig
from agentserve.trajectory.events import Event
from agentserve.trajectory.registry import State, TrajectoryKey
from agentserve.trajectory.residency import build_residency
from agentserve.trajectory.tier_advice import TierRates, choose_tier
from tests.engine.test_tiers_exact import BS, GREEDY, KEY, NUM_BLOCKS, run, turn_prompts
from tests.model.hf_tiny import hf_greedy, tiny_engine


def engine_with_residency(tiers: TierConfig):
    residency, eviction = build_residency("on", NUM_BLOCKS, BS, time.monotonic)
    engine, hf = tiny_engine("qwen2", block_size=BS, num_blocks=NUM_BLOCKS, eviction=eviction, tiers=tiers)
    residency.attach(engine.scheduler.pool)
    residency.tiers = engine.tiers
    engine.tiers.max_prefetch_blocks = NUM_BLOCKS // 2  # a whole turn per call (default: a quarter)
    return engine, hf, residency


def paused_turn(engine, residency, key, seed):
    """The first turn, ended on a tool call (its response paused the trajectory)."""
    first, new_piece, fillers = turn_prompts(seed)
    residency.on_request(key)
    out, last = run(engine, first)
    residency.on_response(key, last.block_hashes, State.PAUSED_TOOL, "bash")
    return first + out + new_piece, fillers


def test_tool_finished_prefetches_from_host_and_the_next_turn_hits_the_pool():
    engine, hf, residency = engine_with_residency(TierConfig(host_bytes=1 << 22))
    key = TrajectoryKey("", "t1")
    second, fillers = paused_turn(engine, residency, key, seed=7)
    for f in fillers:  # other traffic pushes it out of the pool (it is in host)
        run(engine, f)
    pool, hashes = engine.scheduler.pool, engine.prompt_hashes_of_tokens(second)
    before = len(pool.match_prefix(hashes))
    residency.on_event(key, Event.TOOL_FINISHED)
    c = engine.tiers.counters
    assert c.num_prefetched_blocks >= 60 // BS - before
    assert len(pool.match_prefix(hashes)) >= 60 // BS  # back in the pool before the request
    pool.check()
    tokens, last = run(engine, second)
    assert tokens == hf_greedy(hf, second, GREEDY.max_tokens)
    assert last.num_host_tokens == 0 and last.num_reused_tokens >= 60  # all from the pool
    assert c.num_prefetch_used >= 60 // BS - before and c.num_prefetch_wasted == 0


def test_a_prefetch_after_a_restart_reads_disk_off_the_step_loop(tmp_path):
    tiers = TierConfig(disk_dir=tmp_path / "kv", disk_bytes=1 << 24, key=KEY)
    engine, hf, residency = engine_with_residency(tiers)
    key = TrajectoryKey("", "t2")
    second, _ = paused_turn(engine, residency, key, seed=8)
    assert engine.tiers.worker.drain()
    engine.tiers.close()
    engine, _, residency = engine_with_residency(tiers)  # restarted: empty pool and host
    hashes = engine.prompt_hashes_of_tokens(second)
    queued = engine.tiers.prefetch(hashes, "")
    assert queued >= 60 // BS and engine.scheduler.pool.match_prefix(hashes) == []  # not yet
    assert engine.tiers.worker.drain()
    engine.step()  # applies the finished read: host, then the pool
    assert len(engine.scheduler.pool.match_prefix(hashes)) >= 60 // BS
    tokens, last = run(engine, second)
    assert tokens == hf_greedy(hf, second, GREEDY.max_tokens)
    assert last.num_disk_tokens == 0 and last.num_reused_tokens >= 60
    engine.tiers.close()


def test_an_ended_trajectory_leaves_every_tier_but_a_prefix_others_hold_stays(tmp_path):
    tiers = TierConfig(host_bytes=1 << 22, disk_dir=tmp_path / "kv", disk_bytes=1 << 24, key=KEY)
    engine, _, residency = engine_with_residency(tiers)
    a, b = TrajectoryKey("", "a"), TrajectoryKey("", "b")
    second_a, _ = paused_turn(engine, residency, a, seed=9)
    shared = second_a[:32]  # b starts with a's first 8 blocks
    residency.on_request(b)
    _, last_b = run(engine, shared + [7] * 20)
    residency.on_response(b, last_b.block_hashes, State.PAUSED_TOOL, "bash")
    assert residency.protected.keys() == {a, b}
    assert engine.tiers.worker.drain()
    engine.tiers.poll()
    hashes_a = residency.registry.get(a).hashes
    ident = engine.tiers.identity
    assert all(h in engine.tiers.host and engine.tiers.disk.contains(ident, h) for h in hashes_a)
    residency.on_event(a, Event.TRAJECTORY_FINISHED)
    assert engine.tiers.worker.drain()
    own, held = hashes_a[8:], hashes_a[:8]
    assert not any(h in engine.tiers.host or engine.tiers.disk.contains(ident, h) for h in own)
    assert all(h in engine.tiers.host and engine.tiers.disk.contains(ident, h) for h in held)
    assert engine.tiers.counters.num_released_blocks >= 2 * len(own)
    engine.tiers.close()


def test_the_advice_offloads_when_holding_costs_more_than_a_reload():
    rates = TierRates(block_nbytes=196_608, block_size=16, prefill_tokens_per_s=400.0,
                      reload_bytes_per_s=1.5e9)
    calm = choose_tier(60, p_return=0.9, expected_gap_s=30.0, churn_blocks_per_s=0.0, pool_blocks=1000,
                       rates=rates)
    assert calm.action == "retain" and calm.hold_s == 0  # nothing is evicted: holding is free
    busy = choose_tier(60, p_return=0.9, expected_gap_s=300.0, churn_blocks_per_s=50.0, pool_blocks=1000,
                       rates=rates)
    assert busy.action == "offload" and busy.reload_s < min(busy.hold_s, busy.recompute_s)
    soon = choose_tier(60, p_return=0.9, expected_gap_s=0.01, churn_blocks_per_s=50.0, pool_blocks=1000,
                       rates=rates)
    assert soon.action == "retain"  # back in 10 ms: holding beats even a fast reload
    no_copy = choose_tier(60, 0.9, 300.0, 50.0, 1000,
                          TierRates(196_608, 16, 400.0, 1.5e9, lower_holds_all=False))
    assert no_copy.action != "offload"


def test_a_pause_under_pressure_is_advised_with_measured_rates():
    engine, _, residency = engine_with_residency(TierConfig(host_bytes=1 << 22))
    key = TrajectoryKey("", "t3")
    paused_turn(engine, residency, key, seed=10)
    advice = residency.registry.get(key).advice
    assert "expected cost: hold" in advice.reason and advice.action in ("retain", "offload")
    rates = engine.tiers.rates()
    assert rates.prefill_tokens_per_s > 0 and rates.reload_bytes_per_s > 0


def test_a_prefetch_in_flight_is_cancelled_when_its_trajectory_ends(tmp_path):
    tiers = TierConfig(disk_dir=tmp_path / "kv", disk_bytes=1 << 24, key=KEY)
    engine, _, residency = engine_with_residency(tiers)
    second, _ = paused_turn(engine, residency, TrajectoryKey("", "t4"), seed=11)
    assert engine.tiers.worker.drain()
    engine.tiers.close()
    engine, _, _ = engine_with_residency(tiers)  # restarted
    hashes = engine.prompt_hashes_of_tokens(second)
    assert engine.tiers.prefetch(hashes, "") >= 60 // BS  # a disk read, in flight
    engine.tiers.release(hashes, "")  # the trajectory ended: its blocks go, the read is void
    assert engine.tiers.worker.drain()
    engine.step()
    assert engine.scheduler.pool.match_prefix(hashes) == [] and engine.tiers.counters.num_prefetched_blocks == 0
    assert not any(engine.tiers.disk.contains(engine.tiers.identity, h) for h in hashes)
    engine.tiers.close()
