"""Scheduler and engine with a fake runner: budgets, chunking, reuse, preemption, bad input."""

from __future__ import annotations

import random

import pytest

from agentserve.config import SchedulerConfig
from agentserve.engine.engine import Engine, RunResult
from agentserve.engine.request import FinishReason, Request, RequestId, SamplingParams
from agentserve.engine.scheduler import Batch, Scheduler
from agentserve.kv.block_pool import BlockPool, LruEviction
from agentserve.kv.hashing import ExtraKeys


class FakeRunner:
    """Samples (last token + 1) % vocab; records every batch."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []

    def run(self, batch: Batch) -> RunResult:
        self.batches.append(batch)
        return RunResult({c.request_id: (c.token_ids[-1] + 1) % 1000 for c in batch.chunks if c.sample})


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, caching=True, eos=(999,), join_rows=0):
    runner = FakeRunner()
    cfg = SchedulerConfig(max_model_len=200, block_size=block_size, max_num_seqs=max_seqs,
                          max_num_batched_tokens=budget, enable_prefix_caching=caching,
                          eos_token_ids=eos, join_rows=join_rows)
    clock = iter(range(10**6)).__next__
    engine = Engine(Scheduler(cfg, BlockPool(num_blocks, block_size)), runner, "fake", 1000,
                    clock=lambda: float(clock()))
    return engine, runner


def drain(engine):
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        engine.scheduler.pool.check()
    return outs


def test_chunked_prefill_respects_budget_and_mixes_with_decode():
    engine, runner = make(budget=8)
    a = engine.add(list(range(6)), SamplingParams(max_tokens=4))
    engine.step()  # a: 6 prompt tokens, samples
    b = engine.add(list(range(100, 120)), SamplingParams(max_tokens=2))
    drain(engine)
    for batch in runner.batches:
        assert batch.num_tokens <= 8
    second = runner.batches[1]
    assert [(c.request_id, len(c.token_ids)) for c in second.chunks] == [(a, 1), (b, 7)]
    assert not second.chunks[1].sample  # a prefill chunk that does not reach the end


def test_agent_turn_reuses_full_blocks_of_previous_prompt_and_reply():
    engine, _ = make(block_size=4)
    prompt = list(range(10))
    engine.add(prompt, SamplingParams(max_tokens=5))
    out = drain(engine)
    (rid, outs), = out.items()
    reply = [t for o in outs for t in o.new_token_ids]
    assert reply == [10, 11, 12, 13, 14]
    # computed KV: prompt + reply[:-1] = 14 tokens -> 3 full blocks (12 tokens)
    nxt = prompt + reply + [500, 501, 502]
    engine.add(nxt, SamplingParams(max_tokens=1))
    (outs2,) = drain(engine).values()
    assert outs2[-1].num_reused_tokens == 12
    assert outs2[-1].num_prefilled_tokens == len(nxt) - 12


def test_fully_cached_prompt_still_computes_last_token():
    engine, _ = make(block_size=4)
    engine.add(list(range(8)), SamplingParams(max_tokens=1))
    drain(engine)
    engine.add(list(range(9)), SamplingParams(max_tokens=1))  # blocks [0..3], [4..7] cached
    (o,) = drain(engine).values()
    assert o[-1].num_reused_tokens == 8
    engine.add(list(range(8)), SamplingParams(max_tokens=1))  # 8 tokens: only 1 block reusable
    (o,) = drain(engine).values()
    assert o[-1].num_reused_tokens == 4


def test_no_reuse_without_prefix_caching_or_across_salts():
    engine, _ = make(caching=False)
    engine.add(list(range(12)), SamplingParams(max_tokens=1))
    drain(engine)
    engine.add(list(range(13)), SamplingParams(max_tokens=1))
    assert list(drain(engine).values())[0][-1].num_reused_tokens == 0
    engine, _ = make()
    engine.add(list(range(12)), SamplingParams(max_tokens=1), cache_salt="tenant-a")
    drain(engine)
    engine.add(list(range(13)), SamplingParams(max_tokens=1), cache_salt="tenant-b")
    assert list(drain(engine).values())[0][-1].num_reused_tokens == 0


def test_preemption_frees_last_admitted_and_recomputes():
    engine, runner = make(num_blocks=6, block_size=4, budget=64)
    a = engine.add(list(range(8)), SamplingParams(max_tokens=8, ignore_eos=True))
    b = engine.add(list(range(200, 208)), SamplingParams(max_tokens=8, ignore_eos=True))
    out = drain(engine)
    assert sum(len(o.new_token_ids) for o in out[a]) == 8
    assert sum(len(o.new_token_ids) for o in out[b]) == 8
    assert any(b in batch.preempted for batch in runner.batches)
    assert not any(a in batch.preempted for batch in runner.batches)
    assert out[b][-1].num_recomputed_tokens > 0


def test_stop_conditions():
    engine, _ = make(eos=(5,))
    a = engine.add([1, 2], SamplingParams(max_tokens=10))  # 3, 4, 5=eos
    b = engine.add([1, 2], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(7,)))
    c = engine.add([1, 2], SamplingParams(max_tokens=2))
    out = drain(engine)
    assert [o.new_token_ids[0] for o in out[a]] == [3, 4, 5]
    assert out[a][-1].finish_reason is FinishReason.STOP
    assert [o.new_token_ids[0] for o in out[b]] == [3, 4, 5, 6, 7]
    assert out[c][-1].finish_reason is FinishReason.LENGTH


def test_min_tokens_suppresses_eos_in_the_sampler():
    engine, runner = make(eos=(5,))
    engine.add([1, 2], SamplingParams(max_tokens=10, min_tokens=4))
    engine.step()
    assert runner.batches[0].chunks[0].suppressed_token_ids == (5,)


def test_abort_frees_blocks_and_others_continue():
    engine, _ = make()
    a = engine.add(list(range(20)), SamplingParams(max_tokens=50, ignore_eos=True))
    b = engine.add(list(range(30, 40)), SamplingParams(max_tokens=3))
    engine.step()
    used = engine.scheduler.pool.stats().num_used
    out = engine.abort(a)
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert engine.scheduler.pool.stats().num_used < used
    assert engine.abort(a) is None
    rest = drain(engine)
    assert rest[b][-1].finished and a not in rest


@pytest.mark.parametrize(
    "tokens, params, message",
    [
        ([], SamplingParams(), "prompt is empty"),
        (list(range(200)), SamplingParams(), "prompt has 200 tokens; the model's context is 200"),
        ([1, 1000], SamplingParams(), r"token ids out of range \[0, 1000\): \[1000\]"),
        ([1, -3], SamplingParams(), r"out of range"),
    ],
)
def test_bad_input_is_rejected_and_engine_keeps_serving(tokens, params, message):
    engine, _ = make()
    good = engine.add([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=message):
        engine.add(tokens, params)
    out = drain(engine)
    assert list(out) == [good] and out[good][-1].finished


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    for t in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=t)


def test_request_whose_longest_sequence_exceeds_the_pool_is_rejected():
    engine, _ = make(num_blocks=2, block_size=4)
    # 8 prompt + 16 generated - 1 (the last token's KV is never computed) = 23 tokens: 6 blocks
    with pytest.raises(ValueError, match="needs up to 6 KV blocks .24 tokens.; the pool has 2"):
        engine.add(list(range(8)), SamplingParams())
    engine.add(list(range(5)), SamplingParams(max_tokens=4))  # 8 tokens: exactly 2 blocks
    assert drain(engine)


def test_request_waits_for_a_prefix_being_computed_instead_of_computing_it_twice():
    engine, runner = make(block_size=4, budget=64)
    shared = list(range(12))
    a = engine.add(shared + [100, 101], SamplingParams(max_tokens=2))
    b = engine.add(shared + [200, 201], SamplingParams(max_tokens=2))
    c = engine.add([300, 301, 302], SamplingParams(max_tokens=2))  # shares nothing: not held
    out = drain(engine)
    first = runner.batches[0]
    assert [ch.request_id for ch in first.chunks] == [a, c]
    assert out[b][-1].num_reused_tokens == 12
    assert out[a][-1].num_reused_tokens == 0


class ProtectingEviction(LruEviction):
    """LRU order, except that blocks holding a hash in `keep` go last: a naive stand-in for a
    residency policy's protection."""

    def __init__(self) -> None:
        super().__init__()
        self.keep: set[int] = set()
        self.hash_of: list = []

    def push(self, block_ids, hash_of) -> None:
        self.hash_of = hash_of
        super().push(block_ids, hash_of)

    def protects(self, block_id) -> bool:
        return self.hash_of[block_id] in self.keep

    def count_unprotected(self, block_ids) -> int:
        return sum(1 for b in block_ids if b in self._order and not self.protects(b))

    @property
    def num_unprotected(self) -> int:
        return sum(1 for b in self._order if not self.protects(b))

    def pop(self, n: int) -> list:
        order = sorted(self._order, key=self.protects)  # stable: LRU within each group
        out = order[:n]
        for b in out:
            del self._order[b]
        return out


@pytest.mark.parametrize("protective", [False, True])
def test_protective_admission_leaves_protected_prefixes_to_the_earliest_request(protective):
    """A paused session's prefix is protected. Once `protective_floor` requests run, a later
    waiting request is admitted only into blocks whose taking evicts nothing protected; the
    earliest waiting request is always admitted (evicting what it must)."""
    eviction = ProtectingEviction()
    pool = BlockPool(12, 4, eviction)
    cfg = SchedulerConfig(max_model_len=48, block_size=4, max_num_batched_tokens=64,
                          protect_on_admission=protective, protective_floor=1)
    runner = FakeRunner()
    clock = iter(range(10**6)).__next__
    engine = Engine(Scheduler(cfg, pool), runner, "fake", 1000, clock=lambda: float(clock()))
    paused = list(range(500, 516))  # 4 blocks, cached and then protected
    engine.add(paused, SamplingParams(max_tokens=1))
    drain(engine)
    eviction.keep = set(engine.prompt_hashes_of_tokens(paused))
    assert pool.num_unprotected_free_blocks == 12 - 4
    a = engine.add(list(range(24)), SamplingParams(max_tokens=4, ignore_eos=True))  # 7 blocks
    b = engine.add(list(range(100, 116)), SamplingParams(max_tokens=1))  # 5 blocks
    finished = {o.request_id for o in engine.step() if o.finished}
    admitted = {c.request_id for c in runner.batches[-1].chunks}
    assert a in admitted
    if protective:  # b would evict the paused prefix: it waits for a
        assert b not in admitted
        assert all(h in pool.index for h in eviction.keep)
    else:
        assert b in admitted
        assert not all(h in pool.index for h in eviction.keep)
    out = drain(engine)  # everything still finishes
    finished |= {rid for rid, outs in out.items() if outs[-1].finished}
    assert {a, b} <= finished


@pytest.mark.parametrize("seed", range(6))
def test_prefix_match_of_a_waiting_request_follows_evictions_and_publishes(seed):
    """The scheduler re-matches a waiting request every step, starting after the prefix it
    found last time while nothing has been evicted since (Request.match_memo). Against a naive
    match over the pool's index, after random publishes, frees and evicting allocations."""
    rng = random.Random(seed)
    bs, pool = 4, BlockPool(12, 4)
    cfg = SchedulerConfig(max_model_len=200, block_size=bs, max_num_seqs=8, max_num_batched_tokens=16)
    sched = Scheduler(cfg, pool)
    tokens = [rng.randrange(1000) for _ in range(10 * bs + 1)]
    req = Request(RequestId("w"), tokens, len(tokens), SamplingParams(max_tokens=1), ExtraKeys("m", None), 0.0)
    sched._match(req)  # hashes its 10 full blocks
    held: list[list[int]] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.45:  # another request computes and publishes some of this prompt's blocks
            first = rng.randrange(10)
            n = min(rng.randint(1, 3), 10 - first, pool.num_free_blocks)
            if n:
                ids = pool.allocate(n)
                for b, h in zip(ids, req.block_hashes[first : first + n]):
                    pool.insert(b, h)
                held.append(ids)
        elif op < 0.75 and held:
            pool.free(held.pop(rng.randrange(len(held))))
        elif pool.num_free_blocks:  # an allocation that may evict cached blocks
            held.append(pool.allocate(rng.randint(1, pool.num_free_blocks)))
        matched, _ = sched._match(req)
        naive = []
        for h in req.block_hashes[: (len(tokens) - 1) // bs]:
            if h not in pool.index:
                break
            naive.append(pool.index[h])
        assert matched == naive
        pool.check()


def _join_chunks(join_rows: int, remainder: int) -> list[int]:
    """Two requests decode; a third whose prompt is cached but for `remainder` tokens joins:
    the sizes of its chunks, step by step."""
    engine, runner = make(budget=64, join_rows=join_rows)
    first = engine.add(list(range(10)), SamplingParams(max_tokens=40))
    engine.add(list(range(50, 60)), SamplingParams(max_tokens=40))
    prefix = list(range(200, 216))  # 4 full blocks of 4
    engine.add(prefix + [1], SamplingParams(max_tokens=1))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.requests[first].num_output_tokens >= 2  # decoding
    late = engine.add(prefix + list(range(300, 300 + remainder)), SamplingParams(max_tokens=1))
    seen = len(runner.batches)
    while late in engine.scheduler.requests:
        engine.step()
        engine.scheduler.pool.check()
    return [len(c.token_ids) for b in runner.batches[seen:] for c in b.chunks if c.request_id == late]


def test_a_short_remainder_joining_decodes_is_spread_over_steps():
    assert _join_chunks(0, 6) == [6]  # off: all at once
    assert _join_chunks(2, 6) == [2, 2, 2]
    assert _join_chunks(2, 5) == [2, 2, 1]
    assert _join_chunks(2, 2) == [2]
    assert _join_chunks(2, 20) == [20]  # longer than join_short: an ordinary chunk


def test_the_earliest_request_is_never_spread():
    engine, runner = make(budget=64, join_rows=2)
    prefix = list(range(200, 216))
    engine.add(prefix + [1], SamplingParams(max_tokens=1))
    drain(engine)  # the prefix is cached, nothing runs
    late = engine.add(prefix + list(range(300, 306)), SamplingParams(max_tokens=3))
    engine.add(list(range(10)), SamplingParams(max_tokens=3))  # arrives after it
    engine.step()
    assert [len(c.token_ids) for c in runner.batches[-1].chunks if c.request_id == late] == [6]


def test_join_rows_must_not_be_negative():
    with pytest.raises(ValueError, match="join_rows"):
        SchedulerConfig(max_model_len=8, join_rows=-1)


def test_serve_rejects_a_negative_join_rows_at_the_door(capsys):
    from agentserve.cli import build_parser

    argv = ["serve", "--join-rows", "-1"]
    with pytest.raises(SystemExit) as exc:
        build_parser(argv).parse_args(argv)
    assert exc.value.code == 2 and "--join-rows: must be >= 0" in capsys.readouterr().err
    assert build_parser(["serve"]).parse_args(["serve", "--join-rows", "3"]).join_rows == 3
