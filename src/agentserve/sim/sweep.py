"""Runs of the simulator over policies x capacities x seeds, one result row each."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from agentserve.sim.cost import CostModel
from agentserve.sim.policies import get_policy
from agentserve.sim.fleet import SimConfig, SimResult, check_capacity, simulate
from agentserve.sim.oracle import NextUse
from agentserve.sim.plan import Arrival, Plan, session_starts


@dataclass(frozen=True, slots=True)
class SweepSpec:
    policies: tuple[str, ...]
    capacities: tuple[int, ...]
    seeds: tuple[int, ...]
    base: SimConfig  # capacity and policy are replaced per run
    arrival: Arrival = Arrival.TRACE
    session_rate: float = 1 / 300  # sessions per second, where sessions start as a Poisson process


def auto_capacities(plan: Plan, count: int = 7) -> tuple[int, ...]:
    """From the smallest pool that fits the largest request, doubling."""
    bs = plan.block_size
    smallest = -(-plan.max_request_tokens // bs) * bs
    return tuple(smallest * 2**i for i in range(count))


def run_sweep(plan: Plan, spec: SweepSpec, cost: CostModel,
              progress: Callable[[str], None] = lambda _: None) -> Iterator[tuple[dict[str, object], SimResult]]:
    """Yield (row, result) per seed x capacity x policy; every capacity is checked first."""
    if not spec.base.skip_oversized:
        for c in spec.capacities:
            check_capacity(plan, c)
    for seed in spec.seeds:
        starts = session_starts(plan, spec.arrival, spec.session_rate, seed)
        oracle: list[NextUse] = []

        def get_oracle(starts: Sequence[float] = starts) -> NextUse:
            if not oracle:
                oracle.append(NextUse(plan, starts))
            return oracle[0]

        for cap in spec.capacities:
            for policy in spec.policies:
                no_cache = {} if get_policy(policy).prefix_caching else {"host_tokens": 0, "disk_tokens": 0}
                cfg = replace(spec.base, capacity_tokens=cap, policy=policy, **no_cache)  # tiers need a cache
                progress(f"seed {seed}, {cap:,} tokens, {policy}")
                result = simulate(plan, starts, cfg, cost, get_oracle)
                row: dict[str, object] = dict(policy=policy, capacity_tokens=cap, seed=seed,
                                              **result.summary, skipped_requests=result.num_skipped,
                                              wall_s=result.wall_s)
                yield row, result


def t_quantile_975(dof: int) -> float:
    """Two-sided 95% Student t quantile (dof >= 1)."""
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
    return table.get(dof, 1.96 + 2.5 / dof)


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (0 for one value)."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return float("nan"), 0.0
    m = statistics.fmean(vals)
    if len(vals) < 2:
        return m, 0.0
    return m, t_quantile_975(len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals))
