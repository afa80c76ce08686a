"""Agent-aware eviction through the real BlockPool: tiers, tail first, shared blocks, returning,
finished and expired trajectories, the budget, and allocation never failing while blocks are
free (a hypothesis run against a naive count of the pool)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.kv.block_pool import BlockPool
from agentserve.trajectory.estimator import Prior, ReturnEstimator
from agentserve.trajectory.registry import State, TrajectoryKey
from agentserve.trajectory.residency import AgentEviction, Residency, ResidencyConfig


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def key(name: str) -> TrajectoryKey:
    return TrajectoryKey("tenant", name)


def setup(num_blocks: int = 16, **cfg):
    clock = Clock()
    estimator = ReturnEstimator(prior=Prior(median_s=10.0, sigma=1.0, never=0.0, weight=4.0))
    res = Residency(num_blocks, clock, ResidencyConfig(**cfg), estimator=estimator)
    ev = AgentEviction(res)
    return clock, res, ev, BlockPool(num_blocks, 1, ev)


def run_turn(pool: BlockPool, res: Residency, name: str, hashes: list[int], cls: str | None = "tool",
             state: State = State.PAUSED_TOOL) -> list[int]:
    """A request of `name` computes `hashes` (one block each), publishes them, responds, frees."""
    res.on_request(key(name))
    hit = pool.match_prefix(hashes)
    pool.lock(hit)
    blocks = hit + pool.allocate(len(hashes) - len(hit))
    for b, h in zip(blocks[len(hit):], hashes[len(hit):]):
        pool.insert(b, h)
    res.on_response(key(name), hashes, state, cls)
    pool.free(list(reversed(blocks)))
    pool.check()
    return blocks


def cached(pool: BlockPool, hashes: list[int]) -> list[int]:
    return [h for h in hashes if pool.match_prefix([h]) or False]


def test_unheld_blocks_go_first_then_paused_trajectories_tail_first():
    clock, res, ev, pool = setup(8)
    run_turn(pool, res, "a", [1, 2, 3])  # paused on a tool: protected
    res.on_request(key("x"))
    blocks = pool.allocate(2)
    for b, h in zip(blocks, [90, 91]):
        pool.insert(b, h)
    pool.free(blocks)  # cached, but no trajectory holds them
    clock.t = 1.0
    taken = pool.allocate(3 + 2)  # 3 uncached free blocks, then the 2 unheld cached ones
    assert not pool.match_prefix([90]) and not pool.match_prefix([91])
    assert len(pool.match_prefix([1, 2, 3])) == 3
    pool.allocate(1)  # now a's tail goes first: a prefix of it stays useful
    assert len(pool.match_prefix([1, 2, 3])) == 2
    pool.free(taken)
    pool.check()


def test_lower_value_trajectory_is_evicted_first_and_a_shared_block_goes_with_its_best_holder():
    clock, res, ev, pool = setup(8)
    for _ in range(20):  # "fast" returns in ~1 s, "slow" in ~1000 s
        res.estimator.observe_return("fast", 1.0)
        res.estimator.observe_return("slow", 1000.0)
    run_turn(pool, res, "slow", [1, 2, 3], "slow")
    run_turn(pool, res, "fast", [1, 5, 6], "fast")  # shares block 1 with "slow"
    clock.t = 0.5
    pool.allocate(3 + 2)  # 3 never-used blocks, then "slow"'s tail [3, 2]; 1 is fast's too
    assert pool.match_prefix([1, 2, 3]) == pool.match_prefix([1])
    assert len(pool.match_prefix([1, 5, 6])) == 3
    pool.allocate(2)  # fast's tail [6, 5] before its shared head
    assert len(pool.match_prefix([1, 5, 6])) == 1
    pool.check()


def test_returning_request_keeps_its_blocks_until_taken_and_finished_releases_at_once():
    clock, res, ev, pool = setup(6)
    run_turn(pool, res, "a", [1, 2])
    run_turn(pool, res, "b", [3, 4])
    clock.t = 5.0
    res.on_request(key("a"))  # a returned (queued): full value, its blocks stay
    assert res.estimator._get("tool").num_returns == 1
    res.on_end(key("b"), State.FINISHED)  # b done: its blocks are plain LRU now
    pool.allocate(2 + 2)
    assert not pool.match_prefix([3]) and len(pool.match_prefix([1, 2])) == 2
    pool.check()


def test_expired_protection_is_released_and_counted_as_censored():
    clock, res, ev, pool = setup(6, max_idle_s=60.0)
    run_turn(pool, res, "a", [1, 2])
    run_turn(pool, res, "b", [3, 4])
    clock.t = 30.0
    run_turn(pool, res, "b", [3, 4, 5])
    clock.t = 70.0
    res.expire()  # a waited 70 s > 60 s; b 40 s
    assert key("a") not in res.protected and key("b") in res.protected
    assert res.estimator._get("tool").num_censored == 1
    pool.allocate(1 + 2)  # the free block, then a's two
    assert not pool.match_prefix([1]) and len(pool.match_prefix([3, 4, 5])) == 3


def test_budget_caps_what_idle_trajectories_protect():
    clock, res, ev, pool = setup(10, budget=0.5)
    for i in range(5):
        run_turn(pool, res, f"t{i}", [10 * i + 1, 10 * i + 2])
    assert sum(len(t.hashes) for t in res.protected.values()) <= 5
    assert len(ev._lru) >= 4  # those over budget went back to plain LRU


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.sampled_from(["tool", "human", "end", "gap"])),
                min_size=1, max_size=40))
def test_allocation_never_fails_while_free_blocks_exist(ops):
    """Random trajectories pause, return, finish and wait; the pool's own invariants hold, and
    an allocation of at most the free count always succeeds."""
    clock, res, ev, pool = setup(12, budget=0.9)
    for who, n, what in ops:
        clock.t += 3.0
        if what == "gap":
            clock.t += 500.0
            res.expire()
            continue
        if what == "end":
            res.on_end(key(f"t{who}"), State.FINISHED)
            continue
        hashes = [100 * who + i for i in range(n)]
        state = State.PAUSED_TOOL if what == "tool" else State.WAITING_HUMAN
        free = pool.num_free_blocks
        res.on_request(key(f"t{who}"))
        hit = pool.match_prefix(hashes)
        if len(hashes) - len(hit) > free:
            continue
        pool.lock(hit)
        blocks = hit + pool.allocate(len(hashes) - len(hit))
        for b, h in zip(blocks[len(hit):], hashes[len(hit):]):
            pool.insert(b, h)
        res.on_response(key(f"t{who}"), hashes, state, what)
        pool.free(blocks)
        pool.check()
        assert len(ev) == pool.num_free_blocks - len(pool._uncached)
        assert pool.num_free_blocks == pool.num_blocks
        assert len(pool.allocate(pool.num_free_blocks)) == pool.num_blocks
        pool.free(list(range(pool.num_blocks)))
        pool.check()
