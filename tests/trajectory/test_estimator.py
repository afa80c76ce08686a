"""The return estimator against closed forms: exponential gaps, with and without censoring,
a never-returning mass, the prior, and the bound on classes."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from agentserve.trajectory.estimator import OTHER, Prior, ReturnEstimator

NO_PRIOR = Prior(weight=1e-9, never=0.0)


def test_exponential_gaps_match_the_closed_form():
    e, rng = ReturnEstimator(prior=NO_PRIOR), random.Random(0)
    for _ in range(20_000):
        e.observe_return("tool", rng.expovariate(1 / 20))
    for t in (2.0, 5.0, 20.0, 60.0):
        assert e.survival("tool", t) == pytest.approx(math.exp(-t / 20), abs=0.015)
    # memoryless: P(return within 20 s | waited w) = 1 - e^-1 for any w
    for waited in (0.0, 10.0, 30.0):
        assert e.p_return_within("tool", waited, 20.0) == pytest.approx(1 - math.exp(-1), abs=0.03)
    assert e.quantile("tool", 0.5) == pytest.approx(20 * math.log(2), rel=0.2)


def test_right_censoring_is_not_counted_as_a_return():
    e, naive, rng = ReturnEstimator(prior=NO_PRIOR), ReturnEstimator(prior=NO_PRIOR), random.Random(1)
    for _ in range(20_000):
        gap, left = rng.expovariate(1 / 20), rng.expovariate(1 / 40)
        if gap <= left:
            e.observe_return("x", gap)
            naive.observe_return("x", gap)
        else:
            e.observe_censored("x", left)
    for t in (5.0, 20.0, 40.0):
        assert e.survival("x", t) == pytest.approx(math.exp(-t / 20), abs=0.02)
    # treating only the returns as the distribution underestimates survival badly
    assert naive.survival("x", 20.0) < math.exp(-1) - 0.1


def test_a_mass_that_never_returns_stays_in_the_model():
    e, rng = ReturnEstimator(prior=NO_PRIOR), random.Random(2)
    for _ in range(10_000):
        if rng.random() < 0.3:
            e.observe_censored("x", 80_000.0)  # waited most of a day, never came back
        else:
            e.observe_return("x", rng.uniform(1, 100))
    assert e.never("x") == pytest.approx(0.3, abs=0.02)
    assert e.p_return_within("x", 200.0, 3_600.0) < 0.01  # past every return seen: it will not
    assert e.quantile("x", 0.9) is None  # unreachable with 30% never returning


def test_unseen_classes_use_the_prior_and_classes_are_bounded():
    p = Prior(median_s=30.0, sigma=1.0, never=0.2, weight=4.0)
    e = ReturnEstimator(prior=p, max_classes=4)
    assert 1 - e.survival("new", 30.0) == pytest.approx(0.8 * 0.5, abs=0.03)
    assert e.never("new") == pytest.approx(0.2, abs=1e-9)
    for i in range(100):
        e.observe_return(f"tool{i}", 1.0)
    assert len(e.stats()) == 4 and OTHER in e.stats()
    assert e.stats()[OTHER]["returns"] == 98  # "new", tool0 and tool1 hold the named slots


def test_pauses_still_open_count_as_censored_at_their_wait():
    """Life table with open pauses: 10 returns at 1 s and 90 pauses still open after 100 s
    is the same estimate as 90 censored at 100 s."""
    from agentserve.trajectory.estimator import Prior, ReturnEstimator

    def fresh():
        return ReturnEstimator(prior=Prior(weight=1e-9))

    a, b = fresh(), fresh()
    for _ in range(10):
        a.observe_return("t", 1.0)
        b.observe_return("t", 1.0)
    for _ in range(90):
        b.observe_censored("t", 100.0)
    before = a.p_return_within("t", 0.0, 30.0)
    a.set_open({"t": [100.0] * 90})
    assert abs(a.p_return_within("t", 0.0, 30.0) - b.p_return_within("t", 0.0, 30.0)) < 1e-9
    assert a.p_return_within("t", 0.0, 30.0) < 0.2 < before  # most of them are still out
    a.set_open({})  # they closed (elsewhere): back to the returns alone
    assert abs(a.p_return_within("t", 0.0, 30.0) - before) < 1e-9


def test_the_array_lookups_equal_the_scalar_ones():
    # survival_many / p_return_within_many (the eviction order's sort) against survival /
    # p_return_within, one time at a time: before the grid, on its edges, inside bins, past it.
    rng = random.Random(3)
    e = ReturnEstimator()
    for _ in range(300):
        e.observe_return("tool", rng.lognormvariate(2.0, 2.0))
    for _ in range(60):
        e.observe_censored("tool", rng.lognormvariate(4.0, 1.0))
    grid = list(e.grid)
    times = [0.0, 0.1, grid[0] / 2, *grid[:3], *grid[-2:], grid[-1] * 2, 1e9]
    times += [rng.lognormvariate(2.0, 3.0) for _ in range(200)] + [g * 1.0001 for g in grid[::7]]
    for name in ("tool", "unseen"):  # data, and the prior alone
        many = e.survival_many(name, np.array(times))
        assert many.tolist() == pytest.approx([e.survival(name, t) for t in times], rel=1e-12, abs=1e-14)
        for h in (1.0, 60.0, 5000.0):
            many = e.p_return_within_many(name, np.array(times), h)
            assert many.tolist() == pytest.approx([e.p_return_within(name, t, h) for t in times], rel=1e-9, abs=1e-12)
            # the scalar sorts' loop: the same arithmetic, so equal bit for bit
            assert e.p_return_within_each(name, times, h) == [e.p_return_within(name, t, h) for t in times]
