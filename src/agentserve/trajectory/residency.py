"""Agent-aware eviction: which free cached blocks go first when the pool needs space.

Order (the pool's `EvictionPolicy` seam, kv/block_pool.py):
1. free cached blocks that no protected trajectory holds, least recently freed first (LRU);
2. then the blocks of paused trajectories, lowest expected value first, each trajectory tail
   first (an inner block evicted makes every block after it useless to a prefix match). A
   block several trajectories hold goes with its most valuable holder.
A trajectory is protected while paused, for at most `max_idle_s`, and only while the blocks
protected stay under `budget` of the pool (the least valuable lose protection first). It is
soft, never a pin: the pool can always take every free block, so an allocation succeeds
whenever free blocks exist.

The expected value of keeping a paused trajectory is P(it returns within the horizon | the
time it has waited) x the blocks it would not recompute. The horizon is how long a block
freed now stays in the pool at the current churn (capacity / blocks freed per second, smoothed),
floored at `min_horizon_s`. Everything here is torch-free and reads only what a live server
knows at that moment: the simulator imports it as it is.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from agentserve.trajectory.estimator import ReturnEstimator
from agentserve.trajectory.registry import BlockHash, State, Trajectory, TrajectoryKey, TrajectoryRegistry

BlockId = int
POLICY_VERSION = "agent-ev-1"


@dataclass(frozen=True, slots=True)
class ResidencyConfig:
    budget: float = 0.9  # share of the pool's blocks paused trajectories may protect
    max_idle_s: float = 3_600.0  # protection ends after this long paused
    min_horizon_s: float = 1.0
    churn_halflife_s: float = 30.0


@dataclass(frozen=True, slots=True)
class CacheAdvice:
    """What the policy decided for a trajectory at a tool boundary (recorded, never enforced
    beyond the eviction order)."""

    action: str  # retain | release
    expected_value: float  # blocks expected to be reused
    p_return: float
    ttl_ms: int
    reason: str
    policy_version: str = POLICY_VERSION


@dataclass(slots=True)
class Residency:
    """Registry + return estimator + the state the eviction order needs (which hash is held by
    which protected trajectories). Owned by one pool; fed by lifecycle calls."""

    num_blocks: int
    clock: Callable[[], float]
    config: ResidencyConfig = field(default_factory=ResidencyConfig)
    registry: TrajectoryRegistry = field(default_factory=TrajectoryRegistry)
    estimator: ReturnEstimator = field(default_factory=ReturnEstimator)
    holders: dict[BlockHash, int] = field(default_factory=dict)  # protected trajectories holding it
    protected: dict[TrajectoryKey, Trajectory] = field(default_factory=dict)
    listener: Callable[[Sequence[BlockHash]], None] | None = None  # hashes whose holders changed
    _churn_rate: float = 0.0  # blocks freed per second, smoothed
    _churn_t: float | None = None
    _protected_blocks: int = 0

    # lifecycle -------------------------------------------------------------------------
    def on_request(self, key: TrajectoryKey, parent: TrajectoryKey | None = None) -> Trajectory:
        now = self.clock()
        t = self.registry.get(key)
        if t is not None and t.paused and t.last_response_s is not None and t.pause_class is not None:
            self.estimator.observe_return(t.pause_class, now - t.last_response_s)
        # Still protected, now at full value: a request that waits in the queue needs its
        # blocks next (they leave the eviction order once the scheduler takes them); its
        # response replaces them with the new sequence.
        t, dropped = self.registry.request(key, now, parent)
        for old in dropped:
            self._forget(old, now)
        return t

    def on_response(self, key: TrajectoryKey, hashes: Sequence[BlockHash], state: State,
                    pause_class: str | None) -> CacheAdvice | None:
        now = self.clock()
        cls = self.estimator.class_of(pause_class) if pause_class is not None else None
        self._unprotect(key)  # before its hashes change: holders count the old sequence
        t = self.registry.respond(key, now, hashes, state, cls)
        if t is None or not t.paused:
            return None
        self._protect(t)
        advice = self._advise(t, now)
        self._enforce_budget(now)
        return advice

    def on_end(self, key: TrajectoryKey, state: State) -> None:
        """trajectory_finished / cancelled: protection released at once."""
        t = self.registry.get(key)
        if t is not None and t.paused and t.pause_class is not None and t.last_response_s is not None:
            self.estimator.observe_censored(t.pause_class, self.clock() - t.last_response_s)
        self._unprotect(key)
        self.registry.end(key, state)

    def expire(self) -> None:
        now = self.clock()
        for t in self.registry.expire(now):
            self._forget(t, now)
        for key, t in list(self.protected.items()):
            if t.last_response_s is not None and now - t.last_response_s > self.config.max_idle_s:
                self._forget(t, now, keep=True)

    def _forget(self, t: Trajectory, now: float, keep: bool = False) -> None:
        """It left unreturned (expired, dropped): censored at its wait, protection released."""
        if t.paused and t.pause_class is not None and t.last_response_s is not None:
            self.estimator.observe_censored(t.pause_class, now - t.last_response_s)
            if keep:
                t.pause_class = None  # observed once; it stays in the registry, unprotected
        self._unprotect(t.key)

    # protection ------------------------------------------------------------------------
    def _protect(self, t: Trajectory) -> None:
        assert t.key not in self.protected
        self.protected[t.key] = t
        holders = self.holders
        for h in t.hashes:
            holders[h] = holders.get(h, 0) + 1
        self._protected_blocks += len(t.hashes)
        if self.listener is not None:
            self.listener(t.hashes)

    def _unprotect(self, key: TrajectoryKey) -> None:
        t = self.protected.pop(key, None)
        if t is None:
            return
        holders = self.holders
        for h in t.hashes:
            n = holders[h] - 1
            if n:
                holders[h] = n
            else:
                del holders[h]
        self._protected_blocks -= len(t.hashes)
        if self.listener is not None:
            self.listener(t.hashes)

    def _enforce_budget(self, now: float) -> None:
        cap = self.config.budget * self.num_blocks
        if self._protected_blocks <= cap:
            return
        for t in sorted(self.protected.values(), key=lambda t: self.value(t, now)):
            if self._protected_blocks <= cap:
                break
            self._unprotect(t.key)

    # value -----------------------------------------------------------------------------
    def on_freed(self, n: int) -> None:
        """n cached blocks were freed now: the churn that sets the horizon."""
        now = self.clock()
        if self._churn_t is None:
            self._churn_t = now
        dt = now - self._churn_t
        decay = math.exp(-dt * math.log(2) / self.config.churn_halflife_s) if dt > 0 else 1.0
        # rate as an exponentially weighted count per second
        self._churn_rate = self._churn_rate * decay + n * (math.log(2) / self.config.churn_halflife_s)
        self._churn_t = now

    def horizon_s(self) -> float:
        """How long a block freed now stays resident at the current churn."""
        if self._churn_rate <= 0:
            return self.config.max_idle_s
        return max(self.config.min_horizon_s, min(self.config.max_idle_s, self.num_blocks / self._churn_rate))

    def value(self, t: Trajectory, now: float) -> float:
        """Expected blocks reused if kept: P(return within the horizon) x its blocks (ranking
        by P alone, per block, measured worse on the Claude Code fixture and the 40-session set)."""
        if t.state is State.RUNNING:
            return float(len(t.hashes))  # returned: needed now
        if t.pause_class is None or t.last_response_s is None:
            return 0.0
        p = self.estimator.p_return_within(t.pause_class, now - t.last_response_s, self.horizon_s())
        return p * len(t.hashes)

    def _advise(self, t: Trajectory, now: float) -> CacheAdvice:
        h = self.horizon_s()
        assert t.pause_class is not None
        p = self.estimator.p_return_within(t.pause_class, 0.0, h)
        return CacheAdvice("retain", p * len(t.hashes), p, int(self.config.max_idle_s * 1000),
                           f"paused ({t.pause_class}); P(return within {h:.0f} s) = {p:.2f}")


class AgentEviction:
    """The pool's EvictionPolicy with a Residency behind it (module docstring)."""

    def __init__(self, residency: Residency) -> None:
        self.residency = residency
        residency.listener = self._holders_changed
        self._hash: dict[BlockId, BlockHash] = {}
        self._block: dict[BlockHash, BlockId] = {}
        self._lru: OrderedDict[BlockId, None] = OrderedDict()  # unprotected, least recently freed first
        self._held: set[BlockId] = set()  # free, cached, held by a protected trajectory
        self.num_protected_evictions = 0

    def push(self, block_ids: Sequence[BlockId], hash_of: Sequence[BlockHash | None]) -> None:
        holders = self.residency.holders
        for b in block_ids:
            h = hash_of[b]
            assert h is not None
            self._hash[b] = h
            self._block[h] = b
            if h in holders:
                self._held.add(b)
            else:
                self._lru[b] = None
        self.residency.on_freed(len(block_ids))

    def remove(self, block_ids: Sequence[BlockId]) -> None:
        for b in block_ids:
            h = self._hash.pop(b)
            del self._block[h]
            if b in self._held:
                self._held.discard(b)
            else:
                del self._lru[b]

    def _holders_changed(self, hashes: Sequence[BlockHash]) -> None:
        holders = self.residency.holders
        for h in hashes:
            b = self._block.get(h)
            if b is None:
                continue
            if h in holders:
                if b not in self._held:
                    del self._lru[b]
                    self._held.add(b)
            elif b in self._held:
                self._held.discard(b)
                self._lru[b] = None  # released: as if freed now

    def pop(self, n: int) -> list[BlockId]:
        out: list[BlockId] = []
        lru = self._lru
        while lru and len(out) < n:
            out.append(lru.popitem(last=False)[0])
        if len(out) < n:
            out += self._pop_held(n - len(out))
        for b in out:
            del self._block[self._hash.pop(b)]
        return out

    def _pop_held(self, n: int) -> list[BlockId]:
        """Lowest-value paused trajectories first, tail first; a shared block goes with its most
        valuable holder, i.e. once every less valuable holder has been passed."""
        res = self.residency
        now = res.clock()
        holders = res.holders
        passed: dict[BlockHash, int] = {}  # less valuable holders already passed, per shared hash
        out: list[BlockId] = []
        for t in sorted(res.protected.values(), key=lambda t: res.value(t, now)):
            for h in reversed(t.hashes):
                k = passed.get(h, 0) + 1
                if k < holders[h]:
                    passed[h] = k
                    continue
                b = self._block.get(h)
                if b is not None and b in self._held:
                    self._held.discard(b)
                    out.append(b)
                    if len(out) == n:
                        self.num_protected_evictions += n
                        return out
        # every held block's hash has a protected holder, so the walk above reaches all of them
        raise AssertionError(f"asked for {n} held blocks, found {len(out)}")

    def __len__(self) -> int:
        return len(self._lru) + len(self._held)

    def __iter__(self) -> Iterator[BlockId]:
        """Eviction order: unprotected LRU, then held (order decided at pop time)."""
        yield from self._lru
        yield from self._held
