"""The server's ledger in the simulator: the same Ledger class on the engine's Scheduler, fed
what a live server sees. Its rows equal the simulator's own records, its step-time attribution
sums to the replicas' busy time, evictions carry their policy, and keeping it changes nothing
the simulator decides."""

from __future__ import annotations

import pytest

from agentserve.ledger.cost import summarize
from agentserve.ledger.prices import load_prices
from agentserve.ledger.reader import read_ledger
from agentserve.ledger.writer import write_rows
from agentserve.sim.fleet import SimConfig, simulate
from agentserve.sim.plan import Arrival, compile_workload, session_starts
from agentserve.sim.presets import load_cost_model
from agentserve.workload.claude_code import read_claude_code
from tests.sim.conftest import FIXTURES

COST = load_cost_model("h200-llama3-8b")
CAP = 150_000  # tokens: the fixture's sessions do not fit, so LRU evicts


@pytest.fixture(scope="module")
def plan():
    return compile_workload(read_claude_code([FIXTURES / "claude-code"]))


@pytest.fixture(scope="module")
def starts(plan):
    return session_starts(plan, Arrival.POISSON, 1 / 20, seed=1)


@pytest.mark.parametrize("policy,host", [("lru", 0), ("agent", 0), ("lru", 100_000)])
def test_rows_equal_the_simulators_records_and_change_nothing(plan, starts, policy, host):
    plain = simulate(plan, starts, SimConfig(CAP, policy, host_tokens=host), COST)
    booked = simulate(plan, starts, SimConfig(CAP, policy, host_tokens=host, ledger=True), COST)
    assert booked.records == plain.records  # the ledger only watches
    rows = {r.request_id: r for r in booked.ledger_rows}
    assert len(rows) == len(booked.records)
    for rec in booked.records:
        row = rows[f"{rec.chain}.{rec.turn}"]
        assert (row.prompt_tokens, row.reused_tokens, row.reused_host, row.reused_disk, row.generated_tokens,
                row.recomputed_tokens, row.preemptions) == \
            (rec.prompt_tokens, rec.reused_tokens, rec.host_tokens, rec.disk_tokens, rec.generated_tokens,
             rec.preempt_recomputed_tokens, rec.preemptions)
        assert row.trajectory_id == str(rec.chain) and row.session_id == str(rec.session)
        assert row.turn == rec.turn + 1 and row.attempt == 1
        assert row.arrival_s == pytest.approx(rec.arrival_s) and row.e2e_s == pytest.approx(rec.done_s - rec.arrival_s)
    busy = sum(r.busy_s for r in booked.replicas)
    assert sum(r.busy_s for r in booked.ledger_rows) == pytest.approx(busy, rel=1e-6)
    reasons = {(r.miss.reason, r.miss.cause) for r in booked.ledger_rows if r.miss}
    assert ("cold", None) in reasons
    evicted = [r.miss for r in booked.ledger_rows if r.miss and r.miss.reason == "evicted"]
    name = {"lru": "lru", "agent": "agent-ev-1"}[policy]  # the pool's eviction policy
    assert evicted and all(m.policy == name for m in evicted if m.cause == "capacity")


def test_sub_agents_link_to_their_parent_and_the_report_reads_the_file(plan, starts, tmp_path):
    result = simulate(plan, starts, SimConfig(CAP, "lru", ledger=True), COST)
    path = tmp_path / "sim.jsonl"
    assert write_rows(path, result.ledger_rows) == len(result.ledger_rows)
    book = read_ledger([path])
    assert not book.problems and len(book.rows) == len(result.ledger_rows)
    summary = summarize(book.rows, book.outcomes, load_prices(None))
    parents = {(r.trajectory_id, r.parent_trajectory_id) for r in book.rows if r.parent_trajectory_id}
    assert parents  # the fixture has sub-agents
    for child, parent in parents:
        assert ("507a9a8be3d145a8", child) in summary.trajectories
        assert ("507a9a8be3d145a8", child) in summary.trajectories[("507a9a8be3d145a8", parent)].children
    assert summary.totals.prompt == sum(r.prompt_tokens for r in result.records)
    assert summary.totals.rebuilt <= summary.totals.prefilled
