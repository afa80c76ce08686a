"""`serve --bind-threads`: pin the step's OpenMP team to CPUs, one thread per physical core.

The step loop runs on the main thread, which is the team's master; its other members are
libgomp's pool threads. Unpinned, whenever another thread of the machine ran on a core (the
HTTP event loop, a grammar compile, a local client), the kernel could wake a sleeping member on
the master's core, where it waited for the master to reach the op's barrier: that op then ran
serially (csrc/thread_binding.cpp has the perf sched figures). Pinned, a member waits for its own
core only, and only for the other thread's short burst.

Every other thread of the process keeps (or gets back) the whole set of CPUs the process may
use: the event loop and the compile workers go wherever a core is free. Threads the main thread
creates after the binding would inherit its single CPU, so the server starts its threads first
(and llguidance's mask pool is built at warm-up, server/cli.py).

Left alone when the user pins threads (OMP_PROC_BIND, OMP_PLACES, GOMP_CPU_AFFINITY,
KMP_AFFINITY), when the process may use fewer CPUs than the team has threads, off Linux, and
without the C++ kernels. Torch-free: the runner's call does the pinning.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

USER_KEYS = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
SYSFS = Path("/sys/devices/system/cpu")

CoreOf = Callable[[int], tuple[int, int]]  # cpu -> (package, core): siblings share it


@dataclass(frozen=True, slots=True)
class Binding:
    cpus: tuple[int, ...]  # team member t runs on cpus[t]
    team_tids: tuple[int, ...]  # their thread ids (the first is the main thread)
    num_widened: int  # other threads given every allowed CPU again


def sysfs_core_of(cpu: int, root: Path = SYSFS) -> tuple[int, int]:
    """(package, core) of a CPU from sysfs; a CPU whose topology is unreadable is its own core."""
    try:
        topo = root / f"cpu{cpu}" / "topology"
        return int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text())
    except (OSError, ValueError):
        return -1, cpu


def choose_cpus(allowed: set[int], threads: int,
                core_of: CoreOf = sysfs_core_of) -> tuple[int, ...] | None:
    """A CPU for each of `threads` team members: the lowest-numbered CPU of each physical core
    first (cores in order of that CPU), then the cores' second siblings, and so on, so threads
    share a core only when there are more threads than cores. None when fewer CPUs are allowed
    than there are threads (binding would stack two members on one CPU)."""
    if threads < 1 or len(allowed) < threads:
        return None
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(allowed):
        cores.setdefault(core_of(cpu), []).append(cpu)
    groups = list(cores.values())
    order: list[int] = []
    for rank in range(max(len(g) for g in groups)):
        order += [g[rank] for g in groups if rank < len(g)]
    return tuple(order[:threads])


def why_not(env: Mapping[str, str], platform: str = sys.platform) -> str | None:
    """Why serve leaves the threads alone, or None to bind."""
    if platform != "linux":
        return "thread affinity is set this way on Linux only"
    user = [k for k in USER_KEYS if k in env]
    if user:
        return f"{', '.join(user)} set: the user's pinning is kept"
    return None


def bind_team(bind: Callable[[list[int]], list[int] | None], threads: int, env: Mapping[str, str],
              allowed: set[int] | None = None, core_of: CoreOf = sysfs_core_of,
              task_dir: Path = Path("/proc/self/task")) -> Binding | str:
    """Pin the team (through `bind`, the runner's call) and widen every other thread of the
    process to all allowed CPUs. The Binding, or why nothing was pinned."""
    reason = why_not(env)
    if reason is not None:
        return reason
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    cpus = choose_cpus(allowed, threads, core_of)
    if cpus is None:
        return f"{threads} compute threads and {len(allowed)} CPUs allowed: not pinned"
    try:
        tids = bind(list(cpus))
    except (RuntimeError, OSError) as exc:  # advice only: the server runs unpinned rather than not at all
        return f"pinning to CPUs {list(cpus)} failed ({exc}): not pinned"
    if tids is None:
        return ("the compute runs without the C++ CPU kernels (another device, or "
                "--no-cpu-kernels): not pinned")
    if any(t < 0 for t in tids):
        return f"the kernel refused to pin some of the threads to CPUs {list(cpus)}"
    team = set(tids)
    widened = 0
    for name in os.listdir(task_dir):
        tid = int(name)
        if tid in team:
            continue
        try:
            os.sched_setaffinity(tid, allowed)
            widened += 1
        except OSError:  # the thread ended meanwhile
            pass
    return Binding(cpus, tuple(tids), widened)


def describe(result: Binding | str) -> str:
    if isinstance(result, str):
        return f"compute threads: {result}"
    return (f"compute threads pinned: member t on CPU {list(result.cpus)}[t] "
            f"(thread ids {list(result.team_tids)}); {result.num_widened} other threads on every "
            "allowed CPU")
