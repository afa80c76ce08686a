"""A bf16 model computed in fp32 (model/precision.py): weights and KV kept in bf16, arithmetic in
fp32, for CPUs without a bf16 dot product. Tested against independent references:

- csrc/widened_linear.cpp (few-row matmuls, the bf16 weight widened in registers) against fp64,
  over shapes that cross its edges: 1 to 48 rows (its 4-row groups, the 3-, 2- and 1-row
  remainders), widths with 8- and 32-value tails, an odd number of weight rows (the padded pair);
- both attention kernels with fp32 queries over bf16 caches against fp64;
- the whole engine against transformers in fp32 on the same bf16-rounded weights, with K and V
  rounded to bf16 where its attention reads them (what the engine's bf16 cache holds): greedy
  tokens identical for the three architectures, concurrent requests, chunked prefill over a
  cached prefix.
The choice itself (which CPUs compute bf16 in fp32) is tested on CPU flags, not on this CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from agentserve.engine.request import SamplingParams
from agentserve.model.cpu_kernels import pack_pairs
from agentserve.model.precision import compute_dtype, cpu_flags, cpu_has_native_bf16
from agentserve.model.transformer import Linear
from tests.model import test_cpu_kernels as decode_ref
from tests.model import test_prefill_kernel as prefill_ref
from tests.model.hf_tiny import KernelSpy, cpu_kernels_or_skip, run_all, tiny_engine, tiny_hf_model

# (rows, K, N): rows across the 4-row groups; K with 8- and 32-value tails; N odd and even
SHAPES = [(1, 32, 1), (2, 8, 3), (3, 100, 7), (4, 896, 130), (5, 575, 1001), (7, 1000, 2049), (8, 4864, 33),
          (13, 264, 64), (16, 896, 257), (48, 72, 9)]


@pytest.fixture(scope="module")
def kernels():
    return cpu_kernels_or_skip()


def case(rows: int, k: int, n: int, seed: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=gen) if bias else None
    return x, w, b


def exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + b.double() if b is not None else out


def test_pairs_interleave_rows_value_by_value():
    w = torch.arange(15, dtype=torch.float32).view(5, 3).bfloat16()  # 5 rows: the last pair padded
    p = pack_pairs(w)
    assert p.shape == (3, 3, 2)
    assert torch.equal(p[1, :, 0], w[2]) and torch.equal(p[1, :, 1], w[3])
    assert torch.equal(p[2, :, 0], w[4]) and bool((p[2, :, 1] == 0).all())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_widened_linear_matches_fp64(kernels, rows, k, n, bias):
    """A bf16 weight times an fp32 input is exact in fp64; the kernel rounds each product-sum
    in fp32: |ours - exact| <= (K + 2) 2^-24 sum |x w| (+ |b|)."""
    x, w, b = case(rows, k, n, seed=rows * k + n, bias=bias)
    ours = kernels.widened_linear(x, pack_pairs(w), n, b)
    assert ours.dtype == torch.float32 and ours.shape == (rows, n)
    terms = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    err = (ours.double() - exact(x, w, b)).abs()
    bound = (k + 2) * 2.0**-24 * terms
    assert bool((err <= bound).all()), float((err - bound).max())


def test_widened_linear_is_as_close_to_fp64_as_mkl_on_an_fp32_copy(kernels):
    ours = theirs = 0.0
    for i, (rows, k, n) in enumerate(SHAPES):
        x, w, b = case(rows, k, n, seed=i, bias=True)
        ref = exact(x, w, b)
        ours += float((kernels.widened_linear(x, pack_pairs(w), n, b).double() - ref).abs().mean())
        theirs += float((F.linear(x, w.float(), b).double() - ref).abs().mean())
    assert ours <= 1.1 * theirs, (ours, theirs)


def test_widened_linear_rejects_what_it_cannot_serve(kernels):
    x, w, b = case(3, 64, 5, seed=0, bias=True)
    p = pack_pairs(w)
    assert kernels.widened_linear(x[:0], p, 5, b).shape == (0, 5)
    with pytest.raises(RuntimeError, match="ceil\\(n / 2\\)"):
        kernels.widened_linear(x, p, 7, None)  # 7 rows would need 4 pairs
    with pytest.raises(RuntimeError, match="x fp32 and w bf16"):
        kernels.widened_linear(x.bfloat16(), p, 5, None)
    with pytest.raises(RuntimeError, match="bias fp32"):
        kernels.widened_linear(x, p, 5, b.bfloat16())
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        kernels.widened_linear(x[:, :32], p, 5, None)


def test_linear_routes_few_rows_to_the_kernel_and_more_to_the_fp32_copy(kernels):
    if not kernels.avx2_widened_linear:
        pytest.skip("no AVX2 here: every widened matmul goes to the fp32 copy")
    x, w, b = case(kernels.widened_rows(896) + 2, 896, 64, seed=3, bias=False)
    b16 = torch.randn(64).bfloat16()
    spy = KernelSpy(kernels)
    lin = Linear(w, b16, pack=True, small=spy, compute=torch.float32)  # type: ignore[arg-type]
    assert lin.widened and lin.full.dtype == torch.float32 and lin.bias.dtype == torch.float32
    few, many, none = lin(x[:5]), lin(x), lin(x[:0])
    assert spy.widened_calls == 1 and none.shape == (0, 64)
    assert torch.equal(few, kernels.widened_linear(x[:5], pack_pairs(w), 64, b16.float()))
    assert torch.equal(many, F.linear(x, w.float(), b16.float()))  # MKL's sgemm on the fp32 copy
    plain = Linear(w, b16, pack=True, small=None, compute=torch.float32)  # no kernels: the copy only
    assert plain.weight is None and torch.equal(plain(x[:5]), F.linear(x[:5], w.float(), b16.float()))


@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (9, 3, 32), (4, 4, 128), (4, 2, 16)])
def test_attention_kernels_take_fp32_queries_over_bf16_caches(kernels, heads, kv_heads, dim):
    """The caches hold bf16 values; the fp64 reference reads the same values, so the kernels may
    differ from it by fp32 rounding alone."""
    for i, (rows, start) in enumerate(prefill_ref.CHUNKS):
        q, k_cache, v_cache, slots = prefill_ref.case(torch.bfloat16, heads, kv_heads, dim, rows, start, seed=i)
        q = q.float() + 0.01 * torch.randn(q.shape, generator=torch.Generator().manual_seed(i))  # not bf16 values
        out = kernels.prefill_attention(q, k_cache, v_cache, slots, start, dim**-0.5)
        assert out.dtype == torch.float32
        err = (out.double() - prefill_ref.reference(q, k_cache, v_cache, slots, start, dim**-0.5)).abs().max()
        assert err < 1e-5, (rows, start, float(err))
    gen = torch.Generator().manual_seed(dim)
    k_cache = torch.randn(4096, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(4096, kv_heads, dim, generator=gen).bfloat16()
    lengths = torch.tensor([300, 1, 129, 77])
    slots = torch.stack([torch.randperm(4096, generator=gen)[:300] for _ in lengths])
    q = 3 * torch.randn(len(lengths), heads, dim, generator=gen)
    out = kernels.decode_attention(q, k_cache, v_cache, slots, lengths, dim**-0.5)
    assert out.dtype == torch.float32
    assert (out.double() - decode_ref.reference(q, k_cache, v_cache, slots, lengths, dim**-0.5)).abs().max() < 2e-6
    with pytest.raises(RuntimeError, match="fp32 over bf16"):  # bf16 queries over fp32 caches: no
        kernels.prefill_attention(q[:, None].bfloat16()[:1, 0], k_cache.float(), v_cache.float(), slots[0, :1], 0, 1.0)


def bf16_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with K (after RoPE) and V rounded to bf16: what a bf16 KV
    cache hands back to an fp32 forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key.bfloat16().float(), value.bfloat16().float(),
                                  attention_mask, **kwargs)


def reference_model(arch: str) -> transformers.PreTrainedModel:
    """The tiny model in fp32 with its weights rounded to bf16 and its K/V rounded to bf16."""
    transformers.AttentionInterface.register("bf16_kv_sdpa", bf16_kv_sdpa)
    hf = tiny_hf_model(arch, sharp_attention=True)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    hf.set_attn_implementation("bf16_kv_sdpa")
    return hf


def hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_engine_equals_transformers_on_bf16_weights_and_kv(kernels, arch):
    import random

    rng = random.Random(len(arch))
    shared = [rng.randrange(256) for _ in range(24)]
    prompts = [shared + [rng.randrange(256) for _ in range(n)] for n in (3, 40, 105, 200, 140)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    spy = KernelSpy(kernels)
    engine, _ = tiny_engine(arch, dtype=torch.bfloat16, compute_dtype=torch.float32, kernels=spy,
                            max_num_batched_tokens=64)
    model = engine.runner.model
    spy.install(model)
    assert model.widened and engine.runner.kv.k[0].dtype == torch.bfloat16
    assert "compute=float32" in engine.runner.kernel_options()
    first = run_all(engine, prompts[:1], greedy)  # then the rest, over its cached prefix
    rest = run_all(engine, prompts[1:], greedy)
    hf = reference_model(arch)
    assert first + rest == [hf_greedy(hf, p, greedy.max_tokens) for p in prompts]
    assert spy.prefill_calls > 0 and spy.prefill_over_cache > 0 and spy.num_calls > 0
    assert spy.widened_calls > 0 or not kernels.avx2_widened_linear
    # norms, SiLU and (but for Qwen3's per-head norms) RoPE with the K/V write: csrc/norm_rope.cpp in fp32
    assert spy.norm_calls > 0 and spy.silu_calls > 0 and (spy.rope_calls > 0 or arch == "qwen3")


def test_the_choice_follows_the_cpu_flags():
    cpu = torch.device("cpu")
    assert cpu_flags("processor : 0\nflags\t\t: fpu avx2 fma\n") == {"fpu", "avx2", "fma"}
    assert cpu_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}
    assert not cpu_has_native_bf16(frozenset({"avx2", "fma", "avx512f"}), "x86_64")  # Zen 3, Skylake-X
    assert cpu_has_native_bf16(frozenset({"avx512f", "avx512_bf16"}), "x86_64")  # Zen 4, Cooper Lake
    assert cpu_has_native_bf16(frozenset({"amx_bf16"}), "x86_64")  # Sapphire Rapids
    assert cpu_has_native_bf16(frozenset({"asimd", "bf16"}), "aarch64")
    assert not cpu_has_native_bf16(frozenset({"asimd"}), "aarch64")
    bf16, fp32 = torch.bfloat16, torch.float32
    assert compute_dtype(bf16, cpu, "auto", native_bf16=False) == fp32
    assert compute_dtype(bf16, cpu, "auto", native_bf16=True) == bf16
    assert compute_dtype(bf16, torch.device("cuda"), "auto", native_bf16=False) == bf16
    assert compute_dtype(fp32, cpu, "auto", native_bf16=False) == fp32
    assert compute_dtype(bf16, cpu, "bfloat16", native_bf16=False) == bf16  # asked for: emulated
    assert compute_dtype(bf16, cpu, "float32", native_bf16=True) == fp32
    with pytest.raises(ValueError, match="needs bfloat16 weights"):
        compute_dtype(fp32, cpu, "bfloat16")
    with pytest.raises(ValueError, match="auto, bfloat16, float32"):
        compute_dtype(bf16, cpu, "float16")
