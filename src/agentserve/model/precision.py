"""The dtype a model computes in, given the dtype its weights and KV cache are kept in.

A bf16 model on a CPU without a bf16 dot product (x86 without AVX512-BF16 or AMX: AMD Zen 2
and 3, most client CPUs) is computed in fp32 with its weights and KV cache kept in bf16. There
torch's bf16 matmul is emulated: ~20 GFLOP/s on the 2-core AMD EPYC (Zen 3) it was measured on,
against ~160 for fp32, so prefill ran 4.5x slower and a decode step at 8 rows 10x slower than
the same model in fp32 (docs/benchmarks.md, "CPUs without a bf16 dot product"). Keeping the
storage in bf16 keeps what bf16 is for: half the bytes a decode step reads, and twice the
tokens a KV pool of a given size holds.

The choice comes from the CPU's flags, never from a timing, so a restarted server computes the
same KV bits and its disk tier stays valid (the compute dtype is part of the cache identity).
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the model, not with the CLI's argument parser (omp_env.py)
    import torch

CHOICES = ("auto", "bfloat16", "float32")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # x86 flags in /proc/cpuinfo


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first CPU's feature flags (x86 'flags', Arm 'Features'); empty if unreadable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_native_bf16(flags: frozenset[str] | None = None, machine: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 natively: AVX512-BF16 or AMX on x86, the BF16
    extension on Arm. Other architectures are taken at their word (bf16 as asked)."""
    flags = cpu_flags() if flags is None else flags
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64", "i686", "i386"):
        return bool(flags & NATIVE_BF16_FLAGS)
    if machine in ("aarch64", "arm64"):
        return "bf16" in flags
    return True


def compute_dtype(storage: torch.dtype, device: torch.device, choice: str = "auto",
                  native_bf16: bool | None = None) -> torch.dtype:
    """The dtype activations are computed in. `choice`: auto (fp32 for bf16 weights on a CPU
    without a bf16 dot product, else the storage dtype), bfloat16 (the storage dtype, even where
    it is emulated), float32 (fp32 arithmetic over any storage)."""
    import torch

    if choice not in CHOICES:
        raise ValueError(f"compute dtype {choice!r} not supported; use one of {', '.join(CHOICES)}")
    if choice == "float32":
        return torch.float32
    if choice == "bfloat16" and storage != torch.bfloat16:
        raise ValueError(f"compute dtype bfloat16 needs bfloat16 weights (the model is loaded in {storage}); "
                         "use --dtype bfloat16 or --compute-dtype auto")
    if choice == "auto" and storage == torch.bfloat16 and device.type == "cpu":
        native = cpu_has_native_bf16() if native_bf16 is None else native_bf16
        return storage if native else torch.float32
    return storage
