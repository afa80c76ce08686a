"""Pinning the step's compute threads (server/thread_binding.py): which CPUs are chosen, when
nothing is pinned, and that every other thread of the process gets all allowed CPUs back."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from agentserve.server.thread_binding import Binding, bind_team, choose_cpus, why_not

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="per-thread affinity is Linux's")


def spread_siblings(cpu: int) -> tuple[int, int]:
    """4 cores of 2 threads, siblings numbered apart (0 and 4 share a core), as on most Linux PCs."""
    return 0, cpu % 4


def adjacent_siblings(cpu: int) -> tuple[int, int]:
    """4 cores of 2 threads, siblings numbered next to each other (0 and 1 share a core)."""
    return 0, cpu // 2


def test_one_cpu_per_core_first_whatever_the_numbering():
    every = set(range(8))
    assert choose_cpus(every, 4, spread_siblings) == (0, 1, 2, 3)
    assert choose_cpus(every, 4, adjacent_siblings) == (0, 2, 4, 6)
    # more threads than cores: the second siblings, in core order
    assert choose_cpus(every, 6, adjacent_siblings) == (0, 2, 4, 6, 1, 3)
    assert choose_cpus(every, 8, spread_siblings) == (0, 1, 2, 3, 4, 5, 6, 7)


def test_only_allowed_cpus_and_never_two_threads_on_one_cpu():
    assert choose_cpus({2, 3, 4, 5}, 2, adjacent_siblings) == (2, 4)
    assert choose_cpus({5, 1}, 2, spread_siblings) == (1, 5)  # one core: its two siblings
    assert choose_cpus({0, 1, 2}, 4, spread_siblings) is None
    assert choose_cpus({0, 1}, 0, spread_siblings) is None


def test_the_users_pinning_and_other_platforms_are_left_alone():
    assert why_not({}, "linux") is None
    for key in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"):
        assert key in (why_not({key: "x"}, "linux") or "")
    assert why_not({}, "darwin") is not None
    assert isinstance(bind_team(lambda cpus: pytest.fail("must not pin"), 2, {"OMP_PROC_BIND": "true"}), str)


def test_no_kernels_or_a_refusal_is_reported_not_raised():
    assert "without the C++ CPU kernels" in bind_team(lambda cpus: None, 1, {}, allowed={0}, core_of=spread_siblings)
    assert "refused" in bind_team(lambda cpus: [-1], 1, {}, allowed={0}, core_of=spread_siblings)

    def broken(cpus: list[int]) -> list[int]:
        raise RuntimeError("no such CPU")

    assert "failed (no such CPU)" in bind_team(broken, 1, {}, allowed={0}, core_of=spread_siblings)
    assert "CPUs allowed" in bind_team(lambda cpus: pytest.fail("must not pin"), 3, {}, allowed={0, 1},
                                       core_of=spread_siblings)


@linux_only
def test_every_thread_outside_the_team_gets_all_allowed_cpus_back():
    allowed = set(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to widen")
    narrowed, release = threading.Event(), threading.Event()
    tid: list[int] = []

    def narrow_thread() -> None:  # as a thread started by a pinned main thread would be
        tid.append(threading.get_native_id())
        os.sched_setaffinity(0, {min(allowed)})
        narrowed.set()
        release.wait(10)

    t = threading.Thread(target=narrow_thread)
    t.start()
    try:
        assert narrowed.wait(10)
        assert os.sched_getaffinity(tid[0]) == {min(allowed)}
        me = threading.get_native_id()
        asked: list[list[int]] = []

        def pin(cpus: list[int]) -> list[int]:  # stands for the kernels' call: the team is this thread
            asked.append(cpus)
            return [me]

        result = bind_team(pin, 1, {}, allowed=allowed)
        assert isinstance(result, Binding) and result.team_tids == (me,) and len(asked) == 1
        assert asked[0][0] in allowed and result.num_widened >= 1
        assert os.sched_getaffinity(tid[0]) == allowed
    finally:
        release.set()
        t.join()
