"""The simulator: exact hit counts by hand, determinism, decode runs, the real scheduler."""

from __future__ import annotations

import pytest

from agentserve.engine.scheduler import Scheduler
from agentserve.kv.block_pool import BlockPool
from agentserve.sim.fleet import Fleet, SimConfig, SimError, simulate
from agentserve.sim.oracle import NextUse
from agentserve.sim.plan import Arrival, compile_workload, session_starts
from agentserve.sim.presets import load_cost_model
from agentserve.workload.claude_code import read_claude_code
from agentserve.workload.model import AgentSession, Timing, Turn, Workload
from tests.sim.conftest import FIXTURES, UNIT_STEP


def run(workload, policy, capacity, starts=(0.0, 2.0, 4.0), **kw):
    plan = compile_workload(workload, output_reuse=False)
    return simulate(plan, starts, SimConfig(capacity, policy, **kw), UNIT_STEP)


def reused(result):
    return [(r.session, r.turn, r.reused_tokens, r.eligible_tokens) for r in sorted(
        result.records, key=lambda r: (r.session, r.turn))]


def test_hand_computed_three_sessions(three_sessions):
    # Pool of 4 blocks of 4 tokens. t=0,2,4: S0, S1, S2 compute 2 blocks each, so S2 evicts
    # S0's blocks under LRU; S0's second turn (t=11) then evicts S1's and one of S2's, and so
    # on: LRU reuses nothing. Belady evicts S1's blocks at t=4 (next needed at 13, after S0's
    # at 11), keeps S0's for t=11 (8 tokens), and S2's first block for t=15 (4 tokens).
    eligible = [(0, 0, 0, 0), (0, 1, 0, 8), (1, 0, 0, 0), (1, 1, 0, 4), (2, 0, 0, 0), (2, 1, 0, 4)]
    assert reused(run(three_sessions, "lru", 16)) == eligible
    assert reused(run(three_sessions, "none", 16)) == eligible
    belady = run(three_sessions, "belady", 16)
    assert reused(belady) == [(0, 0, 0, 0), (0, 1, 8, 8), (1, 0, 0, 0), (1, 1, 0, 4), (2, 0, 0, 0), (2, 1, 4, 4)]
    assert belady.summary["reused_tokens"] == 12 and belady.summary["eligible_tokens"] == 16
    assert belady.summary["recomputed_tokens"] == 4
    # with room for everything, LRU gets every eligible token
    assert [r[2] for r in reused(run(three_sessions, "lru", 64))] == [0, 8, 0, 4, 0, 4]


def test_belady_keeps_a_shared_block_a_queued_request_needs():
    # One global namespace, block size 4, a pool of 4 blocks, one request at a time, 1 s steps.
    # All four sessions arrive at t=0 and queue: S0 [1,2] runs 0-1, S1 [3,4] 1-2, R [8,9] 2-3,
    # Q [1,2,6] 3-4; S1's second turn [3,4,5] comes at its trace time 10. At t=2 R must evict
    # X=[1,2] or Y=[3,4]. Q's nominal time (0) is past, but Q is queued: X is needed now, Y at
    # 10, so Belady evicts Y and Q hits X. LRU evicts X (freed first) and reuses nothing; Q's
    # eligible prefix is X for both (S0 comes first in the workload's own order).
    def trace(sid: str, turns: tuple[Turn, ...]) -> AgentSession:
        return AgentSession(sid, 1, turns, Timing.TRACE, 0.0)

    w = Workload("queued", 4, (
        trace("S0", (Turn(0.0, 0.0, 8, 1, 0, (1, 2)),)),
        trace("S1", (Turn(0.0, 0.0, 8, 1, 0, (3, 4)), Turn(10.0, 0.0, 12, 1, 2, (5,)))),
        trace("R", (Turn(0.0, 0.0, 8, 1, 0, (8, 9)),)),
        trace("Q", (Turn(0.0, 0.0, 15, 1, 0, (1, 2, 6)),)),
    ))
    kw = dict(starts=(0.0,) * 4, max_num_seqs=1)
    belady, lru = run(w, "belady", 16, **kw), run(w, "lru", 16, **kw)
    assert [(r.session, r.arrival_s, r.done_s) for r in belady.records] == [
        (0, 0.0, 1.0), (1, 0.0, 2.0), (2, 0.0, 3.0), (3, 0.0, 4.0), (1, 10.0, 11.0)]
    assert reused(belady) == [(0, 0, 0, 0), (1, 0, 0, 0), (1, 1, 0, 8), (2, 0, 0, 0), (3, 0, 8, 8)]
    assert reused(lru) == [(0, 0, 0, 0), (1, 0, 0, 0), (1, 1, 0, 8), (2, 0, 0, 0), (3, 0, 0, 8)]
    assert lru.summary["recomputed_tokens"] == 16 and belady.summary["recomputed_tokens"] == 8


def test_arrivals_follow_think_time_after_the_response(three_sessions):
    result = run(three_sessions, "lru", 64)
    by = {(r.session, r.turn): r for r in result.records}
    assert (by[0, 0].arrival_s, by[0, 0].done_s) == (0.0, 1.0)
    assert by[0, 1].arrival_s == 11.0  # response at 1 s + 10 s of think time
    assert result.session_jct_s == (12.0, 12.0, 12.0)  # each: two 1 s turns, 10 s apart


def test_scheduler_and_pool_are_the_engines_own_classes(three_sessions):
    plan = compile_workload(three_sessions)
    fleet = Fleet(plan, (0.0, 2.0, 4.0), SimConfig(64, "belady", num_replicas=2), UNIT_STEP,
                  lambda: NextUse(plan, (0.0, 2.0, 4.0)))
    for rep in fleet.replicas:
        assert type(rep.scheduler) is Scheduler
        assert type(rep.scheduler.pool) is BlockPool


@pytest.fixture(scope="module")
def cc_plan():
    return compile_workload(read_claude_code([FIXTURES / "claude-code"]))


def test_same_seed_same_records_and_decode_runs_change_nothing(cc_plan):
    cost = load_cost_model("h100-llama3-8b")
    starts = session_starts(cc_plan, Arrival.POISSON, 1 / 30, seed=7)
    cfg = SimConfig(200_000, "lru", num_replicas=2, router="least-loaded")
    a, b = simulate(cc_plan, starts, cfg, cost), simulate(cc_plan, starts, cfg, cost)
    assert a.records == b.records and a.summary == b.summary
    other = simulate(cc_plan, session_starts(cc_plan, Arrival.POISSON, 1 / 30, seed=8), cfg, cost)
    assert other.records != a.records
    slow = simulate(cc_plan, starts, SimConfig(200_000, "lru", 2, "least-loaded", decode_runs=False), cost)
    assert a.replicas[0].num_decode_runs > 0 and slow.replicas[0].num_decode_runs == 0
    assert len(slow.records) == len(a.records) == cc_plan.num_requests
    for x, y in zip(a.records, slow.records):
        for f in x.__slots__:
            u, v = getattr(x, f), getattr(y, f)
            assert u == v if isinstance(u, int) else u == pytest.approx(v, rel=1e-9)


@pytest.mark.parametrize("admission", ["eager", "protective"])
def test_decode_runs_change_no_decision_of_the_agent_policy(cc_plan, admission):
    """The agent policy ranks by time and expires protection on a tick: a decode run must
    evict with the clock at each of its steps, and be cut at a tick or an arrival before the
    policy hears of it. At this capacity the pool is short (the policy evicts protected blocks,
    and protective admission holds requests back)."""
    cost = load_cost_model("h100-llama3-8b")
    starts = session_starts(cc_plan, Arrival.POISSON, 1 / 30, seed=7)
    runs = simulate(cc_plan, starts, SimConfig(160_000, "agent", admission=admission), cost)
    slow = simulate(cc_plan, starts, SimConfig(160_000, "agent", admission=admission,
                                               decode_runs=False), cost)
    assert runs.replicas[0].num_decode_runs > 0 and slow.replicas[0].num_decode_runs == 0
    assert runs.summary["preemptions"] + runs.summary["recomputed_tokens"] > 0
    assert len(runs.records) == len(slow.records) == cc_plan.num_requests
    for x, y in zip(runs.records, slow.records):
        for f in x.__slots__:
            u, v = getattr(x, f), getattr(y, f)
            assert u == v if isinstance(u, int) else u == pytest.approx(v, rel=1e-9), (f, x, y)


def test_capacity_smaller_than_a_request_is_refused_before_work(cc_plan):
    with pytest.raises(SimError, match=r"--capacity-tokens 1000 is smaller than the largest request .* blocks of 64"):
        simulate(cc_plan, [0.0] * len(cc_plan.sessions), SimConfig(1000, "lru"), UNIT_STEP)
    skipped = simulate(cc_plan, [0.0] * len(cc_plan.sessions), SimConfig(50_000, "lru", skip_oversized=True), UNIT_STEP)
    assert skipped.num_skipped > 0
    assert len(skipped.records) + skipped.num_skipped == cc_plan.num_requests


def test_bad_config_names_the_problem():
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        SimConfig(100, "fifo")
    with pytest.raises(SimError, match="num_replicas must be >= 1"):
        SimConfig(100, "lru", num_replicas=0)
    with pytest.raises(SimError, match="admission must be one of auto, eager, protective, got 'lazy'"):
        SimConfig(100, "agent", admission="lazy")


@pytest.mark.parametrize("policy, admission, protective", [
    ("agent", "auto", True), ("lru", "auto", False), ("belady", "auto", False),
    ("agent", "eager", False), ("lru", "protective", True)])
def test_admission_auto_is_protective_under_the_agent_policy_as_serve_residency_on_is(cc_plan, policy, admission,
                                                                                       protective):
    starts = session_starts(cc_plan, Arrival.POISSON, 1 / 20, seed=1)
    fleet = Fleet(cc_plan, starts, SimConfig(150_000, policy, admission=admission), UNIT_STEP,
                  lambda: NextUse(cc_plan, starts))
    assert fleet.replicas[0].scheduler.config.protect_on_admission is protective


def test_pools_keep_their_invariants_under_every_policy(cc_plan):
    starts = session_starts(cc_plan, Arrival.POISSON, 1 / 20, seed=1)
    for policy in ("none", "lru", "belady"):
        fleet = Fleet(cc_plan, starts, SimConfig(150_000, policy, num_replicas=2, router="round-robin"),
                      load_cost_model("h200-qwen2.5-32b"), lambda: NextUse(cc_plan, starts))
        fleet.run()
        for rep in fleet.replicas:
            rep.scheduler.pool.check()
            assert rep.scheduler.pool.num_free_blocks == rep.scheduler.pool.num_blocks
        assert len(fleet.records) == cc_plan.num_requests and len(fleet.jct) == len(cc_plan.sessions)
        assert {r.replica for r in fleet.records} == {0, 1}


@pytest.mark.parametrize("router", ["session-hash", "least-loaded", "round-robin"])
def test_routers(cc_plan, router):
    starts = session_starts(cc_plan, Arrival.POISSON, 1 / 10, seed=3)
    result = simulate(cc_plan, starts, SimConfig(400_000, "lru", num_replicas=3, router=router),
                      load_cost_model("h200-llama3-8b"))
    replicas_of: dict[int, set[int]] = {}
    for r in result.records:
        replicas_of.setdefault(r.session, set()).add(r.replica)
    if router == "session-hash":  # a session and its sub-agents stay on one replica
        assert all(len(v) == 1 for v in replicas_of.values())
    else:
        assert len(set().union(*replicas_of.values())) > 1


def test_eligible_comes_from_the_workload_in_zero_service_order():
    # Block size 4. A (start 0): turn 0 [1,2], and 5 s of think time after the sub-agent it
    # starts 1 s after turn 0 and awaits, turn 1 [1,2,3]. The sub-agent computes [7,8]; B
    # (start 3) sends [7,8,9]. Zero-service order: A0 (0), sub-agent (1), B (3), A1 (6). B's
    # eligible prefix is the sub-agent's 2 blocks, A1's its own 2, whatever a policy's timing.
    from agentserve.sim.eligible import eligible_blocks, planned_times
    from agentserve.workload.model import SubAgent

    sub = AgentSession("S", 1, (Turn(0.0, 0.0, 8, 1, 0, (7, 8)),), Timing.THINK, None)
    a = AgentSession("A", 1, (Turn(0.0, 0.0, 12, 1, 0, (1, 2), subagents=(SubAgent(1.0, True, sub),)),
                              Turn(0.0, 5.0, 16, 1, 2, (3,))), Timing.THINK, None)
    b = AgentSession("B", 1, (Turn(0.0, 0.0, 16, 1, 0, (7, 8, 9)),), Timing.THINK, None)
    plan = compile_workload(Workload("w", 4, (a, b)), output_reuse=False)
    starts = (0.0, 3.0)
    assert planned_times(plan, starts) == [[0.0, 6.0], [1.0], [3.0]]
    assert [list(e) for e in eligible_blocks(plan, starts)] == [[0, 2], [0], [2]]
    for policy in ("none", "lru", "belady"):
        res = simulate(plan, starts, SimConfig(64, policy), UNIT_STEP)
        assert res.summary["eligible_tokens"] == 16
        assert res.summary["recomputed_tokens"] == (16 if policy == "none" else 0)


def _altered_after(plan, base, t_cut: float):
    """The same plan, with every turn that arrived at or after t_cut in `base` (its records) given a longer
    think time and a longer reply: the future changes, the past does not."""
    from dataclasses import replace

    late = {(r.chain, r.turn) for r in base if r.arrival_s >= t_cut}
    chains = tuple(replace(c, turns=tuple(replace(t, think_s=t.think_s * 3 + 7, output_tokens=t.output_tokens + 50)
                                          if (c.index, j) in late else t for j, t in enumerate(c.turns)))
                   for c in plan.chains)
    return replace(plan, chains=chains)


def _logged(plan, starts, config, cost):
    """Run with the agent policy's decision log on: (result records, every advice and eviction
    in order, with its time)."""
    fleet = Fleet(plan, starts, config, cost, lambda: NextUse(plan, starts))
    (residency,) = fleet.residency
    residency.log = []
    fleet.run()
    return fleet.records, residency.log


@pytest.mark.parametrize("events", ["none", "terminal"])
def test_agent_policy_never_reads_the_future(events):
    """Alter the trace after time T: every decision the policy took before T (each pause's
    advice with its P(return), each eviction with its blocks) is the same, and every request
    that finished before T is served exactly as before. A policy that peeked at a pause's
    real gap (a return after T) would change its advice before T."""
    plan = compile_workload(read_claude_code([FIXTURES / "claude-code"]))
    starts = session_starts(plan, Arrival.POISSON, 1 / 200, 0)
    cost = load_cost_model("h200-llama3-8b")
    cap = int(1.05 * plan.max_request_tokens)  # under pressure: evictions decide hits
    config = SimConfig(cap, "agent", events=events)
    base, base_log = _logged(plan, starts, config, cost)
    t_cut = sorted(r.done_s for r in base)[len(base) // 2]

    later, later_log = _logged(_altered_after(plan, base, t_cut), starts, config, cost)

    def before(records):
        return sorted((r.chain, r.turn, r.arrival_s, r.done_s, r.reused_tokens)
                      for r in records if r.done_s < t_cut)

    assert before(base) and before(base) == before(later)
    early = [d for d in base_log if d[0] < t_cut]
    assert sum(d[1] == "advice" for d in early) > 10 and sum(d[1] == "evict" for d in early) > 10
    assert early == [d for d in later_log if d[0] < t_cut]
    assert base_log != later_log and later != base
    assert sum(r.reused_tokens for r in base) > 0
    lru = simulate(plan, starts, SimConfig(cap, "lru"), cost)  # one denominator for every policy
    assert sum(r.eligible_tokens for r in base) == lru.summary["eligible_tokens"]
