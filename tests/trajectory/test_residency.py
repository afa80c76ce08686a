"""Agent-aware eviction through the real BlockPool: tiers, tail first, shared blocks, returning,
finished and expired trajectories, the budget, and allocation never failing while blocks are
free (a hypothesis run against a naive count of the pool)."""

from __future__ import annotations

import math

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from agentserve.kv.block_pool import BlockPool
from agentserve.trajectory.estimator import Prior, ReturnEstimator
from agentserve.trajectory.registry import State, TrajectoryKey
from agentserve.trajectory.residency import AgentEviction, Residency, ResidencyConfig, _Moment


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
    pool = BlockPool(num_blocks, 1, ev)
    res.attach(pool)  # the walk's evicted-tail marks read the pool's index
    return clock, res, ev, pool


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


def test_past_the_budget_the_least_valuable_protected_blocks_go_before_unprotected_ones():
    clock, res, ev, pool = setup(12, budget=0.5)
    for i in range(5):  # 10 protected free blocks, the budget is 6
        clock.t = float(i)
        run_turn(pool, res, f"t{i}", [10 * i + 1, 10 * i + 2])
    res.on_request(key("x"))
    (b,) = pool.allocate(1)
    pool.insert(b, 99)
    pool.free([b])  # cached, held by nobody
    clock.t = 6.0
    pool.allocate(1 + 4)  # the never-used block, then 4 protected blocks: over the budget
    assert pool.match_prefix([99]) and ev.num_budget_evictions == 4
    assert len(ev._held) == 6
    pool.allocate(1)  # within the budget again: plain LRU first
    assert not pool.match_prefix([99]) and len(ev._held) == 6
    pool.check()


def unprotected_free(pool, res) -> list[int]:
    """By definition: free, cached, and no protected trajectory holds its hash."""
    return [b for b in range(pool.num_blocks) if pool.ref_count(b) == 0 and pool.block_hash(b) is not None
            and pool.block_hash(b) not in res.holders]


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
        assert pool.count_unprotected(range(pool.num_blocks)) == len(unprotected_free(pool, res))
        pool.free(blocks)
        pool.check()
        assert len(ev) == pool.num_free_blocks - len(pool._uncached)
        assert pool.num_free_blocks == pool.num_blocks
        # what protective admission reads: taking the unprotected count evicts no protected
        # block, except those past the budget (which the order takes first)
        protected = [pool.block_hash(b) for b in range(pool.num_blocks)
                     if pool.block_hash(b) is not None and not ev.count_unprotected([b])]  # all free here
        every = list(range(pool.num_blocks))
        assert pool.count_unprotected(every) == len(unprotected_free(pool, res)) \
            == pool.num_blocks - len(pool._uncached) - len(protected)
        taken = pool.allocate(pool.num_unprotected_free_blocks)
        lost = [h for h in protected if h not in pool.index]
        assert len(lost) == max(0, len(protected) - int(0.9 * pool.num_blocks))
        pool.free(taken)
        assert len(pool.allocate(pool.num_free_blocks)) == pool.num_blocks
        pool.free(list(range(pool.num_blocks)))
        pool.check()


# ── advice, receipts, events, identity ─────────────────────────────────────────────────────
def setup_with_tombstones(num_blocks: int = 8, **cfg):
    from agentserve.kv.tombstones import Tombstones

    clock = Clock()
    estimator = ReturnEstimator(prior=Prior(median_s=10.0, sigma=1.0, never=0.0, weight=4.0))
    res = Residency(num_blocks, clock, ResidencyConfig(block_size=1, **cfg), estimator=estimator)
    ev = AgentEviction(res)
    pool = BlockPool(num_blocks, 1, ev, Tombstones(clock))
    res.attach(pool)
    receipts = []
    res.on_receipt = receipts.append
    return clock, res, ev, pool, receipts


def test_a_return_settles_a_receipt_with_costs_in_prefill_seconds():
    from agentserve.trajectory.receipts import CostRates

    clock, res, ev, pool, receipts = setup_with_tombstones(8, rates=CostRates(100.0, 50.0))
    run_turn(pool, res, "a", [1, 2, 3, 4])
    advice = res.registry.get(key("a")).advice
    assert advice.action == "retain" and advice.blocks == 4 and advice.predicted_p50_s is not None
    clock.t = 10.0
    res.on_request(key("x"))
    pool.allocate(4 + 2)  # 4 never-used blocks, then a's tail: [4, 3] evicted at t=10
    clock.t = 20.0
    res.on_request(key("a"))
    (r,) = receipts
    assert (r.outcome, r.gap_s, r.resident_blocks, r.recomputed_tokens) == ("returned", 20.0, 2, 2)
    assert r.first_eviction_after_s == 10.0 and r.evicted_by == "agent-ev-1"
    # held: 2 blocks x 20 s + 2 blocks x 10 s = 60 token-seconds (1 token per block)
    assert r.held_token_s == 60.0
    assert abs(r.cost_s - (2 / 100 + 60 / (100 * 50))) < 1e-12
    assert abs(r.alternative_cost_s - 4 / 100) < 1e-12 and r.regret_s == 0.0
    assert abs(r.log_error - math.log(20.0 / advice.predicted_p50_s)) < 1e-9
    assert 0 < r.cdf_at_gap < 1


def test_leaving_unreturned_is_a_censored_receipt_whose_cost_is_the_memory_held():
    clock, res, ev, pool, receipts = setup_with_tombstones(8)
    run_turn(pool, res, "a", [1, 2])
    clock.t = 30.0
    res.on_end(key("a"), State.FINISHED)
    (r,) = receipts
    assert r.outcome == "finished" and r.recomputed_tokens == 0 and r.log_error is None
    assert r.held_token_s == 60.0 and r.alternative_cost_s == 0.0 and r.regret_s == r.cost_s > 0
    assert res.estimator._get("tool").num_censored == 1
    assert res.registry.get(key("a")).receipts[-1] is r


def test_a_pause_unlikely_to_return_in_time_is_advised_release_and_not_protected():
    clock, res, ev, pool, receipts = setup_with_tombstones(10)
    for _ in range(400):  # "batch" comes back after ~14 h, far past any horizon here
        res.estimator.observe_return("batch", 50_000.0)
    run_turn(pool, res, "a", [1, 2], "batch")
    run_turn(pool, res, "b", [3, 4], "tool")
    a, b = res.registry.get(key("a")), res.registry.get(key("b"))
    assert a.advice.action == "release" and "not protected" in a.advice.reason and key("a") not in res.protected
    assert b.advice.action == "retain" and key("b") in res.protected
    clock.t = 100.0
    res.on_request(key("a"))
    (r,) = receipts
    assert r.advice.action == "release" and r.recomputed_tokens == 0  # nothing needed the room
    assert r.alternative_cost_s == r.cost_s  # release vs hold: the same blocks held all along


def test_events_follow_the_state_and_count_the_rest_as_no_ops():
    from agentserve.trajectory.events import Event, Outcome

    clock, res, ev, pool, receipts = setup_with_tombstones(8)
    with pytest.raises(KeyError):
        res.on_event(key("nobody"), Event.TOOL_STARTED)
    run_turn(pool, res, "a", [1, 2])
    assert res.on_event(key("a"), Event.TOOL_STARTED) is Outcome.DUPLICATE  # inferred already
    clock.t = 2.0
    assert res.on_event(key("a"), Event.TOOL_STARTED, "shell", expected_s=5.0) is Outcome.APPLIED
    t = res.registry.get(key("a"))
    assert t.pause_class == "shell" and t.advice.p_return == 1.0  # expected back within the horizon
    clock.t = 4.0
    assert res.on_event(key("a"), Event.TOOL_FINISHED) is Outcome.APPLIED
    assert res.estimator._get("shell").num_returns == 1 and t.state is State.RUNNING
    assert res.on_event(key("a"), Event.TOOL_FINISHED) is Outcome.DUPLICATE
    assert key("a") in res.protected and res.value(t, 4.0) == 2.0  # full value until its request
    clock.t = 5.0
    res.on_request(key("a"))
    (r,) = receipts
    assert r.outcome == "returned" and r.gap_s == 4.0  # the gap is to tool_finished
    assert res.estimator._get("shell").num_returns == 1  # not observed twice
    assert res.on_event(key("a"), Event.TRAJECTORY_CANCELLED) is Outcome.APPLIED
    assert res.on_event(key("a"), Event.TRAJECTORY_CANCELLED) is Outcome.DUPLICATE
    assert res.on_event(key("a"), Event.TRAJECTORY_FINISHED) is Outcome.OUT_OF_ORDER
    assert res.on_event(key("a"), Event.TOOL_FINISHED) is Outcome.OUT_OF_ORDER


def test_identify_finds_the_paused_trajectory_a_prompt_extends():
    clock, res, ev, pool, receipts = setup_with_tombstones(16)
    res.on_request(key("a"))
    res.on_response(key("a"), [1, 2, 3, 4], State.PAUSED_TOOL, "tool", prompt_blocks=2)
    res.on_request(key("b"))
    res.on_response(key("b"), [1, 7, 8], State.PAUSED_TOOL, "tool", prompt_blocks=3)
    assert res.identify([1, 2, 3, 4, 9]) == key("a")  # extends a's whole sequence
    assert res.identify([1, 2, 5, 6]) == key("a")  # a's prompt, then a re-rendered reply
    assert res.identify([1, 7, 8, 9]) == key("b")
    assert res.identify([1, 5]) is None  # only the shared system block
    res.on_end(key("a"), State.FINISHED)
    assert res.identify([1, 2, 3, 4, 9]) is None  # not paused any more


def test_the_number_of_protected_trajectories_is_bounded():
    clock, res, ev, pool = setup(64, max_protected=3)
    for i in range(6):
        clock.t = float(i)
        run_turn(pool, res, f"t{i}", [10 * i + 1])
        assert len(res.protected) <= 3
    assert sorted(k.id for k in res.protected) == ["t3", "t4", "t5"]  # same class: the oldest lost it
    assert res.registry.get(key("t0")).advice.action == "release"


@pytest.mark.parametrize("decayed", [True, False])
def test_a_pause_whose_p_decays_below_the_threshold_loses_protection_at_a_tick(decayed):
    from agentserve.kv.tombstones import Tombstones

    clock = Clock()
    # half of all pauses never return; the others are back within a minute or so
    estimator = ReturnEstimator(prior=Prior(median_s=10.0, sigma=1.0, never=0.5, weight=4.0))
    res = Residency(6, clock, ResidencyConfig(release_decayed=decayed), estimator=estimator)
    pool = BlockPool(6, 1, AgentEviction(res), Tombstones(clock))
    res.attach(pool)
    run_turn(pool, res, "a", [1, 2])
    assert key("a") in res.protected  # P(return) ~0.5 at the pause
    clock.t = 5.0
    res.expire()
    assert key("a") in res.protected  # still likely back
    clock.t = 600.0  # back by now if ever: P(return | waited 600 s) is ~1e-5
    res.expire()
    assert (key("a") in res.protected) is not decayed
    assert key("a") in res._pauses  # the pause stays open: a return is still settled
    pool.allocate(6)
    if decayed:  # its blocks were exposed by the decay: the eviction says so
        assert pool.tombstones.get(1).cause == "protection_decayed"
    clock.t = 601.0
    res.on_request(key("a"))
    assert res.registry.get(key("a")).receipts[-1].outcome == "returned"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["request", "respond", "event", "tick"]), st.integers(0, 11),
                          st.sampled_from(["tool", "read", "bash", None]), st.sampled_from([None, 5.0, 300.0]),
                          st.floats(0.0, 120.0)), min_size=1, max_size=80))
def test_the_array_order_is_the_order_rank_defines(ops):
    """With enough protected trajectories the eviction order and the decay releases are computed
    over arrays (Residency._p_rows). Fed the same calls, a residency on that path and one on
    the scalar definition (`rank` over `p_keep`, a stable sort in protection order) must agree
    on the order, every rank, and every decision, through pauses of several classes, hints,
    returns (running while protected), ends, expiry and decay."""
    from agentserve.trajectory.events import Event

    sides = []
    for array_rank_min in (0, 10**9):  # the array path always; never
        clock = Clock()
        # half never return: P decays with the wait, so expire ticks release protection
        estimator = ReturnEstimator(prior=Prior(median_s=10.0, sigma=1.0, never=0.5, weight=4.0))
        res = Residency(4096, clock, estimator=estimator)
        AgentEviction(res)
        res.array_rank_min, res.log = array_rank_min, []
        sides.append((clock, res))
    seqs: dict[int, list[int]] = {}
    decays = 0
    for op, who, cls, hint, dt in ops:
        k = key(f"t{who}")
        if op == "respond":
            seq = seqs.setdefault(who, [1000 * who + 1])
            seq.append(seq[-1] * 3 + 1)
        for clock, res in sides:
            clock.t += dt
            if op == "request":
                res.on_request(k)
            elif op == "respond":
                if res.registry.get(k) is None or res.registry.get(k).state is not State.RUNNING:
                    res.on_request(k)
                res.on_response(k, list(seqs[who]), State.PAUSED_TOOL if cls else State.WAITING_HUMAN,
                                cls or "human", hint)
            elif op == "event" and res.registry.get(k) is not None:
                res.on_event(k, [Event.TOOL_FINISHED, Event.TOOL_STARTED, Event.TRAJECTORY_FINISHED][who % 3], cls, hint)
            else:
                res.expire()
        (clock, arrays), (_, scalar) = sides
        now = clock()
        assert arrays.log == scalar.log
        decays = sum(1 for e in arrays.log if e[1] == "decayed")
        want = [t.key for t in scalar.ranked(now)]
        assert [t.key for t in arrays.ranked(now)] == want
        assert [t.key for t in sorted(arrays.protected.values(), key=lambda t: arrays.rank(t, now))] == want
        for (t, got), (_, ref) in zip(arrays.ranks(now), scalar.ranks(now), strict=True):
            assert got == pytest.approx(ref, abs=1e-12)
        # the scalar sorts' fused path (_p_each) is p_keep over one moment, bit for bit
        ts, moment = list(scalar.protected.values()), _Moment()
        assert scalar._p_each(ts, now) == [scalar.p_keep(t, now, moment) for t in ts]
        assert [t.key for t in sorted(ts, key=lambda t: scalar.rank(t, now, _Moment()))] == want
    event("decay releases: " + ("some" if decays else "none"))


# ── the walk against a naive order of the held blocks ───────────────────────────────────────
def naive_victims(ev: AgentEviction, res: Residency, pool: BlockPool, n: int) -> list[int]:
    """What the eviction order must give for n blocks, from its definition alone: unprotected
    free blocks least recently freed first; then every free block some protected trajectory
    holds, ordered by its most valuable holder's place in the full order (lowest first) and,
    within that holder, tail first. No marks, no windows."""
    lru = list(ev._lru)[:n]
    order = res.ranked(res.clock())
    held = [b for b in range(pool.num_blocks)
            if pool.ref_count(b) == 0 and pool.block_hash(b) in res.holders]
    assert sorted(held) == sorted(ev._held), "held = the free blocks a protected trajectory holds"
    keyed = []
    for b in held:
        h = pool.block_hash(b)
        pos, top = max((i, t) for i, t in enumerate(order) if h in t.hashes)
        keyed.append(((pos, -top.hashes.index(h)), b))
    return lru + [b for _, b in sorted(keyed)][: n - len(lru)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["turn", "turn", "start", "finish", "end", "tick", "take", "preempted"]),
                          st.integers(0, 3), st.integers(0, 1), st.integers(1, 6),
                          st.sampled_from(["fast", "slow", "human"]), st.sampled_from([0.0, 1.5])),
                min_size=10, max_size=70))
def test_the_walk_evicts_in_the_order_its_definition_gives(ops):
    """The walk's shortcuts (tail and head marks, windows of lookups) must not change a victim. Random
    trajectories share prefixes by group, pause, run concurrently (their blocks in use under
    others' protection), finish, end and expire, and preempted requests free blocks with no
    lifecycle call, in a pool small enough to evict often; every pop is checked against
    `naive_victims` taken just before it."""
    clock, res, ev, pool = setup(10, budget=1.0)
    for _ in range(10):
        res.estimator.observe_return("fast", 2.0)
        res.estimator.observe_return("slow", 400.0)
    checked = [0]
    pop = ev.pop

    def checked_pop(n: int) -> list[int]:
        held_before = len(ev._lru) < n
        want = naive_victims(ev, res, pool, n)
        got = pop(n)
        assert got == want
        checked[0] += held_before  # pops that reached protected blocks
        return got

    ev.pop = checked_pop  # type: ignore[method-assign]
    running: dict[str, tuple[list[int], list[int]]] = {}  # name -> (hashes, blocks) in use
    lengths: dict[str, int] = {}
    for op, who, group, n, cls, dt in ops:
        name = f"t{who}"
        clock.t += dt  # 0: several calls at one moment (the order is not sorted again by time)
        if op == "tick":
            clock.t += 50.0
            res.expire()
        elif op == "end":
            res.on_end(key(name), State.FINISHED)
        elif op == "take":  # an anonymous allocation that evicts
            want = min(n, pool.num_free_blocks)
            if want:
                pool.free(pool.allocate(want))
        elif op == "preempted":  # computes part of a group's head, freed with no response
            hashes = [10_000 * group + i for i in range(n)]
            hit = pool.match_prefix(hashes)
            if len(hashes) - len(hit) <= pool.num_free_blocks - pool.count_free(hit):
                pool.lock(hit)
                blocks = hit + pool.allocate(len(hashes) - len(hit))
                pool.insert_many(blocks[len(hit):], hashes[len(hit):])
                pool.free(list(reversed(blocks)))
        elif op in ("turn", "start") and name not in running:
            length = lengths.get(name, 0) + n  # each turn extends its sequence
            # the group's shared head (so others compute again what a mark skips, or hold it
            # in use under another's protection), then the trajectory's own blocks
            hashes = [10_000 * group + i for i in range(min(length, 8))] + \
                [100 * (who + 1) + i for i in range(max(0, length - 8))]
            res.on_request(key(name))
            hit = pool.match_prefix(hashes)
            if len(hashes) - len(hit) > pool.num_free_blocks - pool.count_free(hit):
                continue
            pool.lock(hit)
            blocks = hit + pool.allocate(len(hashes) - len(hit))
            pool.insert_many(blocks[len(hit):], hashes[len(hit):])
            lengths[name] = length
            running[name] = (hashes, blocks)
            if op == "turn":
                op = "finish"
        if op == "finish" and name in running:
            hashes, blocks = running.pop(name)
            state = State.WAITING_HUMAN if cls == "human" else State.PAUSED_TOOL
            res.on_response(key(name), hashes, state, cls)
            pool.free(list(reversed(blocks)))
        pool.check()
    event("pops of protected blocks: " + ("10+" if checked[0] >= 10 else "1-9" if checked[0] else "0"))
    event("marks used: " + ("yes" if ev._heads or ev._gone else "no"))


