"""`agentserve bench grammar`: its statistics exactly, and one tiny run end to end (a real
server subprocess on 127.0.0.1)."""

from __future__ import annotations

import asyncio

import pytest

from agentserve.bench.grammar_bench import GrammarBenchConfig, gaps_in, percentile, run_grammar_bench


def test_percentile_is_nearest_rank():
    xs = [float(x) for x in range(1, 101)]
    assert (percentile(xs, 50), percentile(xs, 99), percentile(xs, 100)) == (50.0, 99.0, 100.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_gaps_are_counted_where_their_later_chunk_lands():
    stamps = [[0.0, 0.1, 0.3, 0.6], [0.05, 0.55]]
    got = gaps_in(stamps, [(0.25, 0.56)])  # chunks at 0.3 (gap 0.2) and 0.55 (gap 0.5); 0.6 is outside
    assert [round(g) for g in got] == [200, 500]
    assert gaps_in(stamps, []) == []


def test_an_unknown_or_incomplete_mode_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="unknown mode.*workr"):
        GrammarBenchConfig(modes=("worker", "workr"))
    with pytest.raises(ValueError, match="--baseline-src"):
        GrammarBenchConfig(modes=("baseline",))


@pytest.mark.slow
def test_one_tiny_round_end_to_end(tmp_path):
    cfg = GrammarBenchConfig(streams=2, rounds=1, quiet_s=0.5, modes=("worker",), port=8741, log_dir=tmp_path)
    (r,) = asyncio.run(run_grammar_bench(cfg))
    assert r.errors == () and r.num_ok == 3
    assert r.cached_fraction > 0.5  # the round's prompt was prefilled, so the window sees the grammar
    assert r.before.num_gaps > 0 and r.control.num_gaps > 0 and r.new.num_gaps > 0 and r.plain.num_gaps > 0
    assert r.door_new_p50_ms > 0 and r.new.p99_ms >= r.new.p50_ms > 0
