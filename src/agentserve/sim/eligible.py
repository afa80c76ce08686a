"""Eligible prefix blocks from the workload alone, the same for every policy in a run.

A turn's eligible prefix is the leading run of its prompt's full blocks (the last token never
counts: it is always computed) that an infinite cache could serve: its own chain's previous
turn's blocks (`TurnPlan.shared`), then any block some turn earlier in the workload's order
computed. The order is the zero-service schedule: every response instant, so a turn arrives at
its session start plus the think times before it (or at its trace offset), a sub-agent at its
parent's turn plus its delay, a parent's next turn after the sub-agents it awaits. Ties go by
chain, then turn. No policy's timing enters it, so `none`, `lru`, `belady` and `agent` are
judged against one denominator; a policy that reuses a block in an order the plan does not
expect cannot count more than the plan's eligible tokens as reused (metrics.RequestRecord).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from agentserve.sim.plan import Plan
from agentserve.workload.model import Timing


def planned_times(plan: Plan, starts: Sequence[float]) -> list[list[float]]:
    """Each chain's turn arrival times under zero service time."""
    times: list[list[float]] = [[] for _ in plan.chains]

    def chain(c: int, origin: float) -> float:
        """Fills times[c]; returns the time of its last response (its last arrival)."""
        ch = plan.chains[c]
        t = base = origin
        out = times[c]
        for j, turn in enumerate(ch.turns):
            if j:
                if ch.timing is Timing.THINK:
                    t = base + turn.think_s
                else:
                    t = max(base, origin + turn.offset_s)
            out.append(t)
            base = t
            for delay, awaited, child in turn.subagents:
                end = chain(child, t + delay)
                if awaited:
                    base = max(base, end)
        return out[-1] if out else origin

    for ci, start in zip(plan.sessions, starts, strict=True):
        chain(ci, start)
    return times


def eligible_blocks(plan: Plan, starts: Sequence[float]) -> list[array]:
    """Per chain, per turn: the number of eligible prompt blocks (module docstring). A turn
    too large for the pool (skipped by the simulator) still computes its blocks here, as the
    simulator marks them too."""
    times = planned_times(plan, starts)
    # within a chain planned times never decrease, so each chain's turns come in order
    order = sorted((t, c, j) for c, ts in enumerate(times) for j, t in enumerate(ts))
    computed = [plan.computed_hashes(c) for c in range(len(plan.chains))]
    seen = bytearray(plan.num_hashes)
    bs = plan.block_size
    out = [array("l", [0]) * len(ch.turns) for ch in plan.chains]
    for _, c, j in order:
        turn = plan.chains[c].turns[j]
        full = next(computed[c])
        limit = (turn.prompt_tokens - 1) // bs
        e = min(turn.shared, limit)
        while e < limit and seen[full[e]]:
            e += 1
        out[c][j] = e
        for u in full[turn.shared :]:
            seen[u] = 1
    return out
