"""Prediction-quality scoring (sim/prediction.py) on hand-made pauses with known answers."""

from __future__ import annotations

import math

from agentserve.sim.prediction import Snapshots, quality
from agentserve.trajectory.receipts import CacheAdvice, CostRates, settle
from agentserve.trajectory.registry import TrajectoryKey


def receipt(tid: str, start: float, gap: float, returned: bool, samples: int, p50: float = 10.0):
    advice = CacheAdvice("retain", 1.0, 0.5, 1000, "", start, "tool", 4, p50, samples)
    return settle(tid, advice, "returned" if returned else "expired", gap, 0.5, 4, [], 16, CostRates())


def test_order_accuracy_and_log_error_by_samples():
    # a (paused at 0, back at 5) and b (paused at 1, back at 30): a returns first
    a, b = receipt("a", 0.0, 5.0, True, 3), receipt("b", 1.0, 29.0, True, 3)
    # c (paused at 100, never back) and d (paused at 101, back at 102): d first
    c, d = receipt("c", 100.0, 500.0, False, 50), receipt("d", 101.0, 1.0, True, 50)
    snaps = Snapshots()
    ka, kb, kc, kd = (TrajectoryKey("", x) for x in "abcd")
    snaps(kb, 1.0, [(ka, (0.9, 0.0)), (kb, (0.5, 1.0))])  # a ranked above b: right
    snaps(kd, 101.0, [(kc, (0.9, 100.0)), (kd, (0.1, 101.0))])  # c ranked above d: wrong
    rows = {q.samples: q for q in quality([a, b, c, d], snaps)}
    assert rows["0-9"].order_pairs == 1 and rows["0-9"].order_accuracy == 1.0
    assert rows["10-99"].order_pairs == 1 and rows["10-99"].order_accuracy == 0.0
    # |ln(5/10)| and |ln(29/10)|: median of the two

    assert abs(rows["0-9"].median_abs_log_error - (math.log(2) + math.log(2.9)) / 2) < 1e-9
    assert rows["10-99"].returns == 1 and rows["10-99"].pauses == 2
