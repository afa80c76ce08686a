"""No wedge, no livelock: the real Scheduler and BlockPool under random pools, prompts, budgets,
arrivals and aborts (hypothesis), with the prefix cache on and off.

The bounds checked come from the workload alone, not from the scheduler:
- alone, a request finishes within ceil(prompt / chunk) + max_tokens steps (chunk = the step's
  token budget, max_tokens capped by the context);
- in a mix, every request finishes within the sum of the solo step counts of the requests
  that arrived before it, plus its own (so within the sum over all requests);
- no request is ever preempted for a later arrival;
- a request is accepted exactly when its longest sequence fits the pool alone;
- pool.check() holds after every step and every block is free at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentserve.config import SchedulerConfig
from agentserve.engine.request import FinishReason, Request, RequestId, SamplingParams
from agentserve.engine.scheduler import Scheduler
from agentserve.kv.block_pool import BlockPool
from agentserve.kv.hashing import ExtraKeys

KEYS = ExtraKeys("prop", None)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Arrival:
    step: int
    prefix: int  # which shared prefix (agents resend transcripts)
    prompt_len: int
    max_tokens: int
    abort_after: int | None  # steps after arrival, or never


@dataclass(frozen=True)
class Setup:
    block_size: int
    num_blocks: int
    max_model_len: int
    budget: int
    max_num_seqs: int
    caching: bool
    lookahead: int
    arrivals: tuple[Arrival, ...]
    join_rows: int = 0
    join_short: int = 16


@st.composite
def setups(draw: st.DrawFn, max_requests: int = 8) -> Setup:
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(2, 48))
    # up to twice what the pool holds: requests that could outgrow it must be refused at add
    max_model_len = draw(st.integers(2, 2 * num_blocks * bs))
    arrivals = draw(st.lists(st.builds(
        Arrival, step=st.integers(0, 30), prefix=st.integers(0, 2),
        prompt_len=st.integers(1, max(1, max_model_len - 1)), max_tokens=st.integers(1, 24),
        abort_after=st.none() | st.integers(0, 20)), min_size=1, max_size=max_requests))
    return Setup(bs, num_blocks, max_model_len, draw(st.integers(1, 40)), draw(st.integers(1, 6)),
                 draw(st.booleans()), draw(st.sampled_from([0, 2])),
                 tuple(sorted(arrivals, key=lambda a: a.step)),
                 draw(st.sampled_from([0, 1, 2])), draw(st.sampled_from([0, 4, 16])))


def prompt(a: Arrival, index: int) -> list[int]:
    """Prompts share a prefix per `a.prefix` and differ after a per-request point."""
    shared = [100 + a.prefix * 7 + i % 5 for i in range(a.prompt_len)]
    cut = a.prompt_len * 2 // 3
    return shared[:cut] + [1000 + index * 31 + i for i in range(a.prompt_len - cut)]


def solo_steps(a: Arrival, s: Setup) -> int:
    generated = min(a.max_tokens, s.max_model_len - a.prompt_len)
    return _cdiv(a.prompt_len, s.budget) + generated


def fits_alone(a: Arrival, s: Setup) -> bool:
    if a.prompt_len >= s.max_model_len:
        return False
    longest = min(a.prompt_len + a.max_tokens, s.max_model_len)
    return _cdiv(longest - 1, s.block_size) <= s.num_blocks


@dataclass
class Run:
    arrived: dict[RequestId, int]  # request -> step it arrived
    finished: dict[RequestId, tuple[int, FinishReason]]  # request -> step it finished, why
    order: list[RequestId]  # accepted requests in arrival order
    preempted_by_later: int


def simulate(s: Setup) -> Run:
    cfg = SchedulerConfig(max_model_len=s.max_model_len, block_size=s.block_size,
                          max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.budget,
                          enable_prefix_caching=s.caching, admission_lookahead=s.lookahead,
                          join_rows=s.join_rows, join_short=s.join_short)
    pool = BlockPool(s.num_blocks, s.block_size)
    sch = Scheduler(cfg, pool)
    run = Run({}, {}, [], 0)
    aborts: dict[int, list[RequestId]] = {}
    pending = list(enumerate(s.arrivals))
    limit = sum(solo_steps(a, s) for a in s.arrivals) + max(a.step for a in s.arrivals) + 2
    step = 0
    while pending or sch.has_unfinished():
        assert step <= limit, f"not finished after {step} steps"
        while pending and pending[0][1].step <= step:
            i, a = pending.pop(0)
            rid = RequestId(f"r{i}")
            r = Request(rid, prompt(a, i), a.prompt_len, SamplingParams(max_tokens=a.max_tokens), KEYS, float(step))
            try:
                sch.add(r)
            except ValueError:
                assert not fits_alone(a, s), "a request that fits the pool alone was refused"
                continue
            assert fits_alone(a, s), "a request that cannot fit the pool alone was accepted"
            run.arrived[rid] = step
            run.order.append(rid)
            if a.abort_after is not None:
                aborts.setdefault(step + a.abort_after, []).append(rid)
        for rid in aborts.pop(step, []):
            if sch.finish(rid, FinishReason.ABORT) is not None:
                run.finished[rid] = (step, FinishReason.ABORT)
        pool.check()
        if sch.has_unfinished():
            _step(sch, run, step)
        pool.check()
        step += 1
    assert pool.stats().num_used == 0
    return run


def _step(sch: Scheduler, run: Run, step: int) -> None:
    batch = sch.schedule(float(step))
    assert batch.chunks, "requests are waiting but nothing was scheduled (a wedge)"
    rank = {rid: i for i, rid in enumerate(run.order)}
    run.preempted_by_later += sum(rank[p.by] > rank[p.request_id] for p in batch.preemptions)
    sampled = {c.request_id: 7 for c in batch.chunks if c.sample}  # never an end-of-sequence
    for out in sch.update(batch, sampled, float(step)):
        if out.finished:
            run.finished[out.request_id] = (step, out.finish_reason)


def check_bounds(s: Setup, run: Run) -> None:
    assert run.preempted_by_later == 0
    by_id = {RequestId(f"r{i}"): a for i, a in enumerate(s.arrivals)}
    total = 0
    for rid in run.order:  # arrival order
        a = by_id[rid]
        total += solo_steps(a, s)
        end, reason = run.finished[rid]
        if reason is FinishReason.ABORT:
            continue
        assert reason is FinishReason.LENGTH
        assert end - run.arrived[rid] + 1 <= total, (rid, end, run.arrived[rid], total)


PROFILE = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROFILE
@given(setups(max_requests=1))
def test_a_request_alone_finishes_within_its_solo_step_count(s: Setup) -> None:
    run = simulate(s)
    for rid in run.order:
        end, reason = run.finished[rid]
        if reason is not FinishReason.ABORT:
            assert end - run.arrived[rid] + 1 <= solo_steps(s.arrivals[0], s)


@PROFILE
@given(setups())
def test_every_request_finishes_within_the_solo_counts_before_it(s: Setup) -> None:
    check_bounds(s, simulate(s))


def test_with_lookahead_a_large_waiting_request_lets_smaller_ones_pass() -> None:
    cfg = SchedulerConfig(max_model_len=64, block_size=4, max_num_batched_tokens=64, admission_lookahead=1)
    pool = BlockPool(16, 4)  # 64 tokens
    sch = Scheduler(cfg, pool)

    def add(rid: str, n: int, m: int) -> Request:
        r = Request(RequestId(rid), [5 + len(rid)] * n, n, SamplingParams(max_tokens=m), KEYS, 0.0)
        sch.add(r)
        return r

    a = add("a", 30, 20)  # holds 8 blocks now, up to 13
    sch.update(sch.schedule(0.0), {RequestId("a"): 7}, 0.0)
    big = add("big", 40, 2)  # needs 10 blocks: waits for a
    small = add("s", 8, 2)  # fits beside a: admitted past big
    batch = sch.schedule(1.0)
    assert {c.request_id for c in batch.chunks} == {a.request_id, small.request_id}
    assert big in sch.waiting


def test_the_earliest_request_preempts_later_ones_it_waited_behind() -> None:
    """big arrived before small but waited (small fit beside a, big did not); once a finishes,
    big is the earliest and runs at once, taking small's blocks, instead of waiting for it."""
    cfg = SchedulerConfig(max_model_len=56, block_size=4, max_num_batched_tokens=64, admission_lookahead=1)
    sch = Scheduler(cfg, BlockPool(14, 4))
    reqs = {rid: Request(RequestId(rid), [tok] * n, n, SamplingParams(max_tokens=m), KEYS, 0.0)
            for rid, tok, n, m in (("a", 1, 28, 3), ("big", 2, 40, 2), ("small", 3, 16, 24))}
    for r in reqs.values():
        sch.add(r)
    finished: dict[str, int] = {}
    step = 0
    while sch.has_unfinished():
        batch = sch.schedule(float(step))
        for out in sch.update(batch, {c.request_id: 7 for c in batch.chunks if c.sample}, float(step)):
            if out.finished:
                finished[out.request_id] = step
        sch.pool.check()
        step += 1
    assert finished["a"] == 2 and finished["big"] == 4  # big: 1 prefill step + 1 decode after a
    assert reqs["small"].num_preemptions == 1 and finished["small"] > finished["big"]
