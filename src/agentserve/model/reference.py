"""transformers on the same weights, and the machine's matmul speed: the reference side of
`agentserve bench engine`."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from agentserve.model.build import resolve_dtype


def best_of(n: int, fn: Callable[[], float]) -> float:
    """Fastest of n timings (seconds): the least disturbed by other load on a shared machine."""
    return min(fn() for _ in range(n))


def matmul_gflops(dtype: str, m: int = 1024, k: int = 896, n: int = 4864) -> float:
    """Measured GFLOP/s of one prefill-sized linear layer (x W^T, as the models compute it) in
    dtype: the prefill ceiling's numerator. (A bf16 `a @ b` with b [k, n] took another path on a
    CPU without a bf16 dot product: ~1 GFLOP/s, 134 s for this measurement.)"""
    dt = resolve_dtype(dtype)
    x, w = torch.randn(m, k, dtype=dt), torch.randn(n, k, dtype=dt)
    torch.nn.functional.linear(x, w)

    def once() -> float:
        t = time.perf_counter()
        for _ in range(5):
            torch.nn.functional.linear(x, w)
        return (time.perf_counter() - t) / 5

    return 2 * m * k * n / best_of(3, once) / 1e9


def set_threads(n: int | None) -> int:
    """Use n torch threads (None: leave as is); returns the count in use."""
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


class HFReference:
    """transformers' own model and generate() on a converted model directory."""

    def __init__(self, model_dir: Path, dtype: str) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).to(resolve_dtype(dtype)).eval()

    @torch.inference_mode()
    def prefill_s(self, ids: list[int]) -> float:
        t = time.perf_counter()
        self.model(torch.tensor([ids]), logits_to_keep=1)
        return time.perf_counter() - t

    @torch.inference_mode()
    def generate_s(self, ids: list[int], n: int) -> float:
        t = time.perf_counter()
        self.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)
        return time.perf_counter() - t


def count_parameters(ref: HFReference) -> int:
    return sum(p.numel() for p in ref.model.parameters())
