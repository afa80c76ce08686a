"""The lower KV tiers in the simulator: the server's KvTiers, HostStore and TierIndex over
metadata stores, disk jobs queued on one link in virtual time; deterministic, invariants kept,
never more recompute than the same run without tiers, and the agent policy's tier actions on."""

from __future__ import annotations

import pytest

from agentserve.engine.tiers import KvTiers
from agentserve.kv.host_store import HostStore
from agentserve.kv.identity import CacheIdentity
from agentserve.kv.tier_worker import ReadJob, WriteJob
from agentserve.sim.fleet import Fleet, SimConfig, SimError, simulate
from agentserve.sim.oracle import NextUse
from agentserve.sim.plan import Arrival, compile_workload, session_starts
from agentserve.sim.presets import load_cost_model
from agentserve.sim.tiers import Placeholder, SimDisk, SimWorker
from agentserve.workload.claude_code import read_claude_code
from tests.sim.conftest import FIXTURES

COST = load_cost_model("h200-llama3-8b")
CAP = 150_000  # tokens: the fixture's sessions do not fit, so LRU recomputes


def run(plan, starts, **kw):
    fleet = Fleet(plan, starts, SimConfig(CAP, **kw), COST, lambda: NextUse(plan, starts))
    fleet.run()
    return fleet


@pytest.fixture(scope="module")
def cc_plan():
    return compile_workload(read_claude_code([FIXTURES / "claude-code"]))


@pytest.fixture(scope="module")
def starts(cc_plan):
    return session_starts(cc_plan, Arrival.POISSON, 1 / 20, seed=1)


def test_tiers_serve_what_the_pool_dropped_and_never_cost_recompute(cc_plan, starts):
    base = simulate(cc_plan, starts, SimConfig(CAP, "lru"), COST).summary
    for host, disk in ((400_000, 0), (0, 2_000_000), (100_000, 2_000_000)):
        fleet = run(cc_plan, starts, policy="lru", host_tokens=host, disk_tokens=disk)
        records = fleet.records
        tiered = sum(r.host_tokens + r.disk_tokens for r in records)
        recomputed = sum(r.rebuilt_tokens for r in records)
        assert tiered > 0 and recomputed < base["recomputed_tokens"], (host, disk)
        assert (sum(r.disk_tokens for r in records) > 0) == bool(disk)
        for rep in fleet.replicas:
            rep.scheduler.pool.check()
            rep.tiers.host.check()
            assert rep.scheduler.pool.num_free_blocks == rep.scheduler.pool.num_blocks
            assert not rep.tiers.loading and rep.scheduler.num_loading() == 0
            if disk:
                rep.tiers.disk.index.check()
                assert rep.tiers.counters.num_loaded_blocks > 0


def test_same_plan_same_records_with_tiers(cc_plan, starts):
    cfg = SimConfig(CAP, "agent", host_tokens=100_000, disk_tokens=2_000_000)
    a, b = simulate(cc_plan, starts, cfg, COST), simulate(cc_plan, starts, cfg, COST)
    assert a.records == b.records and a.summary["reused_disk_tokens"] > 0


def test_the_agent_policy_acts_on_the_tiers(cc_plan, starts):
    fleet = run(cc_plan, starts, policy="agent", host_tokens=100_000, disk_tokens=2_000_000)
    residency = fleet.residency[0]
    assert residency.tiers is fleet.replicas[0].tiers
    advised = [r.advice for t in residency.registry for r in t.receipts]
    assert any("expected cost: hold" in a.reason for a in advised)


def test_tiers_need_a_prefix_cache():
    with pytest.raises(SimError, match="KV tiers need the prefix cache"):
        SimConfig(100, "none", host_tokens=10)


def test_disk_jobs_share_one_link_in_order():
    now = [0.0]
    disk = SimDisk(capacity_bytes=10_000, block_nbytes=100)
    ends = []
    worker = SimWorker(disk, lambda: now[0], read_bw=1000.0, write_bw=500.0, latency_s=0.0,
                       on_done_at=ends.append)
    ident = CacheIdentity("sim", "bf16", 16, "sim", "sim")
    block = Placeholder(100)
    assert worker.submit(WriteJob(ident, (1, 2), (block, block)))  # 200 bytes at 500/s: 0.4 s
    assert worker.submit(ReadJob("r", ident, (1, 2)))  # queued behind it; reads see the write
    assert ends == [0.4, pytest.approx(0.4)]  # the blocks were not on disk at submit: 0 bytes
    assert worker.poll() == []
    now[0] = 0.4
    done = worker.poll()
    assert [type(d).__name__ for d in done] == ["WriteDone", "ReadDone"]
    assert done[1].hashes == (1, 2)  # applied in order: the read found the write
    assert worker.submit(ReadJob("s", ident, (1, 2)))
    assert ends[-1] == pytest.approx(0.6)  # 200 bytes at 1000/s after the link is free


def test_kvtiers_is_the_servers_class():
    from agentserve.sim import tiers as sim_tiers

    assert sim_tiers.KvTiers is KvTiers and sim_tiers.HostStore is HostStore


def test_prefetches_at_every_tick_never_break_a_decode_run(cc_plan, starts):
    """A prefetch changes the pool; the expire tick that makes one first turns a decode run in
    flight into an ordinary step (a run must see the pool it was planned on)."""
    import dataclasses

    cfg = SimConfig(CAP, "agent", host_tokens=20_000, disk_tokens=300_000)
    fleet = Fleet(cc_plan, starts, cfg, COST, lambda: NextUse(cc_plan, starts))
    for r in fleet.residency:
        r.config = dataclasses.replace(r.config, prefetch_above=0.0)  # prefetch every paused one
    fleet.run()
    tiers = fleet.replicas[0].tiers
    assert tiers.counters.num_prefetched_blocks > 0 and fleet.replicas[0].stats.num_decode_runs > 0
    assert len(fleet.records) == cc_plan.num_requests
    fleet.replicas[0].scheduler.pool.check()


def test_a_read_passes_queued_writes_on_the_link():
    now = [0.0]
    disk = SimDisk(capacity_bytes=10_000, block_nbytes=100)
    ends = []
    worker = SimWorker(disk, lambda: now[0], read_bw=1000.0, write_bw=100.0, latency_s=0.0,
                       on_done_at=ends.append)
    ident = CacheIdentity("sim", "bf16", 16, "sim", "sim")
    block = Placeholder(100)
    disk.put(ident, 9, block)  # already on disk
    worker.submit(WriteJob(ident, (1,), (block,)))  # in service: 0 -> 1 s
    worker.submit(WriteJob(ident, (2,), (block,)))  # queued: 1 -> 2 s
    worker.submit(ReadJob("r", ident, (9,)))  # passes the queued write: 1 -> 1.1 s
    assert ends[-2:] == [pytest.approx(1.1), pytest.approx(2.1)]  # the read, then the write moved
    now[0] = 1.1
    assert [type(d).__name__ for d in worker.poll()] == ["WriteDone", "ReadDone"]
    now[0] = 2.1
    assert [type(d).__name__ for d in worker.poll()] == ["WriteDone"]
