"""Costs and roll-ups on a small fleet built by hand, every expected number worked out below
from the rows' token counts (not by calling the code's own formulas).

Fleet (tenant "t"):
  A   root, session s1, success     turns 1, 2
  A1  sub-agent of A, session s1    turn 1: attempt 1 aborted, attempt 2 (the retry) stops
  A2  sub-agent of A, session s2    turn 1: preempted once, 200 tokens recomputed
  B   root, session s3, failure     (first reported a success, then a failure: the later wins)
  C   root, no session, success
  outcomes also for "ghost" (no rows) and for A under another tenant: both unknown.

Token prices (per million tokens): fresh 1.0, cached 0.1, output 2.0, so a row costs
(U + 0.1 H + 2 O) / 1e6 with U = P - H:

  row     P     H (tier)            U     O   eligible recomputed  cost (1e-6)  rebuilt
  A-1     1000  0                   1000  100    0      0          1200           0
  A-2     2000  1000 device         1000   50 1100      0          1200         100
  A1-1     500  0                    500   20    0      0           540           0
  A1-2     500  400 device           100   80  400      0           300           0
  A2-1     800  300 host + 100 disk  400   40  400    200           520         200
  B-1      600  0                    600   30    0      0           660           0
  C-1      100  0                    100   10    0      0           120           0
  total   5500  1800                3700  330 1900    200          4540         300
"""

from __future__ import annotations

from typing import Any

import pytest

from agentserve.ledger.cost import miss_key, ref_of, row_cost, summarize
from agentserve.ledger.prices import PRESETS, PriceTable
from tests.ledger.rows import T0, build_row
from agentserve.ledger.rows import Miss, Outcome, Row

PRICES = PriceTable("test", fresh_input=1.0, cached_input=0.1, output=2.0)


def row(request_id: str, trajectory_id: str | None, turn: int = 1, attempt: int = 1, *,
        parent: str | None = None, session: str | None = None, at: float = 0.0, e2e: float = 1.0,
        **over: Any) -> Row:
    return build_row(request_id, trajectory_id, session_id=session, parent_trajectory_id=parent,
                     turn=turn, attempt=attempt, arrival_s=T0 + at, e2e_s=e2e,
                     **{**dict(tenant="t", queue_s=0.0, prefill_s=0.1, decode_s=0.5, ttft_s=0.1, busy_s=0.0, prompt_tokens=0, generated_tokens=0), **over})


def fleet() -> list[Row]:
    cold = Miss("cold", 0, 0)
    return [
        row("A-1", "A", 1, session="s1", at=0.0, e2e=2.0, prompt_tokens=1000, generated_tokens=100,
            busy_s=0.9, miss=cold),
        row("A1-1", "A1", 1, 1, parent="A", session="s1", at=2.5, e2e=1.0, prompt_tokens=500,
            generated_tokens=20, finish_reason="abort", busy_s=0.18, miss=cold),
        row("A2-1", "A2", 1, parent="A", session="s2", at=2.6, e2e=6.4, prompt_tokens=800,
            reused_host=300, reused_disk=100, generated_tokens=40, recomputed_tokens=200,
            preemptions=1, eligible_tokens=400, busy_s=0.72, miss=Miss("evicted", 25, 400)),
        row("A1-2", "A1", 1, 2, parent="A", session="s1", at=3.6, e2e=1.4, prompt_tokens=500,
            reused_device=400, generated_tokens=80, eligible_tokens=400, busy_s=0.36),
        row("A-2", "A", 2, session="s1", at=6.5, e2e=1.5, prompt_tokens=2000, reused_device=1000,
            generated_tokens=50, eligible_tokens=1100, busy_s=0.9,
            miss=Miss("evicted", 62, 1000, cause="capacity"),
            kv_token_s={"device": 7.2e8, "host": 3.6e9}),
        row("B-1", "B", 1, session="s3", at=20.0, e2e=3.0, prompt_tokens=600, generated_tokens=30,
            busy_s=0.54, miss=cold),
        row("C-1", "C", 1, at=30.0, e2e=0.5, prompt_tokens=100, generated_tokens=10, busy_s=0.18),
    ]


def outcomes() -> list[Outcome]:
    return [Outcome("B", "t", True, T0 + 24), Outcome("A1", "t", True, T0 + 5),
            Outcome("A", "t", True, T0 + 9), Outcome("B", "t", False, T0 + 25),
            Outcome("C", "t", True, T0 + 31), Outcome("ghost", "t", True, T0 + 40),
            Outcome("A", "other-tenant", True, T0 + 41)]


def test_row_cost_by_part() -> None:
    rows = {r.request_id: r for r in fleet()}
    c = row_cost(rows["A-2"], PRICES)
    assert c.fresh == pytest.approx(1000e-6)  # U = 2000 - 1000
    assert c.cached == pytest.approx(100e-6)  # 1000 reused at 0.1 per million
    assert c.output == pytest.approx(100e-6)  # 50 at 2.0 per million
    assert (c.accelerator, c.kv) == (0.0, 0.0)
    assert c.total == pytest.approx(1200e-6)
    # recomputed tokens are not billed as input: A2-1 pays for U = 800 - 400 only
    assert row_cost(rows["A2-1"], PRICES).total == pytest.approx((400 + 40 + 80) * 1e-6)


def test_cost_per_success_is_everything_over_verified_root_successes() -> None:
    s = summarize(fleet(), outcomes(), PRICES)
    assert s.totals.cost == pytest.approx(4540e-6)
    assert (s.successes, s.failures) == (2, 1)  # A and C; B's later verdict; A1 is a sub-agent
    # everything attempted (failed B, the aborted A1-1, sub-agents) over the 2 successes
    assert s.cost_per_success == pytest.approx(4540e-6 / 2)
    assert s.cost_per_success == pytest.approx(2270e-6)
    assert sorted(s.unknown_outcomes) == ["A", "ghost"]  # "A" there is another tenant's
    d = s.as_dict()
    assert (d["trajectories"], d["tasks"], d["sessions"]) == (5, 3, 3)
    assert d["cost_per_success"] == pytest.approx(0.00227)


def test_no_success_no_cost_per_success() -> None:
    s = summarize(fleet(), [Outcome("B", "t", False, T0)], PRICES)
    assert s.cost_per_success is None and s.as_dict()["cost_per_success"] is None


def test_fleet_totals() -> None:
    t = summarize(fleet(), [], PRICES).totals
    assert (t.attempts, t.prompt, t.fresh, t.generated) == (7, 5500, 3700, 330)
    assert t.reused == {"device": 1400, "host": 300, "disk": 100}
    assert (t.recomputed, t.rebuilt, t.eligible, t.prefilled) == (200, 300, 1900, 3900)
    assert t.reuse_ratio == pytest.approx(1800 / 5500)
    # rebuild tax: (100 missed of A-2's eligible + 200 recomputed in A2-1) / (3700 + 200)
    assert t.rebuild_tax == pytest.approx(300 / 3900)


def test_trajectories_with_sub_agents_and_fan_out() -> None:
    s = summarize(fleet(), outcomes(), PRICES)
    by_id = {t.id: t for t in s.trajectories.values()}
    a = by_id["A"]
    assert sorted(c[1] for c in a.children) == ["A1", "A2"]
    assert sorted(t.id for t in s.roots) == ["A", "B", "C"]
    verdicts = (a.outcome, by_id["A1"].outcome, by_id["B"].outcome, by_id["C"].outcome)
    assert verdicts == (True, True, False, True)
    assert by_id["A2"].outcome is None
    assert a.turns == 2 and by_id["A1"].turns == 1 and by_id["A1"].own.attempts == 2
    assert a.own.cost == pytest.approx(2400e-6)
    assert a.with_children.cost == pytest.approx((1200 + 1200 + 540 + 300 + 520) * 1e-6)
    assert a.with_children.attempts == 5
    # own P + O = 1100 + 2050 = 3150; sub-agents add 520 + 580 (A1) and 840 (A2)
    assert a.fanout_amplification == pytest.approx(5090 / 3150)
    assert by_id["B"].fanout_amplification == pytest.approx(1.0)
    assert s.as_dict()["fanout_amplification_mean"] == pytest.approx(round(5090 / 3150, 4))
    # rebuild tax, own: 100 / 2000; with children: (100 + 200) / (2000 + 600 + 600)
    assert a.own.rebuild_tax == pytest.approx(0.05)
    assert a.with_children.rebuild_tax == pytest.approx(300 / 3200)
    # A starts at +0.0; A2, a sub-agent, finishes last at +2.6 + 6.4 = +9.0
    assert a.jct_s == pytest.approx(9.0)
    assert by_id["A1"].jct_s == pytest.approx(5.0 - 2.5)
    assert a.sessions == {"s1"} and by_id["C"].sessions == set()


def test_per_session_totals() -> None:
    sessions = summarize(fleet(), [], PRICES).sessions
    assert sorted(sessions) == ["s1", "s2", "s3"]  # C has no session
    s1 = sessions["s1"]  # A1-1, A1-2
    assert (s1.attempts, s1.prompt, s1.generated) == (4, 4000, 250)
    assert s1.cost == pytest.approx((1200 + 1200 + 540 + 300) * 1e-6)
    assert s1.reused == {"device": 1400, "host": 0, "disk": 0}
    assert sessions["s2"].cost == pytest.approx(520e-6)
    assert sessions["s2"].rebuild_tax == pytest.approx(200 / 600)
    assert (sessions["s3"].attempts, sessions["s3"].cost) == (1, pytest.approx(660e-6))


def test_miss_counts() -> None:
    s = summarize(fleet(), [], PRICES)
    assert dict(s.misses) == {"cold": 3, "evicted:capacity": 1, "evicted:unknown": 1}
    assert miss_key(row("x", "x")) is None


def test_self_hosted_accelerator_and_kv_held() -> None:
    # 2.00 per accelerator-hour; KV 0.50 (device), 0.05 (host) per million token-hours
    hosted = PRESETS["self-hosted"]
    a2 = {r.request_id: r for r in fleet()}["A-2"]
    c = row_cost(a2, hosted)
    assert (c.fresh, c.cached, c.output) == (0.0, 0.0, 0.0)
    assert c.accelerator == pytest.approx(0.9 / 3600 * 2.0)  # 0.0005
    # device 7.2e8 token-s = 200,000 token-hours = 0.2 M -> 0.10; host 3.6e9 = 1 M -> 0.05
    assert c.kv == pytest.approx(0.15)
    s = summarize(fleet(), outcomes(), hosted)
    busy = 0.9 + 0.18 + 0.72 + 0.36 + 0.9 + 0.54 + 0.18  # 3.78 s
    assert s.totals.busy_s == pytest.approx(busy)
    assert s.totals.cost == pytest.approx(busy / 3600 * 2.0 + 0.15)  # 0.0021 + 0.15
    assert s.cost_per_success == pytest.approx(0.1521 / 2)


def test_untracked_row_and_orphan_sub_agent_are_tasks() -> None:
    rows = [row("solo", None, prompt_tokens=10), row("o-1", "orphan", parent="gone", prompt_tokens=10)]
    s = summarize(rows, [Outcome("orphan", "t", True, T0)], PRICES)
    assert ref_of(rows[0]) == ("t", "request:solo")
    assert sorted(t.id for t in s.roots) == ["orphan", "request:solo"]
    assert s.successes == 1  # the orphan's parent never showed up: it counts as a task
    assert s.cost_per_success == pytest.approx(20e-6)
