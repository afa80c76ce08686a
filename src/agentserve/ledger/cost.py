"""Costs and roll-ups: per attempt, per trajectory (with its sub-agents), per session, the fleet.

Cost per successful task is the cost of everything attempted — every task, failed ones,
retries and discarded sub-agents included — divided by the tasks a harness reported as
successful (`trajectory_finished` with `success: true`; only top-level trajectories count as
tasks, sub-agents' costs count toward their root). Fan-out amplification is a root's tokens
with all its descendants against the root's own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from agentserve.ledger.prices import PriceTable
from agentserve.ledger.rows import TIERS, Outcome, Row

TrajectoryRef = tuple[str, str]  # (tenant digest, trajectory id)


@dataclass(frozen=True, slots=True)
class RowCost:
    fresh: float
    cached: float
    output: float
    accelerator: float
    kv: float

    @property
    def total(self) -> float:
        return self.fresh + self.cached + self.output + self.accelerator + self.kv


def row_cost(row: Row, prices: PriceTable) -> RowCost:
    """Recomputed tokens after a preemption are the server's cost, not billed as input: they
    show up in accelerator time (busy_s) when that is priced."""
    m = 1e-6
    kv = sum(row.kv_token_s.get(t, 0.0) / 3600 * m * prices.kv_held.get(t, 0.0) for t in TIERS)
    return RowCost(row.fresh_tokens * m * prices.fresh_input, row.reused_tokens * m * prices.cached_input,
                   row.generated_tokens * m * prices.output, row.busy_s / 3600 * prices.accelerator_per_hour,
                   kv)


@dataclass(slots=True)
class Totals:
    attempts: int = 0
    prompt: int = 0
    reused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    fresh: int = 0
    generated: int = 0
    recomputed: int = 0
    rebuilt: int = 0
    eligible: int = 0
    prefilled: int = 0
    busy_s: float = 0.0
    cost: float = 0.0

    def add(self, row: Row, cost: float) -> None:
        self.attempts += 1
        self.prompt += row.prompt_tokens
        self.reused["device"] += row.reused_device
        self.reused["host"] += row.reused_host
        self.reused["disk"] += row.reused_disk
        self.fresh += row.fresh_tokens
        self.generated += row.generated_tokens
        self.recomputed += row.recomputed_tokens
        self.rebuilt += row.rebuilt_tokens
        self.eligible += row.eligible_tokens
        self.prefilled += row.prefilled_tokens
        self.busy_s += row.busy_s
        self.cost += cost

    def merge(self, other: Totals) -> None:
        self.attempts += other.attempts
        self.prompt += other.prompt
        for t in TIERS:
            self.reused[t] += other.reused[t]
        self.fresh += other.fresh
        self.generated += other.generated
        self.recomputed += other.recomputed
        self.rebuilt += other.rebuilt
        self.eligible += other.eligible
        self.prefilled += other.prefilled
        self.busy_s += other.busy_s
        self.cost += other.cost

    @property
    def reused_total(self) -> int:
        return sum(self.reused.values())

    @property
    def reuse_ratio(self) -> float:
        """Reused / prompt tokens."""
        return self.reused_total / self.prompt if self.prompt else 0.0

    @property
    def rebuild_tax(self) -> float:
        """Tokens computed again (eligible but missed, plus preemption recompute) / prefilled."""
        return self.rebuilt / self.prefilled if self.prefilled else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"attempts": self.attempts, "prompt_tokens": self.prompt,
                "reused_tokens_by_tier": dict(self.reused), "reused_tokens": self.reused_total,
                "fresh_tokens": self.fresh, "generated_tokens": self.generated,
                "recomputed_tokens": self.recomputed, "rebuilt_tokens": self.rebuilt,
                "eligible_tokens": self.eligible, "reuse_ratio": round(self.reuse_ratio, 6),
                "rebuild_tax": round(self.rebuild_tax, 6), "busy_s": round(self.busy_s, 6),
                "cost": round(self.cost, 9)}


@dataclass(slots=True)
class TrajectorySummary:
    ref: TrajectoryRef
    parent: TrajectoryRef | None
    rows: list[Row] = field(default_factory=list)
    own: Totals = field(default_factory=Totals)
    children: list[TrajectoryRef] = field(default_factory=list)
    with_children: Totals = field(default_factory=Totals)  # itself and every descendant
    sessions: set[str] = field(default_factory=set)
    outcome: bool | None = None  # the harness's verdict, if it sent one
    turns: int = 0
    start_s: float = 0.0
    end_s: float = 0.0  # the last finish among it and its descendants

    @property
    def id(self) -> str:
        return self.ref[1]

    @property
    def jct_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def fanout_amplification(self) -> float:
        own = self.own.prompt + self.own.generated
        total = self.with_children.prompt + self.with_children.generated
        return total / own if own else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"trajectory_id": self.id, "parent_trajectory_id": None if self.parent is None else self.parent[1],
                "children": [c[1] for c in self.children], "sessions": sorted(self.sessions),
                "turns": self.turns, "outcome": self.outcome, "jct_s": round(self.jct_s, 6),
                "fanout_amplification": round(self.fanout_amplification, 4),
                "totals": self.own.as_dict(), "with_children": self.with_children.as_dict()}


@dataclass(slots=True)
class Summary:
    prices: PriceTable
    totals: Totals
    trajectories: dict[TrajectoryRef, TrajectorySummary]
    sessions: dict[str, Totals]
    misses: Counter[str]  # reason (evicted:cause for evictions) -> attempts
    successes: int
    failures: int
    unknown_outcomes: list[str]  # outcomes for trajectories with no rows (reported, not counted)

    @property
    def roots(self) -> list[TrajectorySummary]:
        return [t for t in self.trajectories.values() if t.parent is None or t.parent not in self.trajectories]

    @property
    def cost_per_success(self) -> float | None:
        return self.totals.cost / self.successes if self.successes else None

    def as_dict(self) -> dict[str, object]:
        roots = self.roots
        amps = [t.fanout_amplification for t in roots if t.children]
        return {"prices": self.prices.as_dict(), "totals": self.totals.as_dict(),
                "trajectories": len(self.trajectories), "tasks": len(roots), "sessions": len(self.sessions),
                "successes": self.successes, "failures": self.failures,
                "cost_per_success": None if self.cost_per_success is None else round(self.cost_per_success, 9),
                "fanout_amplification_mean": round(sum(amps) / len(amps), 4) if amps else None,
                "misses": dict(self.misses.most_common()), "unknown_outcomes": self.unknown_outcomes}


def ref_of(row: Row) -> TrajectoryRef:
    """A row's trajectory; a row without one is a trajectory of its own request."""
    return (row.tenant, row.trajectory_id if row.trajectory_id is not None else f"request:{row.request_id}")


def miss_key(row: Row) -> str | None:
    m = row.miss
    if m is None:
        return None
    return f"evicted:{m.cause or 'unknown'}" if m.reason == "evicted" else m.reason


def summarize(rows: Sequence[Row], outcomes: Iterable[Outcome], prices: PriceTable) -> Summary:
    totals = Totals()
    trajs: dict[TrajectoryRef, TrajectorySummary] = {}
    sessions: dict[str, Totals] = {}
    misses: Counter[str] = Counter()
    for row in sorted(rows, key=lambda r: r.arrival_s):
        cost = row_cost(row, prices).total
        totals.add(row, cost)
        ref = ref_of(row)
        t = trajs.get(ref)
        if t is None:
            parent = None if row.parent_trajectory_id is None else (row.tenant, row.parent_trajectory_id)
            t = trajs[ref] = TrajectorySummary(ref, parent, start_s=row.arrival_s, end_s=row.arrival_s)
        t.rows.append(row)
        t.own.add(row, cost)
        t.turns = max(t.turns, row.turn)
        t.end_s = max(t.end_s, row.arrival_s + row.e2e_s)
        if row.session_id is not None:
            t.sessions.add(row.session_id)
            sessions.setdefault(row.session_id, Totals()).add(row, cost)
        if (k := miss_key(row)) is not None:
            misses[k] += 1
    for ref, t in trajs.items():
        if t.parent is not None and t.parent in trajs:
            trajs[t.parent].children.append(ref)
    for t in trajs.values():  # with_children: itself and every descendant (links form a forest)
        seen, stack = set(), [t.ref]
        while stack:
            r = stack.pop()
            if r in seen:
                continue
            seen.add(r)
            d = trajs[r]
            t.with_children.merge(d.own)
            t.end_s = max(t.end_s, d.end_s)
            stack.extend(d.children)
    successes = failures = 0
    unknown: list[str] = []
    latest: dict[TrajectoryRef, Outcome] = {}
    for o in outcomes:
        latest[(o.tenant, o.trajectory_id)] = o  # a later verdict replaces an earlier one
    for ref, o in latest.items():
        t = trajs.get(ref)
        if t is None:
            unknown.append(o.trajectory_id)
            continue
        t.outcome = o.success
        if t.parent is None or t.parent not in trajs:  # a task; sub-agents' verdicts are their own
            successes += o.success
            failures += not o.success
    return Summary(prices, totals, trajs, sessions, misses, successes, failures, unknown)
