"""Optional C++ kernels for the CPU forward, compiled once per machine by torch's extension
builder (g++ and ninja; ~40 s the first time, cached under ~/.cache/torch_extensions).

Why kernels: attention over the paged pool done with torch ops gathers every context into a
new tensor and then calls SDPA, per layer, with a dense additive mask for a chunk over a cached
prefix. Both kernels read the K/V rows in place by slot:
- `csrc/decode_attention.cpp`: one query token per sequence;
- `csrc/prefill_attention.cpp`: a chunk of query rows, causal over its context, with an
  AVX512-BF16 inner kernel for bf16 where the compiler targets it (torch's SDPA reached ~100
  GFLOP/s here on a 2,048-row chunk over a 16k context; the bf16 matmul ceiling is ~410).
  Decode in bf16 runs through the same micro kernel, each sequence a one-row chunk;
- `csrc/small_linear.cpp`: the few-row bf16 matmuls of decode steps, which are bound by memory
  bandwidth: one sequential weight stream per thread with software prefetch, 1.1-2x oneDNN's
  packed matmul here at 1-8 rows (it keeps a row-major copy of the weights beside oneDNN's);
- `csrc/norm_rope.cpp`: in bf16, the residual add with the RMSNorm after it, RoPE with the
  KV-cache write and the MLP's SiLU(gate) * up, one call each instead of ~35 small torch ops
  a layer, which cost a decode step's few rows far more than their arithmetic;
- `csrc/widened_linear.cpp`: on CPUs without a bf16 dot product (AVX2, where a bf16 model is
  computed in fp32: model/precision.py), the few-row matmuls of decode with fp32 inputs and the
  bf16 weights widened in registers: half the bytes of an fp32 weight, which they are bound by.
Anything that stops the build (no compiler, a build error) leaves the torch path in use; the
kernels are tested against the torch path and against an fp64 reference.
`LLM(cpu_kernels=False)` / `agentserve serve --no-cpu-kernels` turn them off.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "decode_attention.cpp", "prefill_attention.cpp", "small_linear.cpp", "norm_rope.cpp",
           "widened_linear.cpp", "thread_binding.cpp")  # one module
HEAD_DIMS = (16, 32, 64, 128)  # compiled in; other head sizes use the torch path
WIDENED_ROWS = 48  # the widened kernel's limit; more rows go to MKL's fp32 matmul (crossover 48-64 here)
# -fopenmp at compile time only: at::parallel_for's pragmas then bind, when the module loads,
# to the OpenMP runtime torch already loaded (one thread pool, not two).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


@dataclass(frozen=True, slots=True)
class CpuKernels:
    module: Any
    bf16_prefill: bool  # the AVX512-BF16 prefill kernel was compiled (else SDPA is faster for bf16)
    bf16_small_linear: bool  # the AVX512-BF16 few-row linear kernel was compiled
    avx2_widened_linear: bool = False  # widened_linear has its AVX2/FMA body (else plain loops)
    avx2_attention: bool = False  # fp32 prefill attention has its AVX2/FMA kernel (else plain loops)

    def supports(self, head_dim: int) -> bool:
        return head_dim in HEAD_DIMS

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [B, heads, dim]; caches: [slots, kv_heads, dim]; slots: [B, L]; lengths: [B].
        bf16 goes through the prefill micro kernel (one-row chunks; probabilities rounded to
        bf16 for PV, as for prefill), 5-10x the fp32 loop here; fp32 stays exact."""
        if q.dtype == torch.bfloat16 and self.bf16_prefill:
            return self.module.decode_attention_bf16(q.contiguous(), k_cache, v_cache, slots, lengths, scale)
        return self.module.decode_attention(q.contiguous(), k_cache, v_cache, slots, lengths, scale)

    def small_linear_rows(self, k: int) -> int:
        """The most rows the few-row bf16 linear kernel takes for inputs of width k (0: none)."""
        if not self.bf16_small_linear:
            return 0
        return int(self.module.small_linear_rows(k))

    def small_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b in bf16 for x: [rows <= small_linear_rows(K), K], W: [N, K] row-major."""
        return self.module.small_linear_bf16(x, weight, bias)

    def widened_rows(self, k: int) -> int:
        """The most rows worth sending to the widened kernel for inputs of width k (0: none).
        Measured against MKL's fp32 matmul on an fp32 copy of the weight (docs/benchmarks.md,
        "CPUs without a bf16 dot product"): it reads half the bytes, and wins while the step is
        bound by them."""
        return WIDENED_ROWS if self.avx2_widened_linear else 0

    def widened_linear(self, x: torch.Tensor, pairs: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b in fp32 for x: [rows, K] fp32, W: [n, K] bf16 as `pack_pairs` lays it out,
        b: [n] fp32."""
        return self.module.widened_linear(x, pairs, n, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of x: [rows, n] bf16 or fp32 (weight the same), as
        transformer.rms_norm rounds it."""
        return self.module.rms_norm(x, weight, eps)

    def add_rms_norm(self, h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """h += d in place, and returns the RMSNorm of the new h; [rows, n] each, bf16 or fp32."""
        return self.module.add_rms_norm(h, d, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up for gate_up: [rows, 2n] (the fused projections, bf16 or fp32) -> [rows, n]."""
        return self.module.silu_mul(gate_up)

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Rotates the q and k heads of the fused projection qkv ([rows, (q + 2 kv) heads * dim],
        bf16 or fp32) in place, and writes each row's k and v to the caches at slots. Over a
        narrower cache (fp32 over bf16) qkv's k and v are rounded in place to what is stored."""
        self.module.rope_store(qkv, cos, sin, q_heads, kv_heads, slots, k_cache, v_cache)

    def bind_threads(self, cpus: list[int]) -> list[int]:
        """Pin intra-op team member t to cpus[t] (csrc/thread_binding.cpp); each member's thread
        id, -1 where the kernel refused. len(cpus) >= torch.get_num_threads()."""
        return list(self.module.bind_intraop_threads(cpus))

    def supports_prefill(self, dtype: torch.dtype, head_dim: int) -> bool:
        """fp32 always (exact, for tests and fp32 serving); bf16 where the vector kernel exists."""
        return head_dim in HEAD_DIMS and (dtype == torch.float32 or (dtype == torch.bfloat16 and self.bf16_prefill))

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          context_slots: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        """q: [rows, heads, dim] at positions start .. start + rows - 1; context_slots:
        [start + rows] the slots of positions 0 .. start + rows - 1 (the chunk's own included)."""
        return self.module.prefill_attention(q.contiguous(), k_cache, v_cache, context_slots, start, scale)


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """W: [N, K] bf16 -> [ceil(N / 2), K, 2]: rows in pairs, interleaved value by value (an odd N
    padded with a zero row), the layout csrc/widened_linear.cpp reads."""
    n, k = weight.shape
    if n % 2:
        weight = torch.cat([weight, weight.new_zeros(1, k)])
    return weight.view(-1, 2, k).transpose(1, 2).contiguous()


def _cpu_tag() -> bytes:
    """The build uses -march=native: the cached module is keyed on this CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b"unknown"
    return "\n".join([ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]).encode()


def path_with_ninja(path: str) -> str:
    """torch's builder runs `ninja` from PATH; the pinned one lives in this environment's bin
    directory, which is not on PATH when the venv's python is run without activating it."""
    if shutil.which("ninja", path=path) is not None:
        return path
    try:
        import ninja
    except ImportError:
        return path
    return os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


def _stable_copy(name: str, filename: str, source: bytes) -> Path:
    """The source at a path named by its content: torch's build file records the source's
    path, so building from each checkout's own copy rebuilt the cached module in turn."""
    from torch.utils.cpp_extension import _get_build_directory

    path = Path(_get_build_directory(name, verbose=False)) / "src" / filename
    if not path.is_file() or path.read_bytes() != source:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(source)
        tmp.replace(path)  # atomic: another process building at once never reads half a file
    return path


@contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """One builder at a time, under a lock the kernel drops when its holder dies.

    torch's builder serializes with a lock *file* that it deletes when done; a process killed
    mid-build (Ctrl-C on a first start, a benchmark harness stopping a server) leaves the file,
    and every later start then waited on it forever. Every agentserve build takes this flock
    first, so whoever holds it knows a leftover file is stale and removes it."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "agentserve.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_cpu_kernels() -> CpuKernels | None:
    """The compiled kernels, or None (logged) where they cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        # a process-wide change, made only here: torch's builder has no other way to find ninja
        os.environ["PATH"] = path_with_ninja(os.environ.get("PATH", ""))

        sources = {f: (CSRC / f).read_bytes() for f in SOURCES}
        key = b"".join(f.encode() + s for f, s in sources.items())
        key += _cpu_tag() + torch.__version__.encode() + " ".join(CFLAGS).encode()
        name = f"agentserve_cpu_{hashlib.sha256(key).hexdigest()[:12]}"
        paths = [str(_stable_copy(name, f, s)) for f, s in sources.items()]
        with _build_lock(name):
            module = load(name=name, sources=paths, extra_cflags=CFLAGS, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: the torch path still works
        log.warning("C++ attention kernels unavailable (%s: %s); using torch's SDPA", type(exc).__name__, exc)
        return None
    return CpuKernels(module, bool(module.has_bf16_micro_kernel()), bool(module.has_bf16_small_linear()),
                      bool(module.has_avx2_widened_linear()), bool(module.has_avx2_attention()))
