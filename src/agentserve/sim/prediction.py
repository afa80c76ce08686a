"""How well the residency policy predicts returns, from a simulated run (`agentserve bench
prediction`).

Per pause class, bucketed by how many pauses of the class the estimator had seen when it
predicted (`CacheAdvice.samples`):
- **pairwise order accuracy** among trajectories paused at the same time: at every new pause,
  the policy's eviction-order key of each other open pause of the class (`Residency.rank`, what
  the pool sorts by then) against the new one's; the pair is right when the one ranked higher
  (kept longer) returns first. A pause that never returns counts as returning last; pairs where
  neither returns, or both at once, are left out.
- **median |ln(realized / predicted median)|** over returns.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentserve.trajectory.receipts import DecisionReceipt
from agentserve.trajectory.registry import TrajectoryKey

BUCKETS = ((0, 10), (10, 100), (100, 1000), (1000, 10**9))
Rank = tuple[float, float]


def _bucket(n: int) -> str:
    for lo, hi in BUCKETS:
        if lo <= n < hi:
            return f"{lo}-{hi - 1}" if hi < 10**9 else f">={lo}"
    return "?"


@dataclass(frozen=True, slots=True)
class ClassQuality:
    pause_class: str
    samples: str  # the bucket
    pauses: int
    returns: int
    median_abs_log_error: float | None
    order_pairs: int
    order_accuracy: float | None


@dataclass(slots=True)
class Snapshots:
    """What `Residency.on_pause` reported: per new pause, the others' keys at that moment."""

    max_per_pause: int = 50  # pairs drawn per new pause, at most
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    items: list[tuple[TrajectoryKey, float, Rank, list[tuple[TrajectoryKey, Rank]]]] = field(default_factory=list)

    def __call__(self, key: TrajectoryKey, start_s: float, ranks: list[tuple[TrajectoryKey, Rank]]) -> None:
        mine = next((r for k, r in ranks if k == key), None)
        if mine is None:
            return  # not protected (released): not in the order
        others = [(k, r) for k, r in ranks if k != key]
        if len(others) > self.max_per_pause:
            others = self.rng.sample(others, self.max_per_pause)
        self.items.append((key, start_s, mine, others))


def quality(receipts: Sequence[DecisionReceipt], snaps: Snapshots) -> list[ClassQuality]:
    # each pause, by (trajectory, start): its class, samples and when it came back (inf: never)
    pauses: dict[tuple[str, float], DecisionReceipt] = {(r.trajectory_id, r.advice.at_s): r for r in receipts}
    open_at: dict[str, list[DecisionReceipt]] = {}
    for r in receipts:
        open_at.setdefault(r.trajectory_id, []).append(r)

    def back(r: DecisionReceipt) -> float:
        return r.advice.at_s + r.gap_s if r.returned else float("inf")

    def pause_of(tid: str, t: float) -> DecisionReceipt | None:
        """The pause of trajectory tid open at time t."""
        for r in open_at.get(tid, ()):
            if r.advice.at_s <= t <= r.advice.at_s + r.gap_s:
                return r
        return None

    pairs: dict[tuple[str, str], list[bool]] = {}
    for key, start, mine, others in snaps.items:
        b = pauses.get((key.id, start))
        if b is None:
            continue
        for other, rank in others:
            a = pause_of(other.id, start)
            if a is None or a.advice.pause_class != b.advice.pause_class or back(a) == back(b):
                continue
            kept_longer_a = rank > mine  # a ranked above b: predicted to return first
            right = kept_longer_a == (back(a) < back(b))
            bucket = _bucket(min(a.advice.samples, b.advice.samples))
            pairs.setdefault((b.advice.pause_class, bucket), []).append(right)
    by_class: dict[str, list[DecisionReceipt]] = {}
    for r in receipts:
        by_class.setdefault(r.advice.pause_class, []).append(r)
    out = []
    for cls, rs in sorted(by_class.items()):
        buckets = sorted({_bucket(r.advice.samples) for r in rs}, key=lambda k: int(k.split("-")[0].lstrip(">=")))
        for key in buckets:
            mine = [r for r in rs if _bucket(r.advice.samples) == key]
            errors = [abs(r.log_error) for r in mine if r.log_error is not None]
            got = pairs.get((cls, key), [])
            out.append(ClassQuality(cls, key, len(mine), sum(r.returned for r in mine),
                                    statistics.median(errors) if errors else None, len(got),
                                    sum(got) / len(got) if got else None))
    return out


def render(rows: Sequence[ClassQuality]) -> str:
    lines = ["| class | samples seen | pauses | returns | median abs log error | pairs | order accuracy |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for q in rows:
        err = "-" if q.median_abs_log_error is None else f"{q.median_abs_log_error:.2f}"
        acc = "-" if q.order_accuracy is None else f"{q.order_accuracy:.1%}"
        lines.append(f"| {q.pause_class} | {q.samples} | {q.pauses} | {q.returns} | {err} | {q.order_pairs} | {acc} |")
    return "\n".join(lines)


def run(args) -> int:
    """`agentserve bench prediction`: the agent policy in the simulator on a trace, its receipts
    scored as above."""
    import json
    from pathlib import Path

    from agentserve.sim.fleet import Fleet, SimConfig
    from agentserve.sim.oracle import NextUse
    from agentserve.sim.plan import Arrival, compile_workload, session_starts
    from agentserve.sim.cli import _ints
    from agentserve.sim.presets import load_cost_model
    from agentserve.workload.load import load_workload, take_sessions

    workload = take_sessions(load_workload(args.trace, "auto", 0, args.seed), args.sessions)
    plan = compile_workload(workload, True, 1.0)
    starts = session_starts(plan, Arrival.POISSON, args.rate, args.seed)
    config = SimConfig(_ints(args.capacity)[0], "agent", skip_oversized=True, events=args.events,
                       admission=args.admission)
    fleet = Fleet(plan, starts, config, load_cost_model(args.cost_model), lambda: NextUse(plan, starts))
    receipts: list[DecisionReceipt] = []
    snaps = Snapshots()
    for residency in fleet.residency:
        if residency is not None:
            residency.on_receipt = receipts.append
            residency.on_pause = snaps
    fleet.run()  # pauses still open when the trace ends have no receipt: neither order nor error
    rows = quality(receipts, snaps)
    print(f"{len(plan.sessions)} sessions, {len(receipts)} receipts")
    print(render(rows))
    if args.json:
        from dataclasses import asdict

        Path(args.json).write_text(json.dumps([asdict(q) for q in rows], indent=1))
    return 0
