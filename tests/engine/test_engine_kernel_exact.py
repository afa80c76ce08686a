"""Greedy output with the C++ attention kernels on (decode and prefill) equals transformers'
greedy generation, for the whole engine: concurrent requests, chunked prefill budgets, prefix
cache on and off, preemption, and the three architectures.

The prompts are long enough that contexts span up to three of the kernels' 128-key tiles, so
their online-softmax rescale between tiles is on the path (a context under 128 keys never
rescales). Every test asserts both kernels actually ran, how long a context they attended and,
for prefill, that chunks over a cached prefix went through it; the module is skipped, with the
builder's message, where the kernels cannot be built."""

from __future__ import annotations

import random

import pytest

from agentserve.engine.request import RequestOutput, SamplingParams
from agentserve.model.runner import SHORT_CHUNK
from tests.model.hf_tiny import KernelSpy, cpu_kernels_or_skip, hf_greedy, run_all, tiny_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
TILE = 128  # keys per tile in csrc/decode_attention.cpp
SHARED = 24  # prefix tokens every prompt starts with: six blocks of 4
NUM_BLOCKS = 370  # of 4 tokens: the eight requests at once need 366 without sharing
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def kernels():
    return cpu_kernels_or_skip()


def prompts(seed: int) -> list[list[int]]:
    """Eight prompts behind a shared prefix; with 12 generated tokens the longest context is
    336 keys (three tiles), the shortest 27."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(SHARED)]
    lengths = [3, 40, 105, 129, 200, 300, 140, 260]  # 24 + 105 + 12 crosses 128 during decode
    return [shared + [rng.randrange(256) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3"])
def reference(request):
    arch = request.param
    _, hf = tiny_engine(arch)
    ps = prompts(seed=len(arch))
    return arch, ps, [hf_greedy(hf, p, GREEDY.max_tokens) for p in ps]


def assert_kernel_ran(spy: KernelSpy, min_decode_rows: int, budget: int = 64, over_cache: bool = True) -> None:
    assert spy.num_calls > 0 and spy.num_calls % NUM_LAYERS == 0  # every layer of every step
    assert spy.num_rows >= NUM_LAYERS * min_decode_rows
    assert spy.max_context > 2 * TILE  # the rescale between tiles ran
    if budget <= SHORT_CHUNK:  # every chunk is short enough to ride the decode kernel
        assert spy.prefill_calls == 0
        return
    assert spy.prefill_calls > 0 and spy.prefill_calls % NUM_LAYERS == 0
    assert spy.max_prefill_context > 2 * TILE
    assert (spy.prefill_over_cache > 0) == over_cache  # chunks after a cached prefix


def decodes(ps: list[list[int]]) -> int:
    """Rows that are one-token chunks at least: each generated token but the first is sampled
    after its predecessor was computed alone (unless a preemption recomputed it)."""
    return len(ps) * (GREEDY.max_tokens - 1)


def drain(engine) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    return outputs


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("budget", [3, 64, 2048])
def test_eight_concurrent_requests_match_hf(kernels, reference, prefix_caching, budget):
    arch, ps, ref = reference
    spy = KernelSpy(kernels)
    engine, _ = tiny_engine(arch, num_blocks=NUM_BLOCKS, enable_prefix_caching=prefix_caching,
                            max_num_batched_tokens=budget, kernels=spy)
    assert run_all(engine, ps, GREEDY) == ref
    # every prompt fits one chunk of 2,048: only the prefix cache puts a chunk past position 0
    assert_kernel_ran(spy, decodes(ps), budget, over_cache=prefix_caching or budget < 2048)


def test_one_at_a_time_from_the_prefix_cache_matches_hf(kernels, reference):
    arch, ps, ref = reference
    spy = KernelSpy(kernels)
    engine, _ = tiny_engine(arch, num_blocks=NUM_BLOCKS, max_num_batched_tokens=64, kernels=spy)
    finals: list[RequestOutput] = []
    for p, r in zip(ps + ps[-1:], ref + ref[-1:]):  # the last prompt twice: whole blocks from cache
        engine.add(p, GREEDY)
        outputs = drain(engine)
        assert [t for o in outputs for t in o.new_token_ids] == r
        finals.extend(o for o in outputs if o.finished)
    assert all(f.num_reused_tokens >= SHARED for f in finals[1:])
    assert finals[-1].num_reused_tokens == (len(ps[-1]) - 1) // 4 * 4  # all but the last token
    assert_kernel_ran(spy, decodes(ps))


def test_preemption_keeps_output_exact(kernels, reference):
    arch, ps, ref = reference
    spy = KernelSpy(kernels)
    # 90 blocks of 4 hold the longest request (336 tokens) alone, not all eight: preemption.
    engine, _ = tiny_engine(arch, num_blocks=90, max_num_batched_tokens=64, kernels=spy)
    ids = [engine.add(p, GREEDY) for p in ps]
    out: dict[str, list[int]] = {i: [] for i in ids}
    preempted: dict[str, int] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        engine.scheduler.pool.check()
        preempted |= {r.request_id: r.num_preemptions for r in engine.scheduler.requests.values()}
    assert [out[i] for i in ids] == ref
    assert sum(preempted.values()) >= 1
    assert_kernel_ran(spy, decodes(ps) - sum(preempted.values()))
