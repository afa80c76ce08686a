"""The compile threads' CPU priority (server/grammars.py): SCHED_IDLE while a job is young,
raised to the configured nice once it has run too long, lowered again for the next job."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from agentserve.server.grammars import WorkerPriority

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="per-thread scheduling is Linux's")


def _policy() -> tuple[int, int]:
    """The calling thread's scheduling policy and nice value (pid 0: this thread on Linux)."""
    return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)


@linux_only
def test_a_job_runs_idle_and_a_promotion_lasts_only_for_that_job():
    priority = WorkerPriority(nice=7, idle=True)
    if not priority.idle:
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE too low)")
    seen: list[tuple[int, int]] = []
    running, promoted = threading.Event(), threading.Event()

    def long_job() -> None:
        seen.append(_policy())
        running.set()
        assert promoted.wait(5)
        seen.append(_policy())

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(priority.run, long_job)
        assert running.wait(5)
        priority.promote()
        promoted.set()
        first.result()
        pool.submit(priority.run, lambda: seen.append(_policy())).result()
        priority.promote()  # nothing running: touches no thread
        outside = pool.submit(_policy).result()  # the same thread, between jobs
    assert seen[0][0] == os.SCHED_IDLE
    assert seen[1] == (os.SCHED_OTHER, 7)
    assert seen[2][0] == os.SCHED_IDLE
    assert outside[0] == os.SCHED_IDLE and priority.num_promoted == 1


@linux_only
def test_without_idle_jobs_run_at_the_nice_value_and_are_never_promoted():
    priority = WorkerPriority(nice=9, idle=False)
    with ThreadPoolExecutor(1) as pool:
        out: list[tuple[int, int]] = []
        pool.submit(priority.run, lambda: out.append(_policy())).result()
        priority.promote()
    assert out == [(os.SCHED_OTHER, 9)] and priority.num_promoted == 0
