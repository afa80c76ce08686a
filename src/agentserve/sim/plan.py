"""A workload compiled for simulation: dense block ids, the blocks each turn computes, and
when each session starts.

Trace hash ids become dense ids 0..num_hashes-1 (equal (namespace, id) -> equal dense id), so
per-block facts are array slots. A turn computes prompt + output - 1 tokens; its full blocks
beyond the prompt's hold generated tokens. With `output_reuse` they take the ids the next turn
has at those positions when the next prompt starts with this whole prompt (a harness that
appends the reply), else fresh ids that nothing else shares.
"""

from __future__ import annotations

import enum
import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from agentserve.workload.common import common_prefix
from agentserve.workload.model import AgentSession, StopReason, Timing, Workload


@dataclass(frozen=True, slots=True)
class TurnPlan:
    prompt_tokens: int
    output_tokens: int
    think_s: float  # scaled by the time scale
    offset_s: float  # scaled
    shared: int  # leading blocks equal to the previous turn's computed blocks
    new: array  # dense ids of the following blocks: prompt blocks, then generated ones
    subagents: tuple[tuple[float, bool, int], ...]  # (delay_s, awaited, chain index)
    stop: StopReason = StopReason.UNKNOWN  # how this turn's response ended (a server knows it then)

    @property
    def num_blocks(self) -> int:
        return self.shared + len(self.new)


@dataclass(frozen=True, slots=True)
class ChainPlan:
    """One agent's sequence of turns (a top session or a sub-agent)."""

    index: int
    session: int  # index of its top-level session
    name: str
    timing: Timing
    trace_start_s: float | None  # scaled start in the trace, where it has one
    turns: tuple[TurnPlan, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    name: str
    block_size: int
    chains: tuple[ChainPlan, ...]
    sessions: tuple[int, ...]  # chain index of each top-level session
    num_hashes: int
    time_scale: float

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.chains)

    @property
    def max_request_tokens(self) -> int:
        return max((t.prompt_tokens + t.output_tokens for c in self.chains for t in c.turns), default=0)

    def computed_hashes(self, chain: int) -> Iterator[list[int]]:
        """Each turn's list of computed block ids (prompt then output), in order."""
        prev: list[int] = []
        for t in self.chains[chain].turns:
            prev = prev[: t.shared] + t.new.tolist()
            yield prev


class Arrival(enum.Enum):
    TRACE = "trace"  # sessions start at their trace time (Poisson where the trace has none)
    POISSON = "poisson"  # sessions start as a Poisson process at a given rate


def session_starts(plan: Plan, arrival: Arrival, rate: float, seed: int) -> tuple[float, ...]:
    """Start time of each top-level session (seconds of simulated time)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for ci in plan.sessions:
        t += rng.expovariate(rate)
        trace = plan.chains[ci].trace_start_s
        out.append(trace if arrival is Arrival.TRACE and trace is not None else t)
    return tuple(out)


@dataclass(slots=True)
class _Compiler:
    block_size: int
    output_reuse: bool
    time_scale: float
    chains: list[ChainPlan]
    next_id: int = 0

    def fresh(self, n: int) -> list[int]:
        self.next_id += n
        return list(range(self.next_id - n, self.next_id))

    def chain(self, s: AgentSession, session: int, ids: dict[int, int]) -> int:
        index = len(self.chains)
        self.chains.append(None)  # type: ignore[arg-type]  # reserve; sub-agents follow
        hashes, dense = [], []
        for t in s.turns:  # prompt hashes as dense ids, mapping only what each turn adds
            dense = dense[: t.shared_blocks] + self._dense(t.new_hashes, ids)
            hashes.append(dense)
        turns, prev = [], []
        for j, t in enumerate(s.turns):
            nxt = hashes[j + 1] if j + 1 < len(hashes) else None
            full = self._computed(hashes[j], t.prompt_tokens, t.output_tokens, nxt)
            shared = common_prefix(prev, full)
            subs = tuple((a.delay_s * self.time_scale, a.awaited, self.chain(a.session, session, ids))
                         for a in t.subagents)
            turns.append(TurnPlan(t.prompt_tokens, t.output_tokens, t.think_s * self.time_scale,
                                  t.offset_s * self.time_scale, shared, array("q", full[shared:]), subs,
                                  t.stop))
            prev = full
        start = None if s.start_s is None else s.start_s * self.time_scale
        self.chains[index] = ChainPlan(index, session, s.session_id, s.timing, start, tuple(turns))
        return index

    def _dense(self, trace_ids: tuple[int, ...], ids: dict[int, int]) -> list[int]:
        out = []
        for h in trace_ids:
            d = ids.get(h)
            if d is None:
                d = ids[h] = self.next_id
                self.next_id += 1
            out.append(d)
        return out

    def _computed(self, prompt: list[int], n_prompt: int, n_out: int, nxt: list[int] | None) -> list[int]:
        bs = self.block_size
        full = prompt[: n_prompt // bs] + self.fresh(max(0, n_prompt // bs - len(prompt)))
        n_full = (n_prompt + n_out - 1) // bs
        if n_full > len(full) and self.output_reuse and nxt is not None and nxt[: len(full)] == full:
            full = full + nxt[len(full) : n_full]
        return full + self.fresh(max(0, n_full - len(full)))


def compile_workload(workload: Workload, output_reuse: bool = True, time_scale: float = 1.0) -> Plan:
    c = _Compiler(workload.block_size, output_reuse, time_scale, [])
    namespaces: dict[int, dict[int, int]] = {}
    tops = []
    for i, s in enumerate(workload.sessions):
        # trace ids -> dense ids, one map per namespace (a session file, or a whole trace file)
        tops.append(c.chain(s, i, namespaces.setdefault(s.namespace, {})))
    return Plan(workload.name, workload.block_size, tuple(c.chains), tuple(tops), c.next_id, time_scale)
