"""Agent-aware eviction: which free cached blocks go first when the pool needs space.

Order (the pool's `EvictionPolicy` seam, kv/block_pool.py):
1. past the budget, the lowest-ranked protected blocks (below);
2. free cached blocks that no protected trajectory holds, least recently freed first (LRU);
3. then the blocks of paused trajectories, lowest rank first, each trajectory tail first (an
   inner block evicted makes every block after it useless to a prefix match). A block several
   trajectories hold goes with its highest-ranked holder.
The rank (`Residency.rank`) is P(it returns within the horizon) per block, then the pause's
recency; the expected value of keeping it, reported in advice, is that P x its blocks. P is
conditioned on the wait so far, capped at its value at the pause. The horizon is how long a
block freed now stays in the pool at the current churn (capacity / blocks evicted per second,
smoothed), floored at `min_horizon_s`.

A trajectory is protected while paused, for at most `max_idle_s`, unless its P at the pause is
under `release_below` (advice: release); at most `max_protected` at once. Protected free blocks
may fill at most `budget` of the pool, counted at eviction time on blocks resident now, so
unprotected traffic keeps its share. It is soft, never a pin: the pool can always take every
free block, so an allocation succeeds whenever free blocks exist.

Everything here is torch-free and reads only what a live server knows at that moment: the
simulator imports it as it is (docs/residency.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from agentserve.kv.tombstones import Tombstones
from agentserve.trajectory.estimator import ReturnEstimator
from agentserve.trajectory.events import Event, Outcome
from agentserve.trajectory.receipts import POLICY_VERSION, CacheAdvice, CostRates, DecisionReceipt, settle
from agentserve.trajectory.tier_advice import TierActions, choose_tier
from agentserve.trajectory.registry import PAUSED, BlockHash, State, Trajectory, TrajectoryKey, TrajectoryRegistry

BlockId = int


class PoolView(Protocol):
    """What receipts read from the pool: which leading blocks are still cached, and the
    tombstones of evicted ones (None: not kept)."""

    tombstones: Tombstones | None
    num_evictions: int

    @property
    def index(self) -> Mapping[BlockHash, int]: ...

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class ResidencyConfig:
    budget: float = 0.9  # share of the pool's blocks paused trajectories' free blocks may fill
    release_below: float = 0.02  # P(return within the horizon) under which a pause is not protected
    max_protected: int = 4_096  # protected trajectories at most: bounds the order's sort per step
    reorder_s: float = 0.0  # re-sort the eviction order once it is this old (0: whenever time moved;
    # 1 s of staleness cost 5% more recompute on the odd Claude Code files, and sorting is cheap)
    max_idle_s: float = 3_600.0  # protection ends after this long paused
    # at each expire tick, a protected pause whose P (given its wait) decayed below release_below
    # loses its protection (False: only the P at the pause decides)
    release_decayed: bool = True
    min_horizon_s: float = 1.0
    churn_halflife_s: float = 30.0
    block_size: int = 16  # tokens per block, for receipts
    rates: CostRates = field(default_factory=CostRates)
    # With lower tiers: prefetch a paused trajectory at an expire tick when P(it returns within
    # the next prefetch_window_s) is above this (tool_finished prefetches at once).
    prefetch_above: float = 0.5
    prefetch_window_s: float = 10.0


@dataclass(slots=True)
class _Pause:
    """An open pause: from its response to its return, or its leaving."""

    start_s: float
    pause_class: str
    hashes: tuple[BlockHash, ...]
    advice: CacheAdvice
    expected_return_s: float | None = None  # a harness's hint, absolute
    returned_s: float | None = None  # tool_finished came before its request: observed then


@dataclass(slots=True)
class _Moment:
    """What a pass over the protected trajectories at one time computes once: the horizon, and
    each class's P at a fresh pause."""

    horizon_s: float | None = None
    fresh: dict[str, float] = field(default_factory=dict)


_RUNNING, _NO_PAUSE, _CLASS, _HINT, _UNUSED = 0, 1, 2, 3, -1  # what a row's rank is computed from


class _RankTable:
    """The protected trajectories' rank inputs, one row each, as arrays, so that the eviction
    order is computed with a few array operations per pause class rather than a Python call per
    trajectory (with thousands protected, that call was ~85% of the simulator's time). A row
    holds what `p_keep` reads: running, no open pause, or its pause's start, class and hint.
    Rows are refreshed lazily: every lifecycle call touches its key, and a sort refreshes the
    touched rows first. `seq` is the order of protection, the tie-break (as in the dict)."""

    def __init__(self) -> None:
        self.rows: dict[TrajectoryKey, int] = {}
        self.traj: list[Trajectory | None] = []
        self.free: list[int] = []
        self.dirty: set[TrajectoryKey] = set()
        self.kind = np.full(0, _UNUSED, dtype=np.int8)
        self.cls = np.zeros(0, dtype=np.int32)
        self.start = np.zeros(0)
        self.expected = np.zeros(0)
        self.seq = np.zeros(0, dtype=np.int64)
        # the eviction walk's marks leave nothing of it to walk (AgentEviction sets and clears it)
        self.spent = np.zeros(0, dtype=bool)
        self.class_index: dict[str, int] = {}
        self.class_names: list[str] = []
        self._next_seq = 0

    def add(self, t: Trajectory) -> None:
        if self.free:
            row = self.free.pop()
        else:
            row = len(self.traj)
            self.traj.append(None)
            if row >= len(self.kind):  # grow every array by doubling
                size = max(64, 2 * len(self.kind))
                self.kind = np.concatenate([self.kind, np.full(size - len(self.kind), _UNUSED, dtype=np.int8)])
                for name in ("cls", "start", "expected", "seq", "spent"):
                    a = getattr(self, name)
                    setattr(self, name, np.concatenate([a, np.zeros(size - len(a), dtype=a.dtype)]))
        self.rows[t.key] = row
        self.traj[row] = t
        self.seq[row] = self._next_seq
        self.spent[row] = False
        self._next_seq += 1
        self.dirty.add(t.key)

    def remove(self, key: TrajectoryKey) -> None:
        row = self.rows.pop(key, None)
        if row is None:
            return
        self.traj[row] = None
        self.kind[row] = _UNUSED
        self.free.append(row)
        self.dirty.discard(key)

    def touch(self, key: TrajectoryKey) -> None:
        if key in self.rows:
            self.dirty.add(key)

    def class_of(self, name: str) -> int:
        i = self.class_index.get(name)
        if i is None:
            i = self.class_index[name] = len(self.class_names)
            self.class_names.append(name)
        return i


@dataclass(slots=True)
class Residency:
    """Registry + return estimator + the state the eviction order needs (which hash is held by
    which protected trajectories). Owned by one pool; fed by lifecycle calls from one thread
    (the engine's, in the server)."""

    num_blocks: int
    clock: Callable[[], float]
    config: ResidencyConfig = field(default_factory=ResidencyConfig)
    registry: TrajectoryRegistry = field(default_factory=TrajectoryRegistry)
    estimator: ReturnEstimator = field(default_factory=ReturnEstimator)
    timer: Callable[[], float] = time.perf_counter  # measures the policy's own cost
    holders: dict[BlockHash, int] = field(default_factory=dict)  # protected trajectories holding it
    protected: dict[TrajectoryKey, Trajectory] = field(default_factory=dict)
    # called with a trajectory whose protection changed and the hashes whose holders changed
    listener: Callable[[TrajectoryKey, Sequence[BlockHash]], None] | None = None
    on_receipt: Callable[[DecisionReceipt], None] | None = None
    log: list[tuple[object, ...]] | None = None  # when a list: every decision, in order (tests)
    # when set: at every pause, the new pause and the eviction-order key of every protected
    # trajectory then (prediction-quality reports; costs a pass over them per pause)
    on_pause: Callable[[TrajectoryKey, float, list[tuple[TrajectoryKey, tuple[float, float]]]], None] | None = None
    pool: PoolView | None = None  # set by attach(); receipts then count resident blocks
    tiers: TierActions | None = None  # lower KV tiers: advice may offload, prefetch and release
    policy_s: float = 0.0  # time spent in the policy (lifecycle calls and held-block pops)
    policy_calls: int = 0
    version: int = 0  # bumped whenever a protection or a state changes (the eviction order's cache)
    num_receipts: int = 0
    _pauses: dict[TrajectoryKey, _Pause] = field(default_factory=dict)
    # the last block of each paused trajectory's last sequence, and of its last prompt -> it
    _tails: dict[BlockHash, TrajectoryKey] = field(default_factory=dict)
    _tail_of: dict[TrajectoryKey, tuple[BlockHash, ...]] = field(default_factory=dict)
    _anon: Iterator[int] = field(default_factory=itertools.count)
    _churn_rate: float = 0.0  # blocks evicted per second, smoothed
    _churn_t: float | None = None
    _evictions_seen: int = 0
    _protected_blocks: int = 0  # hashes of protected trajectories' last sequences (stats)
    _table: _RankTable = field(default_factory=_RankTable)  # protected: rank inputs as arrays
    # from this many protected trajectories the order is computed over the arrays; below, a
    # Python call per trajectory is cheaper than the array operations' fixed cost (same order)
    array_rank_min: int = 48  # measured: 126 vs 179 us per sort at 32, 236 vs 164 at 64

    def attach(self, pool: PoolView) -> None:
        self.pool = pool

    def _timed(self, start: float) -> None:
        self.policy_s += self.timer() - start
        self.policy_calls += 1

    # identity --------------------------------------------------------------------------
    def anonymous(self, tenant: str) -> TrajectoryKey:
        return TrajectoryKey(tenant, f"anon-{next(self._anon)}")

    def identify(self, prompt_hashes: Sequence[BlockHash]) -> TrajectoryKey | None:
        """The paused trajectory whose last sequence this prompt extends, if any: an anonymous
        request's trajectory. "Extends" is at least its last prompt whole: a chat template
        re-renders the reply it generated (a tool call in the template's own format), so the
        reply's own blocks rarely match; the deepest match wins. Hashes are chained and
        salted, so a match means the same tenant and the same whole prefix."""
        tails = self._tails
        for h in reversed(prompt_hashes):
            key = tails.get(h)
            if key is not None:
                t = self.registry.get(key)
                if t is not None and t.paused:
                    return key
        return None

    # lifecycle -------------------------------------------------------------------------
    def on_request(self, key: TrajectoryKey, parent: TrajectoryKey | None = None,
                   session: str | None = None) -> Trajectory:
        start = self.timer()
        now = self.clock()
        self._table.touch(key)
        self._close(key, "returned", now)
        # Still protected, now at full value: a request that waits in the queue needs its
        # blocks next (they leave the eviction order once the scheduler takes them); its
        # response replaces them with the new sequence.
        t, dropped = self.registry.request(key, now, parent, session)
        self.version += 1  # running: full value
        for old in dropped:
            self._forget(old, "dropped", now)
        self._timed(start)
        return t

    def on_response(self, key: TrajectoryKey, hashes: Sequence[BlockHash], state: State,
                    pause_class: str | None, expected_s: float | None = None,
                    prompt_blocks: int | None = None) -> CacheAdvice | None:
        """Its response ended: paused on a tool of `pause_class`, waiting for a human, or done.
        expected_s: a harness's hint of how long the pause lasts; prompt_blocks: how many of
        `hashes` were its prompt's (for identify)."""
        start = self.timer()
        now = self.clock()
        self._table.touch(key)
        cls = self.estimator.class_of(pause_class) if pause_class is not None else None
        old = self.protected.get(key)
        grown = None  # the new sequence extends the protected old one: only its new blocks change
        if old is not None and state in PAUSED and cls is not None and len(hashes) >= len(old.hashes) \
                and tuple(hashes[: len(old.hashes)]) == old.hashes:
            grown = len(old.hashes)
        else:
            self._unprotect(key)  # before its hashes change: holders count the old sequence
        self._untail(key)
        t = self.registry.respond(key, now, hashes, state, cls)
        if grown is not None and t is not None:
            self._extend(t, grown)
        advice = None
        if t is not None and t.paused and cls is not None:
            tails = {t.hashes[-1]} if t.hashes else set()
            if prompt_blocks and prompt_blocks <= len(t.hashes):
                tails.add(t.hashes[prompt_blocks - 1])
            for h in tails:
                self._tails[h] = key
            self._tail_of[key] = tuple(tails)
            advice = self._pause(t, cls, now, expected_s)
        self._timed(start)
        return advice

    def on_abandoned(self, key: TrajectoryKey) -> None:
        """Its request failed or was aborted before a response: it waits, unprotected, with the
        sequence it had (a retry resends that)."""
        t = self.registry.get(key)
        if t is not None and t.state is State.RUNNING:
            self._unprotect(key)
            self.registry.respond(key, self.clock(), t.hashes, State.WAITING_HUMAN, None)

    def on_event(self, key: TrajectoryKey, event: Event, tool_class: str | None = None,
                 expected_s: float | None = None) -> Outcome:
        """A harness's lifecycle event. Raises KeyError for a trajectory it does not know
        (model_started opens one)."""
        start = self.timer()
        now = self.clock()
        self._table.touch(key)
        t = self.registry.get(key)
        try:
            if t is None:
                if event is not Event.MODEL_STARTED:
                    raise KeyError(key)
                self.registry.request(key, now)
                return Outcome.APPLIED
            if t.state in (State.FINISHED, State.CANCELLED):
                return Outcome.DUPLICATE if event in _ENDS and _ENDS[event] is t.state else Outcome.OUT_OF_ORDER
            if event in _ENDS:
                self.on_end(key, _ENDS[event])
                return Outcome.APPLIED
            pause = self._pauses.get(key)
            if event is Event.TOOL_STARTED:
                if not t.paused:
                    return Outcome.OUT_OF_ORDER  # its response has not ended yet
                cls = self.estimator.class_of(tool_class) if tool_class is not None else None
                if pause is not None and pause.returned_s is None and (cls is None or cls == pause.pause_class) \
                        and expected_s is None:
                    return Outcome.DUPLICATE
                # the harness names the tool (or its duration): the pause is re-advised
                self._unprotect(key)
                self._pauses.pop(key, None)
                t.state, t.pause_class = State.PAUSED_TOOL, cls or t.pause_class or "other"
                self._pause(t, t.pause_class, t.last_response_s if t.last_response_s is not None else now,
                            expected_s, now)
                return Outcome.APPLIED
            if event is Event.TOOL_FINISHED or event is Event.MODEL_STARTED:
                if pause is None or pause.returned_s is not None:
                    return Outcome.DUPLICATE if pause is not None or t.state is State.RUNNING else Outcome.OUT_OF_ORDER
                # it returns now: the gap is observed; kept at full value until its request
                pause.returned_s = now
                self.estimator.observe_return(pause.pause_class, now - pause.start_s)
                t.state = State.RUNNING
                self.version += 1
                if self.tiers is not None:  # its request follows: bring its blocks back first
                    self.tiers.prefetch(t.hashes, key.tenant)
                return Outcome.APPLIED
            raise AssertionError(event)
        finally:
            self._timed(start)

    def on_end(self, key: TrajectoryKey, state: State, why: str | None = None) -> None:
        """trajectory_finished / cancelled / its session closed: protection released at once.
        why: the tombstone cause if its blocks are evicted later (default: trajectory_<state>)."""
        now = self.clock()
        self._close(key, state.value, now)
        self._unprotect(key, why or f"trajectory_{state.value}")
        t = self.registry.get(key)
        if t is not None:
            self._release_lower(t)
        self.registry.end(key, state)
        self._untail(key)

    def expire(self) -> None:
        start = self.timer()
        now = self.clock()
        for t in self.registry.expire(now):
            self._forget(t, "expired", now)
        for key, pause in list(self._pauses.items()):
            if now - pause.start_s > self.config.max_idle_s:
                self._close(key, "expired", now)
                self._unprotect(key, "protection_expired")
        waits: dict[str, list[float]] = {}  # pauses still open count as censored at their wait
        for pause in self._pauses.values():
            if pause.returned_s is None:
                waits.setdefault(pause.pause_class, []).append(now - pause.start_s)
        self.estimator.set_open(waits)
        if self.config.release_decayed:
            self._release_decayed(now)
        if self.tiers is not None:
            self._prefetch_due(now)
        self.version += 1
        self._timed(start)

    def _release_decayed(self, now: float) -> None:
        """A paused trajectory whose P(return within the horizon), given its wait so far, fell
        below release_below loses its protection now, as it would have at a pause with that P.
        Its pause stays open (a return is still observed and settled)."""
        below = self.config.release_below
        if len(self.protected) < self.array_rank_min:
            ts = list(self.protected.values())
            low = [t for t, p in zip(ts, self._p_each(ts, now)) if p < below]
        else:  # the same P over the table's arrays, in protection order
            tab = self._table
            p = self._p_rows(now)
            rows = np.flatnonzero(((tab.kind == _CLASS) | (tab.kind == _HINT)) & (p < below))
            low = [tab.traj[row] for row in rows[np.argsort(tab.seq[rows], kind="stable")].tolist()]
        for t in low:
            assert t is not None
            pause = self._pauses.get(t.key)
            if pause is None or pause.returned_s is not None or not t.paused:
                continue
            self._unprotect(t.key, "protection_decayed")
            if self.log is not None:
                self.log.append((now, "decayed", t.key.id))

    def _prefetch_due(self, now: float) -> None:
        """Prefetch the paused trajectories likely back within the next window."""
        assert self.tiers is not None
        cfg = self.config
        for key, pause in self._pauses.items():
            if pause.returned_s is not None:
                continue
            p = self._p_return(pause.pause_class, now - pause.start_s, cfg.prefetch_window_s,
                               pause.expected_return_s, now)
            if p >= cfg.prefetch_above:
                self.tiers.prefetch(pause.hashes, key.tenant)

    def _release_lower(self, t: Trajectory) -> None:
        """It ended (finished, cancelled, its session closed): delete from the lower tiers its
        blocks no protected trajectory holds (a shared prefix of protected ones stays; any other
        is written through again by its next user)."""
        if self.tiers is not None and t.hashes:
            self.tiers.release([h for h in t.hashes if h not in self.holders], t.key.tenant)

    def _forget(self, t: Trajectory, outcome: str, now: float) -> None:
        """It left the registry unreturned: censored at its wait, protection released."""
        self._close(t.key, outcome, now)
        self._unprotect(t.key, "protection_expired")
        self._untail(t.key)  # its lower copies stay: it may still come back (the tiers' bounds age them)

    def _untail(self, key: TrajectoryKey) -> None:
        for h in self._tail_of.pop(key, ()):
            if self._tails.get(h) == key:
                del self._tails[h]

    # pauses, advice, receipts ----------------------------------------------------------
    def _pause(self, t: Trajectory, cls: str, start_s: float, expected_s: float | None,
               now: float | None = None) -> CacheAdvice:
        now = start_s if now is None else now
        expected = None if expected_s is None else start_s + min(expected_s, self.config.max_idle_s)
        advice = self._advise(t, cls, start_s, now, expected)
        if advice.p_return < self.config.release_below:  # the same estimate, only the verdict changes
            advice = dataclasses.replace(
                advice, action="release",
                reason=f"paused ({cls}); P(return within {self.horizon_s():.0f} s) = "
                       f"{advice.p_return:.3f} < {self.config.release_below}: not protected")
        if self.tiers is not None and advice.action == "retain":
            advice = self._tier_advice(t, cls, advice, expected, now)
        self._pauses[t.key] = _Pause(start_s, cls, t.hashes, advice, expected)
        self._table.touch(t.key)
        # A release unprotects it here; its lower copies stay (their space is not the pool's, and
        # the tiers' own bounds evict them): only an ended trajectory is deleted below.
        if advice.action == "retain":
            if t.key not in self.protected:
                self._protect(t)
            if len(self.protected) > self.config.max_protected:  # the lowest-ranked one loses it
                low = self.ranked(now)[0]
                self._unprotect(low.key, "protection_budget")
                if low.key in self._pauses:
                    p = self._pauses[low.key]
                    p.advice = low.advice = self._advise(
                        low, p.pause_class, p.start_s, now, p.expected_return_s, "release",
                        f"more than {self.config.max_protected} paused trajectories: the least likely to return")
                if low is t:
                    advice = t.advice
        else:
            self._unprotect(t.key, "released_by_policy")
        t.advice = advice
        if self.on_pause is not None:
            self.on_pause(t.key, start_s, [(x.key, key) for x, key in self.ranks(now) if x.key in self._pauses])
        if self.log is not None:
            self.log.append((now, "advice", t.key.id, cls, advice.action, round(advice.p_return, 9), len(t.hashes)))
        return advice

    def _tier_advice(self, t: Trajectory, cls: str, advice: CacheAdvice, expected: float | None,
                     now: float) -> CacheAdvice:
        """Retain, offload or release, by expected cost (trajectory/tier_advice.py)."""
        assert self.tiers is not None
        gap = expected - now if expected is not None else self.estimator.quantile(cls, 0.5)
        choice = choose_tier(len(t.hashes), advice.p_return, gap, self._churn(), self.num_blocks,
                             self.tiers.rates())
        return dataclasses.replace(advice, action=choice.action, reason=f"{advice.reason}; {choice.reason()}")

    def _advise(self, t: Trajectory, cls: str, start_s: float, now: float, expected: float | None,
                action: str = "retain", why: str = "") -> CacheAdvice:
        h = self.horizon_s()
        p = self._p_return(cls, now - start_s, h, expected, now)
        hint = "" if expected is None else f", expected back in {expected - now:.0f} s (hint)"
        return CacheAdvice(action, p * len(t.hashes), p, int(self.config.max_idle_s * 1000),
                           why or f"paused ({cls}){hint}; P(return within {h:.0f} s) = {p:.2f}",
                           start_s, cls, len(t.hashes), self.estimator.quantile(cls, 0.5),
                           self.estimator.samples(cls))

    def _close(self, key: TrajectoryKey, outcome: str, now: float) -> None:
        """Settle its open pause: returned (observed now unless tool_finished already did) or
        left (censored at its wait)."""
        pause = self._pauses.pop(key, None)
        if pause is None:
            return
        self._table.touch(key)
        returned = outcome == "returned" or pause.returned_s is not None
        back = pause.returned_s if pause.returned_s is not None else now
        gap = back - pause.start_s
        cdf = 1.0 - self.estimator.survival(pause.pause_class, gap)  # before this one counts
        if pause.returned_s is None:
            if returned:
                self.estimator.observe_return(pause.pause_class, gap)
            else:
                self.estimator.observe_censored(pause.pause_class, gap)
        pool = self.pool
        resident, evictions = len(pause.hashes), []
        if pool is not None:
            resident = len(pool.match_prefix(pause.hashes))
            if pool.tombstones is not None:
                for h in pause.hashes:
                    stone = pool.tombstones.get(h)
                    if stone is not None and stone.time_s >= pause.start_s:
                        evictions.append((stone.time_s - pause.start_s, stone.policy))
        receipt = settle(key.id, pause.advice, "returned" if returned else outcome, gap, cdf, resident,
                         evictions, self.config.block_size, self.config.rates)
        self.num_receipts += 1
        t = self.registry.get(key)
        if t is not None:
            t.receipts.append(receipt)
        if self.on_receipt is not None:
            self.on_receipt(receipt)

    # protection ------------------------------------------------------------------------
    def _extend(self, t: Trajectory, old_len: int) -> None:
        """It stays protected, its sequence grown from old_len blocks to t.hashes."""
        self.version += 1
        holders = self.holders
        new = t.hashes[old_len:]
        for h in new:
            holders[h] = holders.get(h, 0) + 1
        self._protected_blocks += len(new)
        if self.listener is not None:
            self.listener(t.key, new)

    def _protect(self, t: Trajectory) -> None:
        assert t.key not in self.protected
        self.version += 1
        self.protected[t.key] = t
        self._table.add(t)
        holders = self.holders
        for h in t.hashes:
            holders[h] = holders.get(h, 0) + 1
        self._protected_blocks += len(t.hashes)
        if self.listener is not None:
            self.listener(t.key, t.hashes)

    def _unprotect(self, key: TrajectoryKey, cause: str | None = None) -> None:
        """Its protection ends. cause: noted in the pool's tombstones for the blocks nobody
        protects now, so a later eviction of them says why they were exposed."""
        t = self.protected.pop(key, None)
        if t is None:
            return
        self._table.remove(key)
        self.version += 1
        holders = self.holders
        exposed = []
        for h in t.hashes:
            n = holders[h] - 1
            if n:
                holders[h] = n
            else:
                del holders[h]
                exposed.append(h)
        pool = self.pool
        if cause is not None and exposed and pool is not None and pool.tombstones is not None:
            pool.tombstones.note(exposed, cause)
        self._protected_blocks -= len(t.hashes)
        if self.listener is not None:
            self.listener(t.key, t.hashes)

    # value -----------------------------------------------------------------------------
    def _churn(self) -> float:
        """Blocks evicted per second, smoothed (half-life churn_halflife_s), read from the
        pool's eviction count: evictions, not frees, set how long a block stays (a request
        frees its whole prefix again at every finish, and most of that is hit again)."""
        pool = self.pool
        if pool is None:
            return self._churn_rate
        now, n = self.clock(), pool.num_evictions
        if self._churn_t is None:
            self._churn_t, self._evictions_seen = now, n
            return self._churn_rate
        if now == self._churn_t:
            # evictions of this moment count once time moves on: the horizon, and so the eviction
            # order, is one per moment (several pops at one time were ranked by different ones)
            return self._churn_rate
        dt = now - self._churn_t
        k = math.log(2) / self.config.churn_halflife_s
        decay = math.exp(-dt * k) if dt > 0 else 1.0
        self._churn_rate = self._churn_rate * decay + (n - self._evictions_seen) * k
        self._churn_t, self._evictions_seen = now, n
        return self._churn_rate

    def horizon_s(self) -> float:
        """How long a block freed now stays resident at the current churn: the pool turned
        over once at the rate blocks are evicted (1 h while nothing is evicted)."""
        rate = self._churn()
        if rate <= 0:
            return self.config.max_idle_s
        return max(self.config.min_horizon_s, min(self.config.max_idle_s, self.num_blocks / rate))

    def _p_return(self, cls: str, waited_s: float, horizon_s: float, expected: float | None,
                  now: float) -> float:
        """P(return within the horizon). A harness's duration hint replaces the class's
        estimate: certain when the expected return is within the horizon, else horizon / time left."""
        if expected is not None:
            left = expected - now
            return 1.0 if left <= horizon_s else horizon_s / left
        return self.estimator.p_return_within(cls, waited_s, horizon_s)

    def p_keep(self, t: Trajectory, now: float, moment: _Moment | None = None) -> float:
        """P(it returns within the horizon), never above what it was at the pause: the
        estimate conditioned on the wait so far, capped by the unconditioned one. The cap
        makes a longer wait never look better than a fresh pause of the same class, which the
        life table's bin noise otherwise allows (see `rank`). moment: what one pass over the
        protected trajectories at one time (a sort) computes once."""
        if t.state is State.RUNNING:
            return 1.0  # returned: needed now
        pause = self._pauses.get(t.key)
        if pause is None:
            return 0.0
        if moment is None:
            h = self.horizon_s()
        elif moment.horizon_s is None:
            # (computed only once a paused one needs it: the churn estimate it reads is updated
            # by each reading at a new time, so when it is read is part of the policy)
            h = moment.horizon_s = self.horizon_s()
        else:
            h = moment.horizon_s
        cls, expected = pause.pause_class, pause.expected_return_s
        if expected is None and moment is not None:
            fresh = moment.fresh.get(cls)
            if fresh is None:
                fresh = moment.fresh[cls] = self._p_return(cls, 0.0, h, None, now)
        else:
            fresh = self._p_return(cls, 0.0, h, expected, pause.start_s)
        waited = self._p_return(cls, now - pause.start_s, h, expected, now)
        return min(fresh, waited)

    def _p_each(self, ts: Sequence[Trajectory], now: float) -> list[float]:
        """p_keep(t, now, moment) of each, with one moment, bit for bit: the scalar sorts' path
        (under array_rank_min), one estimator call per pause class instead of a chain of calls
        per trajectory. The horizon is read at the first paused one, as p_keep reads it."""
        out = [0.0] * len(ts)
        h: float | None = None
        by_class: dict[str, tuple[list[int], list[float]]] = {}
        pauses, running = self._pauses, State.RUNNING
        for i, t in enumerate(ts):
            if t.state is running:
                out[i] = 1.0
                continue
            pause = pauses.get(t.key)
            if pause is None:
                continue
            if h is None:
                h = self.horizon_s()
            expected = pause.expected_return_s
            if expected is None:
                rows, waits = by_class.setdefault(pause.pause_class, ([], [0.0]))  # wait 0: fresh
                rows.append(i)
                waits.append(now - pause.start_s)
            else:  # _p_return with a hint, at the pause and now
                left0, left = expected - pause.start_s, expected - now
                out[i] = min(1.0 if left0 <= h else h / left0, 1.0 if left <= h else h / left)
        for cls, (rows, waits) in by_class.items():
            assert h is not None
            p = self.estimator.p_return_within_each(cls, waits, h)
            fresh = p[0]
            for i, q in zip(rows, p[1:]):
                out[i] = min(fresh, q)
        return out

    def _keys_each(self, ts: Sequence[Trajectory], now: float) -> list[tuple[float, float]]:
        """rank(t, now, moment) of each, with one moment (see _p_each)."""
        pauses, running = self._pauses, State.RUNNING
        keys = []
        for t, p in zip(ts, self._p_each(ts, now)):
            pause = pauses.get(t.key)
            keys.append((round(p, 2), now if t.state is running or pause is None else pause.start_s))
        return keys

    def value(self, t: Trajectory, now: float) -> float:
        """The expected value of keeping it: blocks expected to be reused."""
        return self.p_keep(t, now) * len(t.hashes)

    def rank(self, t: Trajectory, now: float, moment: _Moment | None = None) -> tuple[float, float]:
        """The eviction order's key, lowest first: P(return within the horizon) per block (to two
        decimals), then the pause's recency. Ranking by the value itself (P x blocks) or by P
        with the life table's own waits ordered returns worse than recency alone on the
        odd-numbered Claude Code files; this orders them better (docs/residency.md)."""
        p = self.p_keep(t, now, moment)
        pause = self._pauses.get(t.key)
        return (round(p, 2), now if t.state is State.RUNNING or pause is None else pause.start_s)

    def _refresh(self) -> None:
        """Rewrite the rows of the protected trajectories touched since the last sort."""
        tab = self._table
        for key in tab.dirty:
            row = tab.rows[key]
            t = tab.traj[row]
            assert t is not None
            pause = self._pauses.get(key)
            if t.state is State.RUNNING:
                tab.kind[row] = _RUNNING
            elif pause is None:
                tab.kind[row] = _NO_PAUSE
            else:
                tab.start[row] = pause.start_s
                if pause.expected_return_s is not None:
                    tab.kind[row], tab.expected[row] = _HINT, pause.expected_return_s
                else:
                    tab.kind[row], tab.cls[row] = _CLASS, tab.class_of(pause.pause_class)
        tab.dirty.clear()

    def _p_rows(self, now: float) -> np.ndarray:
        """p_keep of every row of the table (0 for unused rows), in array operations: per pause
        class one survival lookup over all its waits; a hint's P from its expected return."""
        self._refresh()
        tab = self._table
        kind = tab.kind
        p = np.zeros(len(kind))
        p[kind == _RUNNING] = 1.0
        h = self.horizon_s()
        hinted = np.flatnonzero(kind == _HINT)
        if len(hinted):
            left, left0 = tab.expected[hinted] - now, tab.expected[hinted] - tab.start[hinted]
            with np.errstate(divide="ignore"):
                waited = np.where(left <= h, 1.0, h / left)
                fresh = np.where(left0 <= h, 1.0, h / left0)
            p[hinted] = np.minimum(fresh, waited)
        by_class = np.flatnonzero(kind == _CLASS)
        if len(by_class):
            classes = tab.cls[by_class]
            for ci in np.unique(classes).tolist():
                rows = by_class[classes == ci]
                # the fresh pause's P (wait 0) in the same lookup as every row's wait
                both = self.estimator.p_return_within_many(
                    tab.class_names[ci], np.concatenate(([0.0], now - tab.start[rows])), h)
                p[rows] = np.minimum(both[0], both[1:])
        return p

    def _sorted_rows(self, now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The table's used rows lowest rank first (ties in protection order), and their rank
        keys: P to two decimals, then the pause's start (now for a row with no open pause)."""
        tab = self._table
        p = self._p_rows(now)
        used = np.flatnonzero(tab.kind != _UNUSED)
        kind = tab.kind[used]
        key1 = np.round(p[used], 2)
        key2 = np.where((kind == _CLASS) | (kind == _HINT), tab.start[used], now)
        order = np.lexsort((tab.seq[used], key2, key1))
        return used[order], key1[order], key2[order]

    def ranks(self, now: float) -> list[tuple[Trajectory, tuple[float, float]]]:
        """Every protected trajectory with its rank (see `rank`), lowest first; ties in the
        order they were protected."""
        if len(self.protected) < self.array_rank_min:
            ts = list(self.protected.values())
            return sorted(zip(ts, self._keys_each(ts, now)), key=lambda x: x[1])  # stable: ties in order
        rows, key1, key2 = self._sorted_rows(now)
        traj = self._table.traj
        return [(traj[row], (a, b)) for row, a, b in zip(rows.tolist(), key1.tolist(), key2.tolist())]  # type: ignore[misc]

    def ranked(self, now: float) -> list[Trajectory]:
        """Protected trajectories, lowest rank first."""
        if len(self.protected) < self.array_rank_min:
            ts = list(self.protected.values())
            keys = self._keys_each(ts, now)
            return [ts[i] for i in sorted(range(len(ts)), key=keys.__getitem__)]  # stable, as sorted(ts, key=rank)
        traj = self._table.traj
        return [traj[row] for row in self._sorted_rows(now)[0].tolist()]  # type: ignore[misc]

    def ranked_rows(self, now: float) -> np.ndarray:
        """The same order as `ranked`, as rows of the rank table (the eviction walk's: it reads
        a row's trajectory only when it gets to it, and skips the spent rows in one operation)."""
        if len(self.protected) < self.array_rank_min:
            rows = self._table.rows
            return np.fromiter((rows[t.key] for t in self.ranked(now)), dtype=np.int64, count=len(self.protected))
        return self._sorted_rows(now)[0]

    # views -----------------------------------------------------------------------------
    def describe(self, key: TrajectoryKey) -> dict[str, object] | None:
        t = self.registry.get(key)
        if t is None:
            return None
        now = self.clock()
        return {
            "id": t.key.id, "state": t.state.value, "pause_class": t.pause_class,
            "parent_trajectory_id": None if t.parent is None else t.parent.id,
            "sessions": sorted(t.sessions), "num_requests": t.num_requests, "blocks": len(t.hashes),
            "protected": key in self.protected, "expected_value": round(self.value(t, now), 3),
            "created": t.created_s, "last_request": t.last_request_s, "last_response": t.last_response_s,
            "advice": None if t.advice is None else t.advice.as_dict(),
            "receipts": [r.as_dict() for r in t.receipts]}

    def stats(self) -> dict[str, object]:
        states: dict[str, int] = {}
        for t in self.registry:
            states[t.state.value] = states.get(t.state.value, 0) + 1
        return {"policy_version": POLICY_VERSION, "trajectories": len(self.registry), "states": states,
                "protected": len(self.protected), "protected_hashes": self._protected_blocks,
                "num_blocks": self.num_blocks, "budget": self.config.budget, "horizon_s": round(self.horizon_s(), 3),
                "dropped": self.registry.num_dropped, "expired": self.registry.num_expired,
                "receipts": self.num_receipts, "policy_seconds": round(self.policy_s, 6),
                "policy_calls": self.policy_calls, "classes": self.estimator.stats()}


_ENDS = {Event.TRAJECTORY_FINISHED: State.FINISHED, Event.TRAJECTORY_CANCELLED: State.CANCELLED}


class AgentEviction:
    """The pool's EvictionPolicy with a Residency behind it (module docstring)."""

    name = POLICY_VERSION

    def __init__(self, residency: Residency) -> None:
        self.residency = residency
        residency.listener = self._holders_changed
        self._hash_of: Sequence[BlockHash | None] = ()  # the pool's, from push
        self._lru: OrderedDict[BlockId, None] = OrderedDict()  # unprotected, least recently freed first
        self._held: set[BlockId] = set()  # free, cached, held by a protected trajectory
        self.num_protected_evictions = 0
        self.num_budget_evictions = 0  # of those, taken before unprotected blocks (over the budget)
        self._order = np.zeros(0, dtype=np.int64)  # rows of the residency's rank table
        self._order_version, self._order_t = -1, -math.inf
        # Marks, per protection (dropped whenever its protection changes): a tail mark (hashes,
        # i) says hashes[i:] are not in the pool, a head mark (hashes, j) that none of hashes[:j]
        # was a held block (in use, or not cached) when the walk last passed it; the walk goes
        # from i down to j. Each hash a mark skips is registered, so that its push (computed
        # again, or freed) undoes the mark: in _behind1/_ahead1 when the walk saw it with one
        # holder (that trajectory: a second registrant then means the first is no longer
        # protected), else in the sets of _behind/_ahead.
        self._gone: dict[TrajectoryKey, tuple[tuple[BlockHash, ...], int]] = {}
        self._heads: dict[TrajectoryKey, tuple[tuple[BlockHash, ...], int]] = {}
        self._behind1: dict[BlockHash, TrajectoryKey] = {}
        self._ahead1: dict[BlockHash, TrajectoryKey] = {}
        self._behind: dict[BlockHash, set[TrajectoryKey]] = {}
        self._ahead: dict[BlockHash, set[TrajectoryKey]] = {}

    def push(self, block_ids: Sequence[BlockId], hash_of: Sequence[BlockHash | None]) -> None:
        # hash_of is the pool's own list: a block's entry stays valid while the block is here
        # (the pool clears it only after pop), so remove and pop read hashes from it too
        assert self.residency.pool is not None, "attach the pool to the residency before it frees blocks"
        self._hash_of = hash_of
        hashes = list(map(hash_of.__getitem__, block_ids))
        assert None not in hashes, "only cached blocks are pushed"
        holders, lru, held = self.residency.holders, self._lru, self._held
        # (C-level set passes: a finished request frees thousands of blocks at once; freed
        # blocks are in neither set, so setting them in the OrderedDict appends in this order,
        # one by one: a plain loop beats OrderedDict.update, as in LruEviction.push)
        if holders.keys().isdisjoint(hashes):
            for b in block_ids:
                lru[b] = None
            return
        protected = list(map(holders.__contains__, hashes))
        if all(protected):
            held.update(block_ids)
        else:
            held.update(itertools.compress(block_ids, protected))
            for b in itertools.compress(block_ids, map(operator.not_, protected)):
                lru[b] = None
        # a protected hash computed again: undo the marks that skip it (an extra undo is harmless)
        self._undo(hashes)

    def _undo(self, hashes: Sequence[BlockHash]) -> None:
        """Drop the marks that skip any of these hashes (each trajectory's once: a freed
        sequence hits hundreds of the hashes one mark skipped)."""
        keys: set[TrajectoryKey] = set()
        for one in (self._behind1, self._ahead1):
            if one and (common := one.keys() & hashes):
                keys.update(map(one.pop, common))
        for many in (self._behind, self._ahead):
            if many:
                for h in many.keys() & hashes:
                    keys.update(many.pop(h))
        for key in keys:
            self._unmark(key)

    def _unmark(self, key: TrajectoryKey) -> None:
        self._gone.pop(key, None)
        self._heads.pop(key, None)
        tab = self.residency._table
        row = tab.rows.get(key)
        if row is not None:
            tab.spent[row] = False

    def remove(self, block_ids: Sequence[BlockId]) -> None:
        held = self._held
        before = len(held)
        held.difference_update(block_ids)
        if before - len(held) < len(block_ids):
            lru = self._lru
            for b in block_ids:
                lru.pop(b, None)

    def _holders_changed(self, key: TrajectoryKey, hashes: Sequence[BlockHash]) -> None:
        self._unmark(key)  # its protection changed: marks start again
        holders, pool = self.residency.holders, self.residency.pool
        if pool is None or not (self._lru or self._held):
            return
        # (a block moving from lru to held here is under no live mark: a mark's trajectory holds
        # every hash it skips, so such a block would have been held already)
        index, lru, held = pool.index, self._lru, self._held
        now_held = list(map(holders.__contains__, hashes))
        if all(now_held):  # protected or grown (the usual calls): free ones move to held
            moved = lru.keys() & map(index.get, hashes)
            for b in moved:
                del lru[b]
            held.update(moved)
            return
        if not any(now_held):  # released, nothing shared with another: held ones go to lru in order
            moved = list(filter(held.__contains__, map(index.get, hashes)))  # (None: not cached)
            held.difference_update(moved)
            for b in moved:
                lru[b] = None
            return
        for h in hashes:
            b = index.get(h)
            if b is None:
                continue
            if h in holders:
                if b in lru:  # free and newly held
                    del lru[b]
                    held.add(b)
            elif b in held:
                held.discard(b)
                # released: as if freed now (at the head instead measured no different on the
                # odd Claude Code files: a finished sub-agent's blocks serve the next one's prompt)
                lru[b] = None

    def _over_budget(self) -> int:
        """Protected free blocks past the budget: `pop` takes these before unprotected ones."""
        res = self.residency
        return max(0, len(self._held) - int(res.config.budget * res.num_blocks))

    @property
    def num_unprotected(self) -> int:
        """Unprotected free blocks, plus the protected ones past the budget."""
        return len(self._lru) + self._over_budget()

    def count_unprotected(self, block_ids: Sequence[BlockId]) -> int:
        # (a returning trajectory's matched blocks are mostly held: the intersection with the
        # few unprotected ones builds a small set, where one with _held built a large one)
        return len(self._lru.keys() & block_ids)

    def pop(self, n: int) -> list[BlockId]:
        res = self.residency
        out: list[BlockId] = []
        over = self._over_budget()
        if over > 0:  # protected blocks past the budget: the least valuable go before unprotected ones
            start = res.timer()
            out += self._pop_held(min(n, over))
            res._timed(start)
            self.num_budget_evictions += len(out)
        lru = self._lru
        while lru and len(out) < n:
            out.append(lru.popitem(last=False)[0])
        if len(out) < n:
            start = res.timer()
            out += self._pop_held(n - len(out))
            res._timed(start)
        log = self.residency.log
        if log is not None:
            hash_of = self._hash_of
            log.append((self.residency.clock(), "evict", tuple(hash_of[b] for b in out)))
        return out

    def _ranked(self, now: float) -> np.ndarray:
        """Protected trajectories' rows, lowest value first. Re-sorted when the protected set or
        a state changed, or after `reorder_s`: values drift slowly, and a sort per allocation
        was most of the policy's cost."""
        res = self.residency
        if res.version != self._order_version or now - self._order_t > res.config.reorder_s:
            self._order = res.ranked_rows(now)
            self._order_version, self._order_t = res.version, now
        return self._order

    def _pop_held(self, n: int) -> list[BlockId]:
        """Lowest-value paused trajectories first, tail first; a shared block goes with its most
        valuable holder, i.e. once every less valuable holder has been passed. Each
        trajectory's evicted tail is skipped from where the last walk found it (`_gone`); a
        walk that comes up short (a block published again behind that mark) walks again in full.
        Each trajectory's head below its held blocks (in use by other requests, or not cached)
        is skipped up to its head mark (`_heads`)."""
        res = self.residency
        # stale entries of released trajectories: past twice what the protected hold, start over
        # (marks are only a shortcut; a walk that sets them again costs what one without them does)
        registered = len(self._behind1) + len(self._ahead1) + len(self._behind) + len(self._ahead)
        if registered > 2 * res._protected_blocks + 4 * res.num_blocks or len(self._heads) > 4 * len(res.protected) + 64:
            self._clear_marks()
        out = self._walk(n, self._gone)
        if len(out) < n:
            self._clear_marks()
            out += self._walk(n - len(out), None)
        if len(out) < n:  # every held block's hash has a protected holder: unreachable
            raise AssertionError(f"asked for {n} held blocks, found {len(out)}")
        self.num_protected_evictions += n
        return out

    def _clear_marks(self) -> None:
        for d in (self._gone, self._heads, self._behind1, self._ahead1, self._behind, self._ahead):
            d.clear()
        self.residency._table.spent[:] = False

    def _register(self, key: TrajectoryKey, hashes: Sequence[BlockHash], one: dict[BlockHash, TrajectoryKey],
                  many: dict[BlockHash, set[TrajectoryKey]]) -> None:
        """Note that a mark of key skips these hashes (see __init__)."""
        count = self.residency.holders.__getitem__
        if max(map(count, hashes), default=1) == 1:
            one.update(zip(hashes, itertools.repeat(key)))
            return
        for h in hashes:
            if count(h) == 1:
                one[h] = key
            else:
                many.setdefault(h, set()).add(key)

    def _walk(self, n: int, gone: dict[TrajectoryKey, tuple[tuple[BlockHash, ...], int]] | None) -> list[BlockId]:
        """Up to n held blocks in the order `_pop_held` defines. Skipping a hash that is not a
        held block never changes a decision (`passed` only matters for held ones). Without
        marks (gone None) this is the plain walk; with them, each trajectory is walked from its
        tail mark down to its head mark, in windows of C-level lookups while no hash in the
        window is shared, one hash at a time from the first shared one."""
        res = self.residency
        holders, held = res.holders, self._held
        assert res.pool is not None  # (push asserts it)
        cached = res.pool.index  # in the pool at all, used or free
        get, is_held, count = cached.get, held.__contains__, holders.__getitem__
        heads, register = self._heads, self._register
        behind1, behind = self._behind1, self._behind
        passed: dict[BlockHash, int] = {}  # less valuable holders already passed, per shared hash
        out: list[BlockId] = []
        tab = res._table
        order, traj, spent = self._ranked(res.clock()), tab.traj, tab.spent
        if gone is not None:  # a spent row's walk would change nothing (its marks stay as they are)
            order = order[~spent[order]]
        for row in order.tolist():
            t = traj[row]
            assert t is not None
            key = t.key
            if key not in res.protected:
                continue
            hashes = t.hashes
            i, lo = len(hashes), 0
            if gone is not None:
                mark = gone.get(key)
                if mark is not None and mark[0] is hashes:
                    i = mark[1]
                mark = heads.get(key)
                if mark is not None and mark[0] is hashes:
                    lo = mark[1]
            low_held = i  # the top of what a head mark may skip: below the evicted tail, below
            # the lowest block the walk passed and left held
            tail = True  # still inside its evicted tail (hashes no longer in the pool)
            while gone is not None and i > lo:  # windows, until a shared hash
                w = min(i - lo, 64 + 2 * (n - len(out)))
                seg = hashes[i - w : i]
                if max(map(count, seg)) > 1:
                    break
                blocks = list(map(get, seg))
                top = w
                if tail:
                    while top and blocks[top - 1] is None:
                        top -= 1
                    # evicted: a push of one of them (computed again) must undo the mark
                    behind1.update(zip(seg[top:], itertools.repeat(key)))
                    if not top:
                        i -= w
                        continue
                    gone[key] = (hashes, i - w + top)
                    low_held = i - w + top
                    tail = False
                taken = list(itertools.compress(blocks[:top], map(is_held, blocks[:top])))
                need = n - len(out)
                if len(taken) >= need:
                    taken = taken[len(taken) - need :]
                    held.difference_update(taken)
                    out += reversed(taken)
                    return out
                held.difference_update(taken)
                out += reversed(taken)
                i -= w
            while i > lo:  # one hash at a time
                h = hashes[i - 1]
                if tail and h not in cached:  # evicted: the mark may move past it
                    if gone is not None:  # a push of h (computed again) must undo the mark
                        register(key, (h,), behind1, behind)
                    i -= 1
                    continue
                b = get(h)
                if tail and gone is not None:
                    gone[key] = (hashes, i)
                    low_held = i
                    tail = False
                i -= 1
                if b not in held:  # in use, or not cached (None)
                    continue
                k = passed.get(h, 0) + 1
                if k < holders[h]:
                    passed[h] = k
                    low_held = i
                    continue
                held.discard(b)
                out.append(b)
                if len(out) == n:
                    return out
            if gone is None:
                continue
            if tail:
                gone[key] = (hashes, i)
                top = i
            else:
                top = gone[key][1]
                if low_held > lo:
                    # nothing in hashes[:low_held] is held now (those below lo are registered already)
                    register(key, hashes[lo:low_held], self._ahead1, self._ahead)
                    heads[key] = (hashes, low_held)
                    lo = low_held
            if top <= lo:  # the next walk would go from top down to lo: nothing, until a mark goes
                spent[row] = True
        return out

    def __len__(self) -> int:
        return len(self._lru) + len(self._held)

    def __iter__(self) -> Iterator[BlockId]:
        """Eviction order: unprotected LRU, then held (order decided at pop time)."""
        yield from self._lru
        yield from self._held


MODES = ("off", "shadow", "on")


def build_residency(mode: str, num_blocks: int, block_size: int, clock: Callable[[], float],
                    config: ResidencyConfig | None = None) -> tuple[Residency | None, AgentEviction | None]:
    """The residency policy for one pool, as the server and the simulator both build it:
    off: none (plain LRU); shadow: advice and receipts while the pool stays LRU; on: the pool
    evicts in the agent order (AgentEviction)."""
    if mode not in MODES:
        raise ValueError(f"unknown residency mode {mode!r}; use one of {', '.join(MODES)}")
    if mode == "off":
        return None, None
    cfg = config or ResidencyConfig()
    if cfg.block_size != block_size:
        cfg = dataclasses.replace(cfg, block_size=block_size)
    residency = Residency(num_blocks, clock, cfg)
    return residency, AgentEviction(residency) if mode == "on" else None
