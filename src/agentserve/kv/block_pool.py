"""The device KV block pool: fixed-size blocks, ref counts, an LRU free list and the prefix index.

Every block is in exactly one of two states:

| state    | ref_count | in free list | may hold a hash (be cached)            |
|----------|-----------|--------------|----------------------------------------|
| in use   | >= 1      | no           | yes, once its tokens are computed      |
| free     | 0         | yes          | yes: reusable until evicted            |

Free blocks are taken in eviction order, head first. Blocks without a hash hold nothing
reusable and come first, most recently freed first; then the cached free blocks, in the order
an `EvictionPolicy` chooses. The default, `LruEviction`, keeps them in the order given to `free`
(callers pass a request's blocks last-first, so a shared prefix outlives its private suffix).
`allocate` takes from the head and evicts the hash of a cached block it takes. OrderedDicts give
O(1) push at either end, pop at the head and removal from the middle (a cache hit on a free
block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NewType, Protocol

from agentserve.kv.hashing import BlockHash
from agentserve.kv.tombstones import Tombstones

BlockId = NewType("BlockId", int)


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_blocks: int
    num_used: int  # referenced by at least one request
    num_cached: int  # holding a hash (used or free)
    num_free: int  # unreferenced, allocatable (cached ones among them are evictable)
    num_evictions: int  # cached blocks whose hash was dropped to reuse the block, ever


class EvictionPolicy(Protocol):
    """Which free cached block gives up its hash next. It holds exactly the free blocks that
    hold a hash: `push` those that became free (in the order freed; hash_of[b] is block b's
    hash), `remove` those a cache hit takes back, `pop` the next n victims. Bulk calls keep the
    per-block cost low. Iteration is in eviction order (for check() and tests). `name` goes
    into tombstones and receipts."""

    name: str

    def push(self, block_ids: Sequence[BlockId], hash_of: Sequence[BlockHash | None]) -> None: ...
    def remove(self, block_ids: Sequence[BlockId]) -> None: ...
    def pop(self, n: int) -> list[BlockId]: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[BlockId]: ...

    @property
    def num_unprotected(self) -> int:
        """How many blocks `pop` gives before any block the policy protects (all of them for a
        policy that protects none)."""
        ...

    def count_unprotected(self, block_ids: Sequence[BlockId]) -> int:
        """How many of these blocks are free, cached and unprotected by the policy now: what a
        hit on them takes from `num_unprotected` (one call per admission check, a C-level pass,
        not a call per block)."""
        ...


class LruEviction:
    """Least recently freed first: pushes go to the tail, pops come from the head."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[BlockId, None] = OrderedDict()

    def push(self, block_ids: Sequence[BlockId], hash_of: Sequence[BlockHash | None]) -> None:
        order = self._order
        for b in block_ids:  # (a plain loop beats OrderedDict.update several times over)
            order[b] = None

    def remove(self, block_ids: Sequence[BlockId]) -> None:
        order = self._order
        for b in block_ids:
            del order[b]

    def pop(self, n: int) -> list[BlockId]:
        popitem = self._order.popitem
        return [popitem(last=False)[0] for _ in range(n)]

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[BlockId]:
        return iter(self._order)

    @property
    def num_unprotected(self) -> int:
        return len(self._order)

    def count_unprotected(self, block_ids: Sequence[BlockId]) -> int:
        return len(self._order.keys() & block_ids)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, eviction: EvictionPolicy | None = None,
                 tombstones: Tombstones | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_count = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._block_of: dict[BlockHash, BlockId] = {}
        # free and uncached, head first; free and cached live in the eviction policy
        self._uncached: OrderedDict[BlockId, None] = OrderedDict((BlockId(i), None) for i in range(num_blocks))
        self._evictable: EvictionPolicy = LruEviction() if eviction is None else eviction
        assert len(self._evictable) == 0, "the eviction policy must start empty"
        self.num_evictions = 0
        self.tombstones = tombstones  # evicted hashes, when a receipt needs them

    @property
    def num_free_blocks(self) -> int:
        return len(self._uncached) + len(self._evictable)

    @property
    def _free(self) -> list[BlockId]:
        """All free blocks in eviction order, head first (a copy)."""
        return [*self._uncached, *self._evictable]

    def ref_count(self, block_id: BlockId) -> int:
        return self._ref_count[block_id]

    def block_hash(self, block_id: BlockId) -> BlockHash | None:
        return self._hash_of[block_id]

    @property
    def index(self) -> Mapping[BlockHash, BlockId]:
        """Every cached hash and its block, used or free (read only)."""
        return self._block_of

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        """Blocks holding the longest cached prefix of `hashes`. Takes no reference."""
        get, matched = self._block_of.get, []
        for i in range(0, len(hashes), 64):  # C-level lookups, 64 at a time; cut at the first miss
            found = list(map(get, hashes[i : i + 64]))
            if None in found:
                return matched + found[: found.index(None)]
            matched += found
        return matched

    @property
    def num_unprotected_free_blocks(self) -> int:
        """Free blocks that can be taken without evicting a block the eviction policy protects
        (a paused or returned trajectory's, under `--residency on`): all free blocks under LRU."""
        return len(self._uncached) + self._evictable.num_unprotected

    def count_unprotected(self, block_ids: Sequence[BlockId]) -> int:
        """How many of these cached blocks are free and unprotected by the eviction policy."""
        return self._evictable.count_unprotected(block_ids)

    def count_free(self, block_ids: Sequence[BlockId]) -> int:
        """How many of these blocks are free (a hit on them takes them off the free list)."""
        return list(map(self._ref_count.__getitem__, block_ids)).count(0)

    def lock(self, block_ids: Sequence[BlockId]) -> None:
        """Take a reference on each of these distinct blocks (a cache hit); a free block leaves
        the free list."""
        rc = self._ref_count
        revived = [b for b in block_ids if not rc[b]]
        for b in block_ids:
            rc[b] += 1
        if not revived:
            return
        hash_of = self._hash_of
        if None in map(hash_of.__getitem__, revived):  # rare: free blocks without a hash
            for b in revived:
                if hash_of[b] is None:
                    del self._uncached[b]
            revived = [b for b in revived if hash_of[b] is not None]
        self._evictable.remove(revived)

    def allocate(self, n: int) -> list[BlockId]:
        """Take n blocks from the head of the free list, evicting their cached hashes."""
        if n > self.num_free_blocks:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        uncached = self._uncached
        k = min(n, len(uncached))
        out = [uncached.popitem(last=False)[0] for _ in range(k)]
        if k < n:
            victims = self._evictable.pop(n - k)
            hash_of, block_of = self._hash_of, self._block_of
            if self.tombstones is not None:
                self.tombstones.record([hash_of[b] for b in victims], "capacity",  # type: ignore[misc]
                                       self._evictable.name)
            for b in victims:
                del block_of[hash_of[b]]  # type: ignore[arg-type]
                hash_of[b] = None
            self.num_evictions += len(victims)
            out += victims
        rc = self._ref_count
        for b in out:
            rc[b] = 1
        return out

    def free(self, block_ids: Iterable[BlockId]) -> None:
        """Drop one reference from each block, in eviction order: first given, first evicted."""
        rc, hash_of, uncached = self._ref_count, self._hash_of, self._uncached
        cached: list[BlockId] = []
        keep = cached.append
        for b in block_ids:
            n = rc[b] - 1
            rc[b] = n
            if n:
                assert n > 0, f"block {b} freed more often than taken"
            elif hash_of[b] is None:
                uncached[b] = None
                uncached.move_to_end(b, last=False)
            else:
                keep(b)
        if cached:
            self._evictable.push(cached, hash_of)

    def insert(self, block_id: BlockId, block_hash: BlockHash) -> bool:
        """Publish a computed, full, in-use block under its hash. False if that hash is already
        held by another block (two requests computed the same block at once): this block then
        stays private and goes to the head of the free list when freed."""
        assert self._ref_count[block_id] > 0, "only an in-use block can be published"
        assert self._hash_of[block_id] is None, f"block {block_id} already cached"
        if block_hash in self._block_of:
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        if self.tombstones is not None:
            self.tombstones.revive((block_hash,))
        return True

    def insert_many(self, block_ids: Sequence[BlockId], hashes: Sequence[BlockHash]) -> None:
        """insert() for each pair, in order (the results are not needed)."""
        rc, hash_of, block_of = self._ref_count, self._hash_of, self._block_of
        for b, h in zip(block_ids, hashes):
            assert rc[b] > 0 and hash_of[b] is None, f"block {b}: not in use or already cached"
            if h not in block_of:
                block_of[h] = b
                hash_of[b] = h
        if self.tombstones is not None:
            self.tombstones.revive(hashes)

    def stats(self) -> PoolStats:
        return PoolStats(
            num_blocks=self.num_blocks,
            num_used=self.num_blocks - self.num_free_blocks,
            num_cached=len(self._block_of),
            num_free=self.num_free_blocks,
            num_evictions=self.num_evictions,
        )

    def check(self) -> None:
        """Assert every invariant in the module docstring."""
        free = self._free
        assert len(set(free)) == len(free) == self.num_free_blocks, "a block is free twice"
        free_set = set(free)
        for b in range(self.num_blocks):
            in_free = BlockId(b) in free_set
            assert self._ref_count[b] >= 0
            assert in_free == (self._ref_count[b] == 0), f"block {b}: ref/free-list mismatch"
            h = self._hash_of[b]
            if h is not None:
                assert self._block_of.get(h) == b, f"block {b}: hash not indexed"
        assert len(self._block_of) == sum(h is not None for h in self._hash_of)
        seen_cached = False
        for b in free:  # uncached free blocks all precede cached ones
            if self._hash_of[b] is not None:
                seen_cached = True
            else:
                assert not seen_cached, f"uncached free block {b} behind a cached one"
