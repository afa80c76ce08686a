"""The C++ few-row bf16 matmul (csrc/small_linear.cpp) against an fp64 reference, against
oneDNN's precision on the same inputs, and in the model.

Shapes cross the kernel's edges: widths that are not a multiple of its 32-value vectors (tail
loads), 1 to 8 rows (its 4-row groups and the 3-, 2- and 1-row remainders with their own
accumulator counts), one weight row and an odd count of them (the split between threads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentserve.model.transformer import Linear, Transformer
from tests.model.hf_tiny import KernelSpy, cpu_kernels_or_skip, model_config_of, tiny_hf_model, weights_of

SHAPES = [(1, 32, 1), (3, 100, 7), (8, 896, 129), (5, 575, 1000), (2, 4864, 33), (7, 1000, 2049)]  # (rows, K, N)


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels_or_skip()
    if not k.bf16_small_linear:
        pytest.skip("no AVX512-BF16 here: bf16 matmuls stay on oneDNN")
    return k


def case(rows: int, k: int, n: int, seed: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    return x, w, b


def exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + b.double() if b is not None else out


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_matches_fp64_within_one_rounding(kernels, rows, k, n, bias):
    """fp32 sums then one rounding to bf16: |ours - exact| <= half an ulp of the sum plus the
    fp32 accumulation error (K + 2 roundings of at most 2^-24 times the absolute terms)."""
    x, w, b = case(rows, k, n, seed=rows * k + n, bias=bias)
    ours = kernels.small_linear(x, w, b)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, n)
    ref = exact(x, w, b)
    terms = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    accumulated = (k + 2) * 2.0**-24 * terms
    bound = 2.0**-8 * (ref.abs() + accumulated) + accumulated
    err = (ours.double() - ref).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


def test_as_close_to_fp64_as_onednn(kernels):
    """The order of fp32 sums differs from oneDNN's; the error may not be larger on the whole."""
    ours = theirs = 0.0
    for i, (rows, k, n) in enumerate(SHAPES):
        x, w, b = case(rows, k, n, seed=i, bias=True)
        ref = exact(x, w, b)
        ours += float((kernels.small_linear(x, w, b).double() - ref).abs().mean())
        theirs += float((F.linear(x, w, b).double() - ref).abs().mean())
    assert ours <= 1.1 * theirs, (ours, theirs)


def test_rows_it_takes_and_what_it_rejects(kernels):
    assert kernels.small_linear_rows(896) == 8  # 8 rows of 896 fit in L1 beside the weights
    assert kernels.small_linear_rows(4864) == 2  # wider inputs: only the rows oneDNN is slow at
    x, w, _ = case(9, 64, 4, seed=0, bias=False)
    assert kernels.small_linear(x[:0], w, None).shape == (0, 4)
    with pytest.raises(RuntimeError, match="at most 8 rows"):
        kernels.small_linear(x, w, None)
    with pytest.raises(RuntimeError, match="bf16 only"):
        kernels.small_linear(x[:2].float(), w.float(), None)
    with pytest.raises(RuntimeError, match="w \\[N, K\\]"):
        kernels.small_linear(x[:2], w[:, :32], None)


def test_linear_routes_few_rows_to_the_kernel_and_more_to_onednn(kernels):
    x, w, b = case(12, 896, 64, seed=3, bias=True)
    spy = KernelSpy(kernels)
    lin = Linear(w, b, pack=True, small=spy)  # type: ignore[arg-type]
    assert lin.small_rows == 8 and lin.weight is not None  # the row-major weight is kept
    few, many, none = lin(x[:8]), lin(x), lin(x[:0])  # no rows: a step of unfinished prefill chunks
    assert spy.small_linear_calls == 1 and none.shape == (0, 64)
    assert torch.equal(few, kernels.small_linear(x[:8], w, b))
    assert torch.equal(many, F.linear(x, w, b))  # oneDNN's packed matmul, bit-exact to F.linear
    assert Linear(w.float(), None, pack=True, small=kernels).small_rows == 0  # fp32: exact path


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_model_decode_steps_use_it_and_stay_close(kernels, arch):
    """A bf16 decode step of 3 rows with and without the kernel: the same logits up to bf16
    rounding (the two differ only in the order of fp32 sums inside each matmul)."""
    hf = tiny_hf_model(arch)
    cfg = model_config_of(hf, arch)
    weights = weights_of(hf, torch.bfloat16)
    with_kernel, without = Transformer(cfg, weights, kernels=kernels), Transformer(cfg, weights)
    spy = KernelSpy(kernels)
    spy.install(with_kernel)
    h = with_kernel.embed[torch.tensor([3, 4, 5])]
    a = with_kernel.lm_head(h).float()
    b = without.lm_head(h).float()
    assert spy.small_linear_calls == 1 and with_kernel.uses_small_linear() and not without.uses_small_linear()
    assert (a - b).abs().max() <= 2.0**-7 * b.abs().max()


def test_decode_bench_times_both_sides(kernels):
    from agentserve.model.decode_bench import run_decode_attention_bench, run_linear_bench

    rows = run_linear_bench(kernels, shapes=((64, 896), (40, 4864)), rows=(1, 4), budget_s=0.0, cold_bytes=1 << 20)
    assert [(r.rows, r.n, r.k) for r in rows] == [(1, 64, 896), (4, 64, 896), (1, 40, 4864)]  # 4 rows of 4,864: oneDNN's
    assert all(r.onednn_ms > 0 and r.kernel_ms > 0 and r.gbps(r.kernel_ms) > 0 for r in rows)
    if kernels.bf16_prefill:
        att = run_decode_attention_bench(kernels, cases=((2, 40),), layers=2, budget_s=0.0)
        assert [(a.sequences, a.context) for a in att] == [(2, 40)] and att[0].loop_ms > 0 and att[0].tiles_ms > 0
