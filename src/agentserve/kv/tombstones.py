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
    clock: Callable[[], float]
    capacity: int = 65_536
    _items: OrderedDict[BlockHash, Tombstone] = field(default_factory=OrderedDict)

    def record(self, hashes: Iterable[BlockHash], cause: str, policy: str) -> None:
        stone = Tombstone(self.clock(), cause, policy)
        items = self._items
        for h in hashes:
            items[h] = stone
            items.move_to_end(h)
        while len(items) > self.capacity:
            items.popitem(last=False)

    def revive(self, hashes: Sequence[BlockHash]) -> None:
        pop = self._items.pop
        for h in hashes:
            pop(h, None)

    def get(self, h: BlockHash) -> Tombstone | None:
        return self._items.get(h)

    def __len__(self) -> int:
        return len(self._items)
