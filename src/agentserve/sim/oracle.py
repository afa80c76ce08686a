"""Belady's offline eviction: evict the free cached block whose next use is farthest away.

The oracle knows the whole plan and reads where every chain stands in the run (`Progress`).
A block id is used by chains over runs of turns, its *ranges*: (chain, first turn whose prompt
can hit it, last turn that still holds it); most ids have one range, ids shared by several
chains (sub-agents, global Mooncake ids) or back after a branch have more. Its next use is the
soonest, over its ranges, of the arrival of the chain's first turn in the range not yet
finished, predicted from the run's state, never from the trace's absolute times:
- a turn that has arrived (queued, running, preempted): now;
- the chain's next turn once scheduled (response end + think, or trace time but not before the
  response end): that time, exactly;
- a later turn: the arrival of the chain's earliest unfinished turn (a sub-agent not spawned
  yet: its parent's spawning turn + delay; a parent awaiting sub-agents: its previous turn's
  end + the trace's gap) plus the trace's offset between the two turns; a trace-timed turn
  never before its trace time.
On a fleet, only chains whose requests go to the block's replica count (unknown: they count).

Keys go stale as the run moves, so they are evaluated lazily. A freed block gets its key at
the next eviction (by then the fleet has recorded the turn that freed it as finished), and the
heap's top is re-evaluated when popped: if its next use is now sooner, it goes back with the
new key. That is exact for keys that only move earlier; a chain running late behind its
prediction keeps its blocks longer than Belady would (its key is never looked at again until
every later key is gone). Ties (one turn's blocks) go first-freed first: the scheduler frees a
request's blocks tail first, and an ancestor block's next use is never later than its
descendants' (a prompt holding a block holds its prefix), so a chain's cached prefix stays
contiguous: a prefix cache only hits a contiguous prefix.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Callable, Iterator, Sequence

from agentserve.kv.block_pool import BlockId
from agentserve.kv.hashing import BlockHash
from agentserve.sim.plan import Plan
from agentserve.sim.progress import Progress
from agentserve.workload.model import Timing

INF = float("inf")
_MULTI = -2  # chain_of value of an id with several ranges (in `NextUse.more`)


class NextUse:
    """Static facts per block id (policy- and run-independent): its ranges, and per chain the
    trace offsets, trace-time floors and sub-agent spawn points the predictions use."""

    def __init__(self, plan: Plan, starts: Sequence[float]) -> None:
        self.plan = plan
        n = plan.num_hashes
        # one-range ids: (chain, first hit turn, last turn); chain -1: never hit
        self.chain_of = array("l", [-1]) * n
        self.first = array("l", [-1]) * n
        self.last = array("l", [-1]) * n
        # several-range ids: (floor, chain, first, last) sorted by floor, the earliest the
        # trace allows that use (-inf where it fixes none): a scan stops at the first floor
        # past the best so far
        self.more: dict[int, list[tuple[float, int, int, int]]] = {}
        self.offsets = [array("d", [t.offset_s for t in c.turns]) for c in plan.chains]
        self.floors = self._floors(starts)
        self.spawn: dict[int, tuple[int, int, float]] = {}  # sub-agent -> (parent, turn, delay)
        for c in plan.chains:
            for j, t in enumerate(c.turns):
                for delay, _, child in t.subagents:
                    self.spawn[child] = (c.index, j, delay)
            self._walk(c.index)
        for ranges in self.more.values():
            ranges.sort()

    def _floors(self, starts: Sequence[float]) -> list[array | None]:
        """Per chain, the earliest each turn can arrive, where the trace fixes it (trace-timed
        sessions: never before the trace time); None elsewhere."""
        out: list[array | None] = [None] * len(self.plan.chains)
        for ci, start in zip(self.plan.sessions, starts):
            c = self.plan.chains[ci]
            if c.timing is Timing.TRACE:
                out[ci] = array("d", [start] + [start + t.offset_s for t in c.turns[1:]])
        return out

    def _walk(self, ci: int) -> None:
        turns = self.plan.chains[ci].turns
        bs = self.plan.block_size
        opened: dict[int, int] = {}  # id -> first turn that can hit it, for the ranges open
        for j, full in enumerate(self.plan.computed_hashes(ci)):
            t = turns[j]
            hit_end = (t.prompt_tokens - 1) // bs  # blocks it can hit (its last token is computed)
            for pos in range(t.shared, len(full)):
                if full[pos] not in opened:
                    opened[full[pos]] = j if pos < hit_end else j + 1
            keep = turns[j + 1].shared if j + 1 < len(turns) else 0
            for u in full[keep:]:
                f = opened.pop(u, None)
                if f is not None and f <= j:
                    self._add(u, ci, f, j)

    def _add(self, u: int, c: int, f: int, last: int) -> None:
        fl = self.floors[c]
        rng = (-INF if fl is None else fl[f], c, f, last)
        if self.chain_of[u] == -1:
            self.chain_of[u], self.first[u], self.last[u] = c, f, last
            return
        if self.chain_of[u] != _MULTI:
            c0, f0 = self.chain_of[u], self.first[u]
            fl0 = self.floors[c0]
            self.more[u] = [(-INF if fl0 is None else fl0[f0], c0, f0, self.last[u])]
            self.chain_of[u] = _MULTI
        self.more[u].append(rng)


class Forecast:
    """NextUse read against one run's Progress for one replica's pool: `next_use(id, now)`.
    Keeps, per shared id, how many of its leading ranges are done (chains only move on)."""

    def __init__(self, table: NextUse, progress: Progress, replica: int) -> None:
        self.t = table
        self.p = progress
        self.replica = replica
        self._skip: dict[int, int] = {}  # shared id -> its leading ranges already finished

    def next_use(self, u: int, now: float) -> float:
        t = self.t
        c = t.chain_of[u]
        if c >= 0:
            return self._use(c, t.first[u], t.last[u], now)
        if c == -1:
            return INF
        ranges = t.more[u]
        i, turn = self._skip.get(u, 0), self.p.turn
        while i < len(ranges) and turn[ranges[i][1]] > ranges[i][3]:
            i += 1
        self._skip[u] = i
        best = INF
        for floor, c, f, last in itertools.islice(ranges, i, None):
            if floor >= best or best <= now:  # sorted by floor: no later range can be sooner
                break
            x = self._use(c, f, last, now)
            if x < best:
                best = x
        return best

    def next_uses(self, ids: Sequence[int], now: float) -> list[float]:
        """next_use of each id; one-range ids inline, one prediction per (chain, turn)."""
        t, p, rep = self.t, self.p, self.replica
        chain_of, first, last, turn, replica = t.chain_of, t.first, t.last, p.turn, p.replica
        memo: dict[int, float] = {}
        out: list[float] = []
        put = out.append
        for u in ids:
            c = chain_of[u]
            if c < 0:
                put(INF if c == -1 else self.next_use(u, now))
                continue
            t0 = turn[c]
            if t0 > last[u] or rep != replica[c] >= 0:  # done with it, or on another replica
                put(INF)
                continue
            k = first[u]
            if k < t0:
                k = t0
            key = c << 24 | k
            x = memo.get(key)
            if x is None:
                x = memo[key] = self._arrival(c, k, now)
            put(x)
        return out

    def _use(self, c: int, f: int, last: int, now: float) -> float:
        """When chain c next needs a block it uses in turns f..last."""
        t0 = self.p.turn[c]
        if t0 > last:
            return INF
        r = self.p.replica[c]
        if r >= 0 and r != self.replica:
            return INF
        return self._arrival(c, f if f > t0 else t0, now)

    def _arrival(self, c: int, k: int, now: float) -> float:
        """Predicted arrival (not before now) of chain c's turn k, k >= its earliest unfinished."""
        p, off = self.p, self.t.offsets[c]
        t0 = p.turn[c]
        a = p.at[c]
        if a != a:  # NaN: not scheduled yet
            if t0 == 0:
                parent, j, delay = self.t.spawn[c]
                a = self._arrival(parent, j, now) + delay
            else:
                a = p.ended[c] + off[t0] - off[t0 - 1]
        if a < now:
            a = now
        if k == t0:
            return a
        a += off[k] - off[t0]
        fl = self.t.floors[c]
        return a if fl is None or fl[k] < a else fl[k]


class BeladyEviction:
    """EvictionPolicy: a max-heap on next use (lazy deletion, lazy re-evaluation), keys computed
    at the first pop after a push; first-freed first among ties."""

    name = "belady"

    def __init__(self, forecast: Forecast, clock: Callable[[], float]) -> None:
        self._next_use = forecast.next_use
        self._next_uses = forecast.next_uses
        self._clock = clock
        self._heap: list[tuple[float, int, BlockId]] = []  # (-next use, seq, block)
        self._live: dict[BlockId, tuple[float, int]] = {}  # keyed free cached block -> its heap entry
        self._pending: dict[BlockId, int] = {}  # free cached block without a key yet -> seq
        self._hash_of: Sequence[BlockHash | None] = ()
        self._seq = 0  # push order: the tie-break

    def push(self, block_ids: Sequence[BlockId], hash_of: Sequence[BlockHash | None]) -> None:
        self._hash_of = hash_of
        n = self._seq
        self._seq = n + len(block_ids)
        self._pending.update(zip(block_ids, range(n, n + len(block_ids))))

    def remove(self, block_ids: Sequence[BlockId]) -> None:
        unkey, pending = self._live.pop, self._pending
        for b in block_ids:
            if unkey(b, None) is None:
                del pending[b]

    def _flush(self) -> None:
        pending, live, heap = self._pending, self._live, self._heap
        if not pending:
            return
        blocks, seqs = list(pending), list(pending.values())
        keys = [-x for x in self._next_uses(list(map(self._hash_of.__getitem__, blocks)), self._clock())]  # type: ignore[arg-type]
        live.update(zip(blocks, zip(keys, seqs)))
        entries = list(zip(keys, seqs, blocks))
        pending.clear()
        if len(heap) + len(entries) > 4 * len(live) + 1024:  # mostly stale entries: rebuild
            self._heap = [(k, s, b) for b, (k, s) in live.items()]
            heapq.heapify(self._heap)
        elif 8 * len(entries) > len(heap):
            heap += entries
            heapq.heapify(heap)
        else:
            push = heapq.heappush
            for e in entries:
                push(heap, e)

    @property
    def num_unprotected(self) -> int:  # an oracle protects nothing: it only orders
        return len(self)

    def count_unprotected(self, block_ids: Sequence[BlockId]) -> int:  # every free one
        return len(self._live.keys() & block_ids) + len(self._pending.keys() & block_ids)

    def pop(self, n: int) -> list[BlockId]:
        self._flush()
        out: list[BlockId] = []
        now, heap, live, hash_of = self._clock(), self._heap, self._live, self._hash_of
        next_use = self._next_use
        while len(out) < n:
            key, s, b = heapq.heappop(heap)
            if live.get(b) != (key, s):
                continue
            fresh = -next_use(hash_of[b], now)  # type: ignore[arg-type]
            if fresh > key:  # needed sooner than its key said: back in its place
                live[b] = (fresh, s)
                heapq.heappush(heap, (fresh, s, b))
                continue
            del live[b]
            out.append(b)
        return out

    def __len__(self) -> int:
        return len(self._live) + len(self._pending)

    def __iter__(self) -> Iterator[BlockId]:
        """Keyed blocks by their keys, then the pending ones in the order freed."""
        keyed = sorted((k, b) for b, k in self._live.items())
        return iter([b for _, b in keyed] + list(self._pending))
