"""The memory allocator of the commands that run the model: tcmalloc where it is installed.

A prefill step allocates and frees tens of MB of activations per layer. glibc's malloc serves a
block above its mmap threshold (at most 32 MB, raised only as large blocks are freed) with a
fresh mmap and returns it on free, so each such tensor is faulted in page by page again, every
layer of every step: the fused gate/up output of a 2,048-token chunk of Qwen2.5-0.5B is 40 MB.
tcmalloc keeps freed memory for reuse. Measured on an Intel Xeon with AMX, 2 threads, one
process each (docs/benchmarks.md, "On an Intel Xeon with AMX, again"): a 2,048-token prefill 1.83 -> 1.50 s warm
and 3.63 -> 1.60 s for the first one after start, 8k 634 -> 837 tok/s, 16k 514 -> 575 tok/s.
vLLM's CPU docs ask for the same preload, and its runs in `bench peers` have it.

The library must be loaded before anything allocates, so `serve` and `demo` re-execute
themselves once with LD_PRELOAD set (`reexec_env`). AGENTSERVE_ALLOCATOR=system keeps glibc's;
a library already in LD_PRELOAD (the user's choice) is left alone. Without the library (Debian's
libtcmalloc-minimal4; `make install` asks apt for it) the command runs on glibc's malloc and
says so in its log. Torch-free: this runs before torch is imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

CHOICE = "AGENTSERVE_ALLOCATOR"  # "system": glibc's malloc, no re-exec
DONE = "AGENTSERVE_ALLOCATOR_PRELOADED"  # set in the re-executed process: never twice
COMMANDS = ("serve", "demo")
# Debian's libtcmalloc-minimal4, per architecture
CANDIDATES = tuple(f"/usr/lib/{arch}-linux-gnu/libtcmalloc_minimal.so.4" for arch in ("x86_64", "aarch64"))


def find_tcmalloc(candidates: Sequence[str] = CANDIDATES) -> str | None:
    return next((path for path in candidates if os.path.exists(path)), None)


def reexec_env(env: Mapping[str, str], command: str | None,
               candidates: Sequence[str] = CANDIDATES) -> dict[str, str] | None:
    """The environment to re-execute this command with (tcmalloc preloaded), or None when it
    runs as it is: not a model command, already re-executed, the user chose the system
    allocator, an allocator is already preloaded, or tcmalloc is not installed."""
    if command not in COMMANDS or env.get(DONE) or env.get(CHOICE, "").lower() == "system":
        return None
    preload = env.get("LD_PRELOAD", "")
    if "malloc" in preload:  # tcmalloc, jemalloc, mimalloc: the user's own
        return None
    lib = find_tcmalloc(candidates)
    if lib is None:
        return None
    out = dict(env)
    out["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    out[DONE] = "1"
    return out


def describe(env: Mapping[str, str]) -> str:
    """For the start-up log: which allocator this process runs on."""
    preload = env.get("LD_PRELOAD", "")
    if "tcmalloc" in preload:
        return "tcmalloc (LD_PRELOAD)"
    if "malloc" in preload:
        return f"from LD_PRELOAD ({preload})"
    if env.get(CHOICE, "").lower() == "system":
        return f"glibc malloc ({CHOICE}=system)"
    return "glibc malloc (install Debian's libtcmalloc-minimal4 for faster long prefill: docs/benchmarks.md)"
