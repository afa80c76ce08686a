"""The fused bf16 element-wise kernels (csrc/norm_rope.cpp) against transformers' own modules:
LlamaRMSNorm, apply_rotary_pos_emb and the SiLU activation, on the same bf16 inputs.

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
    norm = LlamaRMSNorm(weight.shape[0], eps=eps).to(torch.bfloat16)
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
