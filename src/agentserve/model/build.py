"""Build a ready Runner from a model directory: device, dtype, weights, KV pool size."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentserve.config import CacheConfig
from agentserve.model.attention_bench import AttentionRow, prefill_kernel_wins
from agentserve.model.config import ModelConfig
from agentserve.model.cpu_kernels import CpuKernels, load_cpu_kernels
from agentserve.model.guided import GuidedDecoding
from agentserve.model.loader import load_weights
from agentserve.model.precision import compute_dtype
from agentserve.model.runner import ModelRunner, num_blocks_for_memory
from agentserve.model.transformer import Transformer

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@functools.cache
def _prefill_choice(kernels: CpuKernels, heads: int, kv_heads: int, head_dim: int) -> tuple[bool, AttentionRow]:
    """The start-up measurement, once per process and attention shape: every model of that
    shape built in this process gets the same path (and the same roundings), and a process that
    builds several (tests, benches) measures once."""
    return prefill_kernel_wins(kernels, heads, kv_heads, head_dim)


@dataclass(frozen=True, slots=True)
class BuiltRunner:
    runner: ModelRunner
    num_blocks: int
    device: str


def build_runner(model_dir: Path, config: ModelConfig, dtype: str, device: str | None,
                 cache: CacheConfig, seed: int, tokenizer: Any = None, cpu_kernels: bool = True,
                 compute: str = "auto") -> BuiltRunner:
    """tokenizer enables constrained decoding (its token table is built on first use);
    cpu_kernels builds the C++ decode attention on CPU (torch's SDPA where it cannot be built);
    compute: the activations' dtype (model/precision.py: auto computes bf16 weights in fp32 on a
    CPU without a bf16 dot product)."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    ct = compute_dtype(dt, dev, compute)
    if ct != dt:
        log.info("computing the %s model in %s: this CPU has no bf16 dot product (AVX512-BF16 or AMX); "
                 "weights and KV stay %s (--compute-dtype bfloat16 forces bf16 arithmetic)",
                 dtype, str(ct).removeprefix("torch."), dtype)
    weights = {k: v.to(dev) for k, v in load_weights(model_dir, dt).items()}
    kernels = load_cpu_kernels() if cpu_kernels and dev.type == "cpu" else None
    model = Transformer(config, weights, kernels=kernels, compute_dtype=ct)
    if kernels is not None and ct == torch.bfloat16 and kernels.supports_prefill(ct, config.head_dim):
        wins, row = _prefill_choice(kernels, config.num_heads, config.num_kv_heads, config.head_dim)
        model.bf16_prefill_kernel = wins
        log.info("prefill attention (bf16): %s (%d-row chunk over %d cached: kernel %.2f ms, torch SDPA %.2f ms)",
                 "C++ kernel" if wins else "torch SDPA", row.rows, row.start, row.kernel_ms, row.torch_ms)
    num_blocks = cache.num_blocks or num_blocks_for_memory(config, cache.block_size, cache.memory_gib, dt)
    guided = None if tokenizer is None else GuidedDecoding(tokenizer, config.vocab_size)
    runner = ModelRunner(model, num_blocks, cache.block_size, dt, dev, seed=seed, guided=guided)
    return BuiltRunner(runner=runner, num_blocks=num_blocks, device=str(dev))
