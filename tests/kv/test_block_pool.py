"""Block pool: exact ids and eviction order, and random operation sequences against a naive model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.kv.block_pool import BlockId, BlockPool
from agentserve.kv.hashing import BlockHash, ExtraKeys, extend_block_hashes, hash_block


def H(i: int) -> BlockHash:
    return BlockHash(1000 + i)


def test_allocate_takes_lowest_ids_first():
    pool = BlockPool(4, 16)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) == [2, 3]
    with pytest.raises(MemoryError, match="asked for 1 KV blocks, 0 free"):
        pool.allocate(1)
    pool.check()


def test_eviction_order_is_lru_and_uncached_blocks_go_first():
    pool = BlockPool(6, 16)
    a = pool.allocate(3)  # [0, 1, 2]
    b = pool.allocate(2)  # [3, 4]
    for i, blk in enumerate(a):
        pool.insert(blk, H(i))
    pool.insert(b[0], H(10))  # b[1] stays a private partial block
    pool.free(reversed(a))  # a's tail is evicted first, its prefix last
    pool.free(reversed(b))
    pool.check()
    assert list(pool._free) == [4, 5, 2, 1, 0, 3]  # uncached at the head, then LRU
    assert pool.allocate(2) == [4, 5]
    assert pool.stats().num_evictions == 0
    assert pool.allocate(3) == [2, 1, 0]
    assert pool.stats().num_evictions == 3
    assert pool.match_prefix([H(0)]) == []
    assert pool.match_prefix([H(10)]) == [3]
    pool.check()


def test_match_prefix_stops_at_first_miss_and_lock_revives_free_blocks():
    pool = BlockPool(4, 16)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        pool.insert(blk, H(i))
    pool.free(reversed(blocks))
    assert pool.num_free_blocks == 4
    assert pool.match_prefix([H(0), H(1), H(5), H(2)]) == [0, 1]
    pool.lock([BlockId(0), BlockId(1)])
    assert pool.num_free_blocks == 2
    assert pool.ref_count(BlockId(0)) == 1
    pool.lock([BlockId(0)])
    assert pool.ref_count(BlockId(0)) == 2
    pool.check()


def test_duplicate_hash_is_not_published_twice():
    pool = BlockPool(2, 16)
    x, y = pool.allocate(2)
    assert pool.insert(x, H(0))
    assert not pool.insert(y, H(0))
    assert pool.block_hash(y) is None
    assert pool.match_prefix([H(0)]) == [x]
    pool.check()


def test_hash_chain_depends_on_parent_tokens_and_extra_keys():
    m = ExtraKeys("model-a")
    assert hash_block(None, [1, 2], m) == hash_block(None, [1, 2], ExtraKeys("model-a"))
    assert hash_block(None, [1, 2], m) != hash_block(None, [1, 3], m)
    assert hash_block(None, [1, 2], m) != hash_block(None, [1, 2], ExtraKeys("model-b"))
    assert hash_block(None, [1, 2], m) != hash_block(None, [1, 2], ExtraKeys("model-a", "tenant"))
    p1, p2 = hash_block(None, [1, 2], m), hash_block(None, [9, 9], m)
    assert hash_block(p1, [3, 4], m) != hash_block(p2, [3, 4], m)
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5], 2, m)
    assert hashes == [p1, hash_block(p1, [3, 4], m)]  # the partial block [5] is not hashed


class NaivePool:
    """Reference: lists and linear scans, eviction order spelled out directly."""

    def __init__(self, n: int) -> None:
        self.ref = [0] * n
        self.hash: list[int | None] = [None] * n
        self.order = list(range(n))  # free blocks, eviction order

    def allocate(self, k: int) -> list[int]:
        assert k <= len(self.order)
        out = self.order[:k]
        self.order = self.order[k:]
        for b in out:
            self.ref[b] = 1
            self.hash[b] = None
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] is None:
                    self.order.insert(0, b)
                else:
                    self.order.append(b)

    def lock(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.order.remove(b)
            self.ref[b] += 1

    def insert(self, b: int, h: int) -> bool:
        if h in self.hash:
            return False
        self.hash[b] = h
        return True

    def match(self, hashes: list[int]) -> list[int]:
        out = []
        for h in hashes:
            if h not in self.hash:
                break
            out.append(self.hash.index(h))
        return out


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "insert", "match_lock"]), st.integers(0, 7),
              st.integers(0, 5)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_operations_match_naive_model(operations):
    n = 8
    pool, ref = BlockPool(n, 4), NaivePool(n)
    held: list[list[int]] = []  # each entry: blocks one holder references, in order
    for op, a, b in operations:
        if op == "alloc" and a <= pool.num_free_blocks:
            got = pool.allocate(a)
            assert got == ref.allocate(a)
            held.append(list(got))
        elif op == "free" and held:
            blocks = held.pop(a % len(held))
            pool.free(reversed(blocks))
            ref.free(list(reversed(blocks)))
        elif op == "insert" and held:
            blocks = held[a % len(held)]
            blk = blocks[b % len(blocks)] if blocks else None
            if blk is not None and pool.block_hash(blk) is None:
                assert pool.insert(blk, H(b)) == ref.insert(blk, H(b))
        elif op == "match_lock":
            wanted = [H(i) for i in range(a)]
            got = pool.match_prefix(wanted)
            assert got == ref.match(wanted)
            pool.lock(got)
            ref.lock(got)
            held.append(list(got))
        pool.check()
        assert pool.num_free_blocks == len(ref.order)
        assert list(pool._free) == ref.order
