"""`agentserve bench decode`: the C++ kernels of a bf16 decode step against what they
replace, timed side by side in one process, with the weights and the KV cold as in a real step
(each call reads a different copy, together larger than the L3 cache):

- linears: csrc/small_linear.cpp against oneDNN's packed matmul on Qwen2.5-0.5B's five weight
  shapes, for the row counts the model sends it (small_linear_rows(K));
- decode attention: bf16 through the prefill micro kernel against the fp32 loop that served
  bf16 before (csrc/decode_attention.cpp), for B sequences of `context` tokens, 24 layers;
- steps (`--steps`): the bundled model's decode step, ms per step at batch 1 to 8 over 2k
  contexts: both kernels, the few-row matmul kernel alone (norms, RoPE and SiLU in torch ops,
  not csrc/norm_rope.cpp), and neither (oneDNN; attention the same throughout).

A decode step reads every weight once, so the linears are bound by memory bandwidth: GB/s
here is weight bytes per second (two cores stream ~38 GB/s from DRAM here)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentserve.model.attention_bench import best_ms
from agentserve.model.cpu_kernels import CpuKernels
from agentserve.model.transformer import Linear

# Qwen2.5-0.5B: q+k+v, o, gate+up, down, output projection (N, K)
SHAPES = ((1152, 896), (896, 896), (9728, 896), (896, 4864), (151936, 896))
ROWS = (1, 2, 4, 8)
ATTENTION = ((1, 2048), (8, 2048), (1, 16384))  # (sequences, context)
COLD_BYTES = 256 << 20  # copies of a weight (or a layer's KV) until they fill this: past L3


@dataclass(frozen=True, slots=True)
class LinearRow:
    rows: int
    n: int
    k: int
    onednn_ms: float
    kernel_ms: float

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k * 2

    def gbps(self, ms: float) -> float:
        return self.weight_bytes / ms / 1e6

    @property
    def speedup(self) -> float:
        return self.onednn_ms / self.kernel_ms


@dataclass(frozen=True, slots=True)
class AttentionRow:
    sequences: int
    context: int
    loop_ms: float  # per layer call
    tiles_ms: float

    @property
    def speedup(self) -> float:
        return self.loop_ms / self.tiles_ms


@dataclass(frozen=True, slots=True)
class StepRow:
    batch: int
    kernel_ms: float  # both kernels: few-row matmuls and the fused norms / RoPE / SiLU
    torch_glue_ms: float  # the matmul kernel, the element-wise steps in torch ops
    onednn_ms: float  # neither: oneDNN and torch ops

    @property
    def speedup(self) -> float:
        return self.onednn_ms / self.kernel_ms

    @property
    def glue_speedup(self) -> float:
        return self.torch_glue_ms / self.kernel_ms


def _cycle(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call per invocation, each on the next copy: every call finds its data cold."""
    state = {"i": 0}

    def next_call() -> object:
        state["i"] = (state["i"] + 1) % len(calls)
        return calls[state["i"]]()
    return next_call


def run_linear_bench(kernels: CpuKernels, shapes: tuple[tuple[int, int], ...] = SHAPES,
                     rows: tuple[int, ...] = ROWS, budget_s: float = 1.0, cold_bytes: int = COLD_BYTES,
                     seed: int = 0) -> list[LinearRow]:
    gen = torch.Generator().manual_seed(seed)
    out: list[LinearRow] = []
    for n, k in shapes:
        copies = max(2, cold_bytes // (n * k * 2))
        weights = [(torch.randn(n, k, generator=gen) * k**-0.5).bfloat16() for _ in range(copies)]
        packed = [Linear(w, None, pack=True) for w in weights]  # oneDNN's packed copy, as served
        for m in rows:
            if m > kernels.small_linear_rows(k):
                continue  # the model sends these to oneDNN
            x = torch.randn(m, k, generator=gen).bfloat16()
            ours = _cycle([lambda w=w: kernels.small_linear(x, w, None) for w in weights])
            theirs = _cycle([lambda p=p: p(x) for p in packed])
            kernel_ms, onednn_ms = best_ms(ours, budget_s), best_ms(theirs, budget_s)
            out.append(LinearRow(m, n, k, onednn_ms, kernel_ms))
        del weights, packed
    return out


def run_decode_attention_bench(kernels: CpuKernels, cases: tuple[tuple[int, int], ...] = ATTENTION,
                               heads: int = 14, kv_heads: int = 2, head_dim: int = 64, layers: int = 24,
                               block_size: int = 16, budget_s: float = 1.0, seed: int = 0) -> list[AttentionRow]:
    """Each layer its own pool region, contexts in shuffled 16-slot blocks as the pool hands
    them out; one call per layer in turn, so every call reads cold KV."""
    gen = torch.Generator().manual_seed(seed)
    out: list[AttentionRow] = []
    for b, ctx in cases:
        blocks = (ctx + block_size - 1) // block_size
        num_slots = b * blocks * block_size
        pools = [(torch.randn(num_slots, kv_heads, head_dim, generator=gen).bfloat16(),
                  torch.randn(num_slots, kv_heads, head_dim, generator=gen).bfloat16()) for _ in range(layers)]
        order = torch.randperm(b * blocks, generator=gen)
        slots = (order.view(b, blocks, 1) * block_size + torch.arange(block_size)).view(b, -1)[:, :ctx].contiguous()
        lengths = torch.full((b,), ctx, dtype=torch.long)
        q = torch.randn(b, heads, head_dim, generator=gen).bfloat16()
        scale = head_dim**-0.5
        loop = _cycle([lambda kv=kv: kernels.module.decode_attention(q, kv[0], kv[1], slots, lengths, scale)
                       for kv in pools])
        tiles = _cycle([lambda kv=kv: kernels.module.decode_attention_bf16(q, kv[0], kv[1], slots, lengths, scale)
                        for kv in pools])
        loop_ms, tiles_ms = best_ms(loop, budget_s), best_ms(tiles, budget_s)
        out.append(AttentionRow(b, ctx, loop_ms, tiles_ms))
        del pools
    return out


def run_step_bench(model: str = "qwen2.5-coder-0.5b", batches: tuple[int, ...] = (1, 2, 4, 8),
                   context: int = 2048, steps: int = 24, repeats: int = 3, seed: int = 1) -> list[StepRow]:
    """The bundled model's decode steps, ms per step: both kernels, the matmul kernel with the
    element-wise steps in torch ops, and neither. Steps are timed as (a run of steps + 1 tokens)
    minus (a run of 1 token) on cached prompts, so the prompt's last-token prefill cancels; the
    three sides alternate within each repeat."""
    from agentserve.api import LLM
    from agentserve.engine.request import SamplingParams

    llm = LLM(model, dtype="bfloat16", kv_cache_memory_gib=1.0, max_model_len=context + steps + 64)
    linears = llm.runner.model.linears()
    rows = [lin.small_rows for lin in linears]
    fused = llm.runner.model.fused_norm_rope

    sides = {"kernel": (True, True), "torch_glue": (True, False), "onednn": (False, False)}

    def use(side: str) -> None:  # the same Linear objects: oneDNN's packed copy is there
        small, glue = sides[side]
        for lin, r in zip(linears, rows):
            lin.small_rows = r if small else 0
        llm.runner.model.fused_norm_rope = glue and fused

    rng = random.Random(seed)
    vocab = llm.model_config.vocab_size  # ids the model takes (any bundled model)
    prompts = [[rng.randrange(vocab // 100, vocab) for _ in range(context)] for _ in range(max(batches))]
    one = SamplingParams(temperature=0, max_tokens=1)
    many = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    llm.generate(prompts, one)  # cache every prompt

    def ms_per_step(batch: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts[:batch], one)
        t1 = time.perf_counter()
        llm.generate(prompts[:batch], many)
        t2 = time.perf_counter()
        return ((t2 - t1) - (t1 - t0)) / steps * 1e3

    out: list[StepRow] = []
    for batch in batches:
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(repeats):
            for side in sides:
                use(side)
                best[side] = min(best[side], ms_per_step(batch))
        use("kernel")
        out.append(StepRow(batch, best["kernel"], best["torch_glue"], best["onednn"]))
    return out
