"""Optional C++ kernels for the CPU forward, compiled once per machine by torch's extension
builder (g++ and ninja; ~30 s the first time, cached under ~/.cache/torch_extensions).

Why a kernel: a decode step's attention over the paged pool, done with torch ops, gathers
every context into a new tensor and then calls SDPA, per layer. `csrc/decode_attention.cpp`
reads the K/V rows in place by slot. Anything that stops the build (no compiler, a build
error) leaves the torch path in use; the two are tested against each other and against an
fp64 reference. `LLM(cpu_kernels=False)` / `agentserve serve --no-cpu-kernels` turn it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
HEAD_DIMS = (16, 32, 64, 128)  # compiled in; other head sizes use the torch path
# -fopenmp at compile time only: at::parallel_for's pragmas then bind, when the module loads,
# to the OpenMP runtime torch already loaded (one thread pool, not two).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


@dataclass(frozen=True, slots=True)
class CpuKernels:
    module: Any

    def supports(self, head_dim: int) -> bool:
        return head_dim in HEAD_DIMS

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [B, heads, dim]; caches: [slots, kv_heads, dim]; slots: [B, L]; lengths: [B]."""
        return self.module.decode_attention(q.contiguous(), k_cache, v_cache, slots, lengths, scale)


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


def _stable_copy(name: str, source: bytes) -> Path:
    """The source at a path named by its content: torch's build file records the source's
    path, so building from each checkout's own copy rebuilt the cached module in turn."""
    from torch.utils.cpp_extension import _get_build_directory

    path = Path(_get_build_directory(name, verbose=False)) / "src" / SOURCE.name
    if not path.is_file() or path.read_bytes() != source:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(source)
        tmp.replace(path)  # atomic: another process building at once never reads half a file
    return path


def load_cpu_kernels() -> CpuKernels | None:
    """The compiled kernels, or None (logged) where they cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        # a process-wide change, made only here: torch's builder has no other way to find ninja
        os.environ["PATH"] = path_with_ninja(os.environ.get("PATH", ""))

        source = SOURCE.read_bytes()
        key = source + _cpu_tag() + torch.__version__.encode() + " ".join(CFLAGS).encode()
        name = f"agentserve_cpu_{hashlib.sha256(key).hexdigest()[:12]}"
        module = load(name=name, sources=[str(_stable_copy(name, source))], extra_cflags=CFLAGS,
                      verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: the torch path still works
        log.warning("C++ decode attention unavailable (%s: %s); using torch's SDPA", type(exc).__name__, exc)
        return None
    return CpuKernels(module)
