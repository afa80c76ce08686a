"""Tombstones: what the pool remembers about hashes it evicted (when, why, under which policy).

A receipt (trajectory/receipts.py) uses them to say when a paused trajectory's blocks left and
who decided it. Bounded: past `capacity` the oldest tombstone goes first. A hash computed again
and published clears its tombstone (it is resident again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from agentserve.kv.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class Tombstone:
    time_s: float
    cause: str  # capacity: evicted to make room (tiers add offload)
    policy: str  # the eviction policy's name


@dataclass(slots=True)
class Tombstones:
    """Causes: `capacity` (evicted to make room, under `policy`), or, for a block whose last
    release was noted (`note`), that release: `preemption`, `protection_expired`,
    `protection_decayed`, `protection_budget`, `released_by_policy`, `trajectory_finished`,
    `trajectory_cancelled`, `session_closed`; `lower_tier_unreadable`
    for a block whose lower-tier copy failed to read or verify."""

    clock: Callable[[], float]
    capacity: int = 65_536
    _items: OrderedDict[BlockHash, Tombstone] = field(default_factory=OrderedDict)
    _noted: OrderedDict[BlockHash, str] = field(default_factory=OrderedDict)  # latest release cause

    @classmethod
    def for_pool(cls, clock: Callable[[], float], num_blocks: int) -> Tombstones:
        """Sized to remember a few pools' worth of evictions."""
        return cls(clock, capacity=max(4 * num_blocks, 1024))

    def note(self, hashes: Iterable[BlockHash], cause: str) -> None:
        """These blocks lost what kept them (their request was preempted, their trajectory's
        protection ended): if they are evicted later, this is the cause recorded."""
        noted = self._noted
        for h in hashes:
            noted[h] = cause
            noted.move_to_end(h)
        while len(noted) > self.capacity:
            noted.popitem(last=False)

    def record(self, hashes: Iterable[BlockHash], cause: str, policy: str) -> None:
        now = self.clock()
        stone = Tombstone(now, cause, policy)
        items, noted = self._items, self._noted
        for h in hashes:
            why = noted.pop(h, None) if noted else None
            items[h] = stone if why is None else Tombstone(now, why, policy)
            items.move_to_end(h)
        while len(items) > self.capacity:
            items.popitem(last=False)

    def revive(self, hashes: Sequence[BlockHash]) -> None:
        pop = self._items.pop
        unnote = self._noted.pop
        for h in hashes:
            pop(h, None)
            unnote(h, None)

    def get(self, h: BlockHash) -> Tombstone | None:
        return self._items.get(h)

    def get_many(self, hashes: Sequence[BlockHash]) -> list[Tombstone]:
        """The tombstones of those of hashes that have one, in order (C-level lookups)."""
        return list(filter(None, map(self._items.get, hashes)))

    def __len__(self) -> int:
        return len(self._items)
