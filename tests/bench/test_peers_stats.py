"""The 95% interval against a hand computation, and the rule that names a row's winner."""

from __future__ import annotations

import math

import pytest

from agentserve.bench.peers.client import TurnRecord
from agentserve.bench.peers.stats import interval, paired_ratio, run_figures, winner


def test_interval_by_hand() -> None:
    # 10, 12, 14: mean 12, sample sd 2, t(0.975, 2) = 4.303 -> 4.303 * 2 / sqrt(3) = 4.9687
    i = interval([10.0, 12.0, 14.0])
    assert i.mean == 12.0 and i.n == 3
    assert i.half == pytest.approx(4.303 * 2 / math.sqrt(3)) and i.half == pytest.approx(4.9687, abs=1e-4)
    assert i.excludes(17.0) and not i.excludes(16.9)
    assert interval([5.0]).half == 0 and not interval([5.0]).excludes(4.0)  # one value proves nothing
    assert interval([]).n == 0


def test_winner_needs_the_paired_ratio_interval_to_exclude_parity() -> None:
    fast, slow = [10.0, 11.0, 10.5], [20.0, 21.0, 20.4]
    assert paired_ratio(fast, slow).excludes(1.0)
    assert winner("jct_p50_s", {"a": fast, "b": slow}) == "a"  # lower is better
    assert winner("turns_per_min", {"a": fast, "b": slow}) == "b"  # higher is better
    assert winner("jct_p50_s", {"a": [10.0, 12.0, 10.0], "b": [11.0, 10.5, 11.0]}) is None
    assert winner("jct_p50_s", {"a": fast, "b": slow, "c": [10.2, 11.1, 10.4]}) is None  # a and c tie


def test_run_figures() -> None:
    recs = [TurnRecord("s0", 1, 0.0, 100, 0, 4, 0.5, 1.0), TurnRecord("s0", 2, 3.0, 150, 96, 4, 0.2, 1.0),
            TurnRecord("s1", 1, 0.0, 100, 64, 4, 0.7, 2.0),
            TurnRecord("s1", 2, 4.0, 150, None, 0, None, 0.1, "HTTP 500: boom")]
    f = run_figures("agent", 6.0, recs)
    assert f["turns_per_min"] == 30.0 and f["errors"] == 1
    assert f["reused_tokens"] == 160 and f["fresh_tokens"] == 350 - 160
    assert f["jct_p50_s"] == pytest.approx(4.0)  # s1's second turn failed: s1 never completed
    long = run_figures("long", 9.0, [TurnRecord("long", 1, 0, 2048, 0, 1, 8.0, 8.0),
                                     TurnRecord("long", 2, 8, 2048, 2032, 16, 0.1, 1.5)])
    assert long["prefill_tok_s"] == 256.0 and long["rerun_s"] == 1.5
