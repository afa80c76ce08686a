"""The pool's tombstones: evicted hashes remembered (time, cause, policy), bounded, cleared when
a hash is published again."""

from __future__ import annotations

from agentserve.kv.block_pool import BlockPool
from agentserve.kv.tombstones import Tombstones


def test_evictions_leave_tombstones_that_a_republish_clears_and_the_bound_holds():
    now = [0.0]
    stones = Tombstones(lambda: now[0], capacity=3)
    pool = BlockPool(2, 1, tombstones=stones)
    for t, h in enumerate([11, 12, 13, 14, 15]):
        now[0] = float(t)
        (b,) = pool.allocate(1)  # takes the never-used block, then evicts the oldest cached one
        pool.insert(b, h)
        pool.free([b])
    # 11, 12, 13 were evicted at t = 2, 3, 4; the bound keeps the newest 3
    assert [stones.get(h) is not None for h in (11, 12, 13)] == [True, True, True]
    assert stones.get(11).time_s == 2.0 and stones.get(11).policy == "lru" and stones.get(11).cause == "capacity"
    assert stones.get(14) is None and stones.get(15) is None  # resident
    now[0] = 9.0
    (b,) = pool.allocate(1)  # evicts 14: the bound drops 11
    assert stones.get(11) is None and stones.get(14).time_s == 9.0 and len(stones) == 3
    pool.insert(b, 12)  # 12 computed again: resident, no tombstone
    assert stones.get(12) is None
    pool.free([b])
    pool.check()
