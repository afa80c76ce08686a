"""The host tier: block payloads in host memory, bounded in bytes, least recently used first out.

`TierIndex` is the bookkeeping alone (which hashes a tier holds, their sizes, their order): the
simulator runs it with no payloads, the server wraps it in a `HostStore` that keeps the bytes.
Both are used from one thread (the engine's step thread): there is no lock.

Invariant: used_bytes == sum of the held entries' sizes <= capacity_bytes after every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from agentserve.kv.hashing import BlockHash


@dataclass(slots=True)
class TierStats:
    num_blocks: int = 0
    used_bytes: int = 0
    num_puts: int = 0
    num_hits: int = 0  # blocks served (get)
    num_evicted: int = 0  # dropped to make room (least recently used)
    num_deleted: int = 0  # dropped on request (released trajectories, a failed restore)
    num_rejected: int = 0  # larger than the whole tier
    bytes_in: int = 0
    bytes_out: int = 0


class TierIndex:
    """Which blocks a tier holds, in least-recently-used order (head = next out)."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{name} tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._sizes: OrderedDict[BlockHash, int] = OrderedDict()
        self.stats = TierStats()

    def __contains__(self, h: object) -> bool:
        return h in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def used_bytes(self) -> int:
        return self.stats.used_bytes

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes`, from the first, this tier holds (a prefix's reusable run)."""
        sizes = self._sizes
        for i, h in enumerate(hashes):
            if h not in sizes:
                return i
        return len(hashes)

    def add(self, h: BlockHash, nbytes: int) -> list[BlockHash] | None:
        """Hold h (most recently used); the hashes evicted to make room, or None if nbytes is
        more than the whole tier (nothing changes then)."""
        st = self.stats
        if h in self._sizes:
            self._sizes.move_to_end(h)
            return []
        if nbytes > self.capacity_bytes:
            st.num_rejected += 1
            return None
        evicted = []
        while st.used_bytes + nbytes > self.capacity_bytes:
            old, size = self._sizes.popitem(last=False)
            st.used_bytes -= size
            evicted.append(old)
        st.num_evicted += len(evicted)
        self._sizes[h] = nbytes
        st.used_bytes += nbytes
        st.num_puts += 1
        st.bytes_in += nbytes
        st.num_blocks = len(self._sizes)
        return evicted

    def touch(self, h: BlockHash) -> int:
        """Mark h used (a hit); its size."""
        self._sizes.move_to_end(h)
        size = self._sizes[h]
        self.stats.num_hits += 1
        self.stats.bytes_out += size
        return size

    def remove(self, h: BlockHash) -> bool:
        size = self._sizes.pop(h, None)
        if size is None:
            return False
        self.stats.used_bytes -= size
        self.stats.num_deleted += 1
        self.stats.num_blocks = len(self._sizes)
        return True

    def check(self) -> None:
        assert self.stats.used_bytes == sum(self._sizes.values()) <= self.capacity_bytes
        assert self.stats.num_blocks == len(self._sizes)


class HostStore:
    """A TierIndex that keeps each block's payload (immutable bytes) in host memory."""

    def __init__(self, capacity_bytes: int) -> None:
        self.index = TierIndex("host", capacity_bytes)
        self._payloads: dict[BlockHash, bytes] = {}

    def __contains__(self, h: object) -> bool:
        return h in self._payloads

    def match(self, hashes: Sequence[BlockHash]) -> int:
        return self.index.match(hashes)

    def put(self, h: BlockHash, payload: bytes) -> bool:
        evicted = self.index.add(h, len(payload))
        if evicted is None:
            return False
        for old in evicted:
            del self._payloads[old]
        self._payloads[h] = payload
        return True

    def get(self, h: BlockHash) -> bytes | None:
        payload = self._payloads.get(h)
        if payload is not None:
            self.index.touch(h)
        return payload

    def delete(self, h: BlockHash) -> None:
        if self.index.remove(h):
            del self._payloads[h]

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity_bytes

    def check(self) -> None:
        self.index.check()
        assert self._payloads.keys() == self.index._sizes.keys()
