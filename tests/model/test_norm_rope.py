"""The fused element-wise kernels (csrc/norm_rope.cpp) against transformers' own modules:
LlamaRMSNorm, apply_rotary_pos_emb and the SiLU activation, on the same bf16 inputs, and on fp32
inputs (a bf16 model computed in fp32 where the CPU has no bf16 dot product), where the K/V
cache may be bf16.

The kernels keep the reference's roundings, so RoPE and the residual add must match bit for
bit; the RMSNorm's fp32 sum of squares runs in another order and SiLU's exp is the compiler's
vector library, so those may differ by one bf16 step in a few values (for SiLU * up, one step
of the activation carried through the product), never more. Shapes cover
one row, a decode step's few, and enough rows that the work is split between threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from agentserve.model.transformer import rope_cos_sin
from tests.model.hf_tiny import cpu_kernels_or_skip

ROWS = (1, 4, 300)  # 300 rows of 896: past the kernels' one-thread grain


@pytest.fixture(scope="module")
def kernels():
    return cpu_kernels_or_skip()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 step at each value's magnitude (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp_min(2.0**-126))) - 7)


def assert_within_one_step(ours: torch.Tensor, ref: torch.Tensor, max_fraction: float) -> None:
    assert ours.dtype == ref.dtype == torch.bfloat16 and ours.shape == ref.shape
    diff = (ours.float() - ref.float()).abs()
    assert bool((diff <= ulp(ref)).all()), float((diff / ulp(ref)).max())
    assert float((diff > 0).float().mean()) <= max_fraction


def hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(weight.shape[0], eps=eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [64, 100, 576, 896])
def test_rms_norm_and_add_match_llama_rms_norm(kernels, rows, width):
    g = gen(rows * width)
    h = (torch.randn(rows, width, generator=g) * 4).bfloat16()
    d = torch.randn(rows, width, generator=g).bfloat16()
    w = (torch.randn(width, generator=g) * 0.3 + 1).bfloat16()
    assert_within_one_step(kernels.rms_norm(h, w, 1e-6), hf_norm(h, w, 1e-6), max_fraction=1e-3)
    summed = h + d  # the reference's residual add: bf16 + bf16
    mine = h.clone()
    normed = kernels.add_rms_norm(mine, d, w, 1e-5)
    assert torch.equal(mine, summed)  # added in place, rounded as torch rounds
    assert_within_one_step(normed, hf_norm(summed, w, 1e-5), max_fraction=1e-3)


def test_rms_norm_reads_strided_rows(kernels):
    """h[logit_rows] and views of a wider tensor: rows need only be contiguous each."""
    wide = torch.randn(6, 200, generator=gen(1)).bfloat16()
    x, w = wide[:, :128], torch.ones(128, dtype=torch.bfloat16)
    assert_within_one_step(kernels.rms_norm(x, w, 1e-6), hf_norm(x.contiguous(), w, 1e-6), max_fraction=1e-3)


@pytest.mark.parametrize("rows,q_heads,kv_heads,dim", [(1, 4, 1, 128), (4, 9, 3, 64), (300, 14, 2, 64), (5, 2, 2, 16)])
def test_rope_store_matches_apply_rotary_pos_emb_and_writes_the_cache(kernels, rows, q_heads, kv_heads, dim):
    g = gen(rows + q_heads)
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    positions = torch.randint(0, 30_000, (rows,), generator=g)
    cos, sin = rope_cos_sin(positions, dim, 1e6, torch.bfloat16)
    q = qkv[:, : q_heads * dim].view(rows, q_heads, dim)
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v = qkv[:, (q_heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    # transformers' layout: [batch, heads, seq, dim], cos/sin [batch, seq, dim]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    ref_q, ref_k, ref_v = ref_q[0].transpose(0, 1), ref_k[0].transpose(0, 1), v.clone()
    k_cache = torch.full((rows + 40, kv_heads, dim), 7.0, dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    slots = torch.randperm(rows + 40, generator=g)[:rows]
    mine = qkv.clone()
    kernels.rope_store(mine, cos, sin, q_heads, kv_heads, slots, k_cache, v_cache)
    assert torch.equal(mine[:, : q_heads * dim].view(rows, q_heads, dim), ref_q)
    assert torch.equal(mine[:, q_heads * dim : (q_heads + kv_heads) * dim].view(rows, kv_heads, dim), ref_k)
    assert torch.equal(mine[:, (q_heads + kv_heads) * dim :].view(rows, kv_heads, dim), ref_v)  # v untouched
    assert torch.equal(k_cache[slots], ref_k) and torch.equal(v_cache[slots], ref_v)
    others = torch.ones(rows + 40, dtype=torch.bool)
    others[slots] = False
    assert bool((k_cache[others] == 7).all()) and bool((v_cache[others] == 7).all())


def test_rope_store_rejects_a_slot_outside_the_cache(kernels):
    qkv = torch.zeros(2, 3 * 16, dtype=torch.bfloat16)
    cos, sin = rope_cos_sin(torch.tensor([0, 1]), 16, 1e4, torch.bfloat16)
    cache = torch.zeros(4, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.rope_store(qkv, cos, sin, 1, 1, torch.tensor([1, 4]), cache, cache.clone())


@pytest.mark.parametrize("rows,width", [(1, 1536), (4, 4864), (300, 1536)])
def test_silu_mul_matches_silu_times_up(kernels, rows, width):
    gate_up = (torch.randn(rows, 2 * width, generator=gen(width + rows)) * 3).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate)
    ref, ours = act * up, kernels.silu_mul(gate_up)
    # one step in the rounded activation (exp's last fp32 bit can move it), carried through the
    # product, and one in the product's own rounding
    diff = (ours.float() - ref.float()).abs()
    assert bool((diff <= ulp(act) * up.float().abs() + ulp(ref)).all())
    assert float((diff > 0).float().mean()) <= 5e-3


def test_a_nan_stays_a_nan(kernels):
    """A broken row must show as NaN downstream (the sampler reports it), never turn into 0."""
    h = torch.ones(2, 64, dtype=torch.bfloat16)
    h[1, 3] = float("nan")
    out = kernels.add_rms_norm(h, torch.zeros_like(h), torch.ones(64, dtype=torch.bfloat16), 1e-6)
    assert bool(out[1].isnan().all()) and not bool(out[0].isnan().any())
    gate_up = torch.ones(1, 8, dtype=torch.bfloat16)
    gate_up[0, 5] = float("nan")
    assert bool(kernels.silu_mul(gate_up)[0, 1].isnan())


# fp32: every rounding of the bf16 formulas is the identity; what differs from torch is the order
# of the fp32 sums and the FMAs the compiler contracts, a few fp32 steps at the values' magnitude.
F32_TOL = {"rtol": 4e-6, "atol": 4e-6}


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [64, 100, 576, 896])
def test_fp32_rms_norm_and_add_match_llama_rms_norm(kernels, rows, width):
    g = gen(rows * width + 1)
    h = torch.randn(rows, width, generator=g) * 4
    d = torch.randn(rows, width, generator=g)
    w = torch.randn(width, generator=g) * 0.3 + 1
    ours = kernels.rms_norm(h, w, 1e-6)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf_norm(h, w, 1e-6), **F32_TOL)
    mine = h.clone()
    normed = kernels.add_rms_norm(mine, d, w, 1e-5)
    assert torch.equal(mine, h + d)  # one fp32 add, rounded as torch rounds it
    torch.testing.assert_close(normed, hf_norm(h + d, w, 1e-5), **F32_TOL)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,q_heads,kv_heads,dim", [(1, 4, 1, 128), (4, 9, 3, 64), (300, 14, 2, 64)])
def test_fp32_rope_store_over_a_bf16_or_fp32_cache(kernels, cache_dtype, rows, q_heads, kv_heads, dim):
    g = gen(rows + q_heads + 7)
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * dim, generator=g)
    positions = torch.randint(0, 30_000, (rows,), generator=g)
    cos, sin = rope_cos_sin(positions, dim, 1e6, torch.float32)
    q = qkv[:, : q_heads * dim].view(rows, q_heads, dim)
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v = qkv[:, (q_heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    ref_q, ref_k, ref_v = ref_q[0].transpose(0, 1), ref_k[0].transpose(0, 1), v.clone()
    k_cache = torch.full((rows + 40, kv_heads, dim), 7.0, dtype=cache_dtype)
    v_cache = k_cache.clone()
    slots = torch.randperm(rows + 40, generator=g)[:rows]
    mine = qkv.clone()
    kernels.rope_store(mine, cos, sin, q_heads, kv_heads, slots, k_cache, v_cache)
    mq = mine[:, : q_heads * dim].view(rows, q_heads, dim)
    mk = mine[:, q_heads * dim : (q_heads + kv_heads) * dim].view(rows, kv_heads, dim)
    mv = mine[:, (q_heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    torch.testing.assert_close(mq, ref_q, **F32_TOL)  # q stays fp32, never rounded to the cache
    # k and v in qkv are what the cache holds (this chunk attends to them as later ones will)
    assert torch.equal(k_cache[slots].float(), mk) and torch.equal(v_cache[slots].float(), mv)
    if cache_dtype == torch.bfloat16:
        assert torch.equal(v_cache[slots], ref_v.bfloat16())  # v is only rounded (to nearest even)
        # k: the fp32 rotation, then one rounding; a few fp32 steps apart can round the other way
        ref16 = ref_k.bfloat16()
        diff = (k_cache[slots].float() - ref16.float()).abs()
        assert bool((diff <= ulp(ref16)).all()) and float((diff > 0).float().mean()) <= 1e-3
    else:
        assert torch.equal(v_cache[slots], ref_v)
        torch.testing.assert_close(k_cache[slots], ref_k, **F32_TOL)
    others = torch.ones(rows + 40, dtype=torch.bool)
    others[slots] = False
    assert bool((k_cache[others] == 7).all()) and bool((v_cache[others] == 7).all())


def test_fp32_rope_store_rejects_mixed_caches(kernels):
    qkv = torch.zeros(2, 3 * 16)
    cos, sin = rope_cos_sin(torch.tensor([0, 1]), 16, 1e4, torch.float32)
    with pytest.raises(RuntimeError, match="both of one dtype"):
        kernels.rope_store(qkv, cos, sin, 1, 1, torch.tensor([0, 1]), torch.zeros(4, 1, 16, dtype=torch.bfloat16),
                           torch.zeros(4, 1, 16))


@pytest.mark.parametrize("rows,width", [(1, 1536), (4, 4864), (300, 1536)])
def test_fp32_silu_mul_matches_silu_times_up(kernels, rows, width):
    gate_up = torch.randn(rows, 2 * width, generator=gen(width + rows + 3)) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, **F32_TOL)


def test_fp32_a_nan_stays_a_nan(kernels):
    h = torch.ones(2, 64)
    h[1, 3] = float("nan")
    out = kernels.add_rms_norm(h, torch.zeros_like(h), torch.ones(64), 1e-6)
    assert bool(out[1].isnan().all()) and not bool(out[0].isnan().any())
    gate_up = torch.ones(1, 8)
    gate_up[0, 5] = float("nan")
    assert bool(kernels.silu_mul(gate_up)[0, 1].isnan())


def test_activations_of_another_dtype_are_refused(kernels):
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        kernels.rms_norm(torch.ones(2, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm(torch.ones(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6)
