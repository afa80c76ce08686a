"""Belady's offline eviction: evict the free cached block whose next use is farthest away.

The oracle knows the whole plan. A block id mostly lives in one chain (an agent's turns), from
the turn that first computes it to the last turn whose prompt still starts with it; after its
chain's current turn, its next use is the chain's next turn, whose arrival the simulator
predicts exactly for think-timed turns (response end + think time) and for trace-timed ones
(the trace time, or the response end if later). Ids used by several chains (shared system
prompts in a global namespace), or again after a gap, get the sorted list of their nominal use
times. Ties (all blocks of one turn) go first-freed-first: the scheduler frees a request's
blocks tail first, so a chain's cached prefix stays contiguous.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence

from agentserve.kv.block_pool import BlockId
from agentserve.kv.hashing import BlockHash
from agentserve.sim.plan import Plan
from agentserve.workload.model import Timing

INF = float("inf")


class NextUse:
    """Static facts per block id (policy-independent); a run passes its chains' current turns."""

    def __init__(self, plan: Plan, starts: Sequence[float]) -> None:
        self.plan = plan
        n = plan.num_hashes
        self.chain_of = array("l", [-1]) * n
        self.last_turn = array("l", [-1]) * n
        multi: set[int] = set()
        touched: set[int] = set()  # chains holding an id of `multi`
        for c in plan.chains:
            self._walk(c.index, multi, touched)
        self.uses = self._explicit_uses(multi, touched, starts)

    def _walk(self, ci: int, multi: set[int], touched: set[int]) -> None:
        turns = self.plan.chains[ci].turns
        chain_of, last_turn = self.chain_of, self.last_turn
        for j, full in enumerate(self.plan.computed_hashes(ci)):
            for u in full[turns[j].shared :]:
                if chain_of[u] == -1:
                    chain_of[u] = ci
                elif chain_of[u] != ci or last_turn[u] != -1:
                    multi.add(u)  # in another chain, or back after its run ended
                    touched.update((ci, chain_of[u]))
            keep = turns[j + 1].shared if j + 1 < len(turns) else 0
            for u in full[keep:]:
                last_turn[u] = j

    def _explicit_uses(self, multi: set[int], touched: set[int], starts: Sequence[float]
                       ) -> dict[int, list[float]]:
        uses: dict[int, list[float]] = {u: [] for u in multi}
        if not multi:
            return uses
        origin = self._chain_origins(starts)
        for c in (self.plan.chains[i] for i in sorted(touched)):
            for j, full in enumerate(self.plan.computed_hashes(c.index)):
                t = origin[c.index] + c.turns[j].offset_s
                for u in multi.intersection(full):
                    uses[u].append(t)
        for v in uses.values():
            v.sort()
        return uses

    def _chain_origins(self, starts: Sequence[float]) -> list[float]:
        """Nominal start of every chain: its session's start, plus offsets for sub-agents."""
        origin = [0.0] * len(self.plan.chains)
        for ci, start in zip(self.plan.sessions, starts):
            origin[ci] = start
        for c in self.plan.chains:  # parents come before their sub-agents
            for t in c.turns:
                for delay, _, child in t.subagents:
                    origin[child] = origin[c.index] + t.offset_s + delay
        return origin

    def next_use(self, u: int, now: float, cursor: array) -> float:
        """When block id u is next needed, given each chain's latest turn sent (cursor)."""
        times = self.uses.get(u)
        if times is not None:  # nominal use times
            i = bisect_right(times, now)
            return times[i] if i < len(times) else INF
        c = self.chain_of[u]
        j = cursor[c]
        if not self.last_turn[u] > j >= 0:
            return INF  # its chain's later turns no longer start with it
        chain = self.plan.chains[c]
        nxt = chain.turns[j + 1]
        if chain.timing is Timing.THINK:
            return now + nxt.think_s
        return max(now, (chain.trace_start_s or 0.0) + nxt.offset_s)


class BeladyEviction:
    """EvictionPolicy: a max-heap on next use (lazy deletion), first-freed first among ties."""

    def __init__(self, oracle: NextUse, cursor: array, clock: Callable[[], float]) -> None:
        self._oracle = oracle
        self._cursor = cursor
        self._clock = clock
        self._heap: list[tuple[float, int, BlockId]] = []
        self._live: dict[BlockId, tuple[float, int]] = {}  # free cached block -> (key, seq)
        self._seq = itertools.count()

    def push(self, block_ids: Sequence[BlockId], hash_of: Sequence[BlockHash | None]) -> None:
        now, cursor, next_use = self._clock(), self._cursor, self._oracle.next_use
        for b in block_ids:
            key, seq = -next_use(hash_of[b], now, cursor), next(self._seq)  # type: ignore[arg-type]
            self._live[b] = (key, seq)
            heapq.heappush(self._heap, (key, seq, b))
        if len(self._heap) > 4 * len(self._live) + 1024:
            self._heap = [(k, s, b) for b, (k, s) in self._live.items()]
            heapq.heapify(self._heap)

    def remove(self, block_ids: Sequence[BlockId]) -> None:
        for b in block_ids:
            del self._live[b]

    def pop(self, n: int) -> list[BlockId]:
        out: list[BlockId] = []
        heap, live = self._heap, self._live
        while len(out) < n:
            key, seq, b = heapq.heappop(heap)
            if live.get(b) == (key, seq):
                del live[b]
                out.append(b)
        return out

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[BlockId]:
        return iter(sorted(self._live, key=self._live.__getitem__))
