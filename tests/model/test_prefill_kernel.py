"""The C++ prefill attention (csrc/prefill_attention.cpp) against an fp64 reference and against
the torch path it replaces.

Shapes are chosen to cross each of the kernel's boundaries: 128-key tiles (contexts of 1 to
430 keys, chunks that start on, before and after a tile edge), 64-row tasks (chunks of 1 to
130 rows) and 4-vector micro tiles (7 and 3 query heads per KV head leave partial groups)."""

from __future__ import annotations

import pytest
import torch

from agentserve.model.runner import ModelRunner
from agentserve.model.transformer import ChunkLayout, Transformer
from tests.model.hf_tiny import cpu_kernels_or_skip, model_config_of, tiny_hf_model, weights_of

# (rows, start): a chunk of `rows` query tokens after `start` cached ones
CHUNKS = [(1, 0), (3, 0), (64, 0), (130, 0), (1, 300), (5, 123), (65, 63), (100, 128), (17, 413)]


@pytest.fixture(scope="module")
def kernels():
    return cpu_kernels_or_skip()


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              start: int, scale: float) -> torch.Tensor:
    """Plain fp64 causal attention: row r (position start + r) sees context[: start + r + 1]."""
    rows, heads, _ = q.shape
    group = heads // k_cache.shape[1]
    keys, values = k_cache[slots].double(), v_cache[slots].double()  # [context, kv_heads, dim]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(rows):
        seen = start + r + 1
        for h in range(heads):
            w = torch.softmax(keys[:seen, h // group] @ q[r, h].double() * scale, dim=0)
            out[r, h] = w @ values[:seen, h // group]
    return out


def case(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, rows: int, start: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_slots = 1024
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[: start + rows]  # scattered, as in the pool
    q = (3 * torch.randn(rows, heads, dim, generator=gen)).to(dtype)  # peaked softmax
    return q, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("dim", [16, 32, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(14, 2), (9, 3), (4, 4)])
def test_kernel_matches_fp64_reference(kernels, dtype, tol, dim, heads, kv_heads):
    if dtype == torch.bfloat16 and not kernels.bf16_prefill:
        pytest.skip("no AVX512-BF16 here: bf16 prefill stays on torch's SDPA")
    for i, (rows, start) in enumerate(CHUNKS):
        q, k_cache, v_cache, slots = case(dtype, heads, kv_heads, dim, rows, start, seed=dim + heads + i)
        out = kernels.prefill_attention(q, k_cache, v_cache, slots, start, dim**-0.5)
        assert out.dtype == dtype and out.shape == q.shape
        err = (out.double() - reference(q, k_cache, v_cache, slots, start, dim**-0.5)).abs().max()
        assert err < tol, (rows, start, float(err))


def torch_path(model: Transformer, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slots: torch.Tensor, start: int) -> torch.Tensor:
    """What the Transformer runs without the kernel: SDPA over the gathered context."""
    chunk = ChunkLayout(0, q.shape[0], start, slots)
    mask = model._chunk_mask(chunk, q.dtype)
    if mask is None:
        return model._sdpa(q, k_cache[slots], v_cache[slots], None, causal=True)
    return model._chunk_attention(q, chunk, mask, k_cache, v_cache)


def test_bf16_kernel_is_as_close_to_fp64_as_torch_sdpa(kernels):
    """bf16 rounds twice either way (inputs, then probabilities for PV): the kernel's mean error
    from fp64 may not exceed torch's on the same inputs by more than 10%."""
    if not kernels.bf16_prefill:
        pytest.skip("no AVX512-BF16 here: bf16 prefill stays on torch's SDPA")
    heads, kv_heads, dim = 14, 2, 64
    model = Transformer.__new__(Transformer)  # only the attention helpers are used
    model.config = type("Shape", (), {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": dim})()
    model.scale = dim**-0.5
    ours = theirs = 0.0
    for i, (rows, start) in enumerate([(130, 0), (100, 128), (64, 300)]):
        q, k_cache, v_cache, slots = case(torch.bfloat16, heads, kv_heads, dim, rows, start, seed=i)
        exact = reference(q, k_cache, v_cache, slots, start, model.scale)
        ours += float((kernels.prefill_attention(q, k_cache, v_cache, slots, start, model.scale).double()
                       - exact).abs().mean())
        theirs += float((torch_path(model, q, k_cache, v_cache, slots, start).double() - exact).abs().mean())
    assert ours <= 1.1 * theirs, (ours, theirs)


def test_kernel_rejects_what_it_cannot_serve(kernels):
    q, k_cache, v_cache, slots = case(torch.float32, 4, 2, 32, 5, 10, seed=0)
    with pytest.raises(RuntimeError, match="start \\+ rows"):
        kernels.prefill_attention(q, k_cache, v_cache, slots[:-1], 10, 1.0)  # one slot short
    with pytest.raises(RuntimeError, match="int64"):
        kernels.prefill_attention(q, k_cache, v_cache, slots.int(), 10, 1.0)
    odd = torch.randn(5, 4, 24)
    with pytest.raises(RuntimeError, match="head_dim 24"):
        kernels.prefill_attention(odd, torch.randn(64, 2, 24), torch.randn(64, 2, 24), slots, 10, 1.0)
    assert not kernels.supports_prefill(torch.float32, 24) and not kernels.supports_prefill(torch.float16, 64)
    assert kernels.supports_prefill(torch.float32, 64)
    empty = kernels.prefill_attention(q[:0], k_cache, v_cache, slots[:10], 10, 1.0)
    assert empty.shape == (0, 4, 32)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_model_chunks_with_kernel_equal_torch_path(kernels, arch):
    """A flat batch of two chunks, one at position 0 and one over 150 cached tokens, through the
    whole model: the kernel's logits equal the SDPA path's (fp32)."""
    hf = tiny_hf_model(arch)
    cfg = model_config_of(hf, arch)
    weights = weights_of(hf, torch.float32)
    with_kernel, without = Transformer(cfg, weights, kernels=kernels), Transformer(cfg, weights)
    assert with_kernel.prefill_reads_in_place(torch.float32, torch.device("cpu"))
    assert not without.prefill_reads_in_place(torch.float32, torch.device("cpu"))
    runner = ModelRunner(without, 128, 4, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    for layer in range(cfg.num_layers):  # the cached prefix: any contents will do, both read it
        runner.kv.k[layer].normal_(generator=gen)
        runner.kv.v[layer].normal_(generator=gen)
    perm = torch.randperm(512, generator=gen)
    first, second = perm[:40], perm[40:40 + 150 + 30]  # 40 new tokens; 150 cached + 30 new
    chunks = [ChunkLayout(0, 40, 0, first), ChunkLayout(40, 30, 150, second)]
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=gen)
    pos = torch.cat([torch.arange(40), torch.arange(150, 180)])
    write = torch.cat([first, second[150:]])
    rows = torch.tensor([39, 69])
    a = with_kernel.forward(ids, pos, write, chunks, runner.kv, rows)
    b = without.forward(ids, pos, write, chunks, runner.kv, rows)
    assert (a - b).abs().max() < 1e-4


def test_attention_bench_times_both_sides(kernels):
    if not kernels.bf16_prefill:
        pytest.skip("no AVX512-BF16 here: the bench has nothing to time")
    from agentserve.model.attention_bench import run_attention_bench

    rows = run_attention_bench(kernels, heads=4, kv_heads=2, head_dim=32, chunks=((5, 20), (40, 0)), budget_s=0.0)
    assert [(r.rows, r.start) for r in rows] == [(5, 20), (40, 0)]
    assert all(r.torch_ms > 0 and r.kernel_ms > 0 and r.kernel_gflops > 0 for r in rows)


def test_the_bf16_prefill_path_is_chosen_by_measurement_and_fp32_keeps_the_kernel():
    from agentserve.model.attention_bench import SDPA_MARGIN, prefill_kernel_wins
    from agentserve.model.cpu_kernels import load_cpu_kernels
    from agentserve.model.transformer import Transformer

    kernels = load_cpu_kernels()
    if kernels is None or not kernels.supports_prefill(torch.bfloat16, 64):
        pytest.skip("no bf16 prefill kernel on this CPU")
    wins, row = prefill_kernel_wins(kernels, 14, 2, 64, budget_s=0.05)
    assert row.kernel_ms > 0 and row.torch_ms > 0
    assert wins == (row.torch_ms * SDPA_MARGIN >= row.kernel_ms)
    model = Transformer.__new__(Transformer)  # only the routing is read
    model.config = type("Shape", (), {"head_dim": 64})()
    model.kernels = kernels
    cpu = torch.device("cpu")
    for chosen in (True, False):
        model.bf16_prefill_kernel = chosen
        assert model.prefill_reads_in_place(torch.bfloat16, cpu) is chosen
        assert model.prefill_reads_in_place(torch.float32, cpu)  # exact tests run the kernel
