"""Figures of one run, and their means with 95% Student-t intervals over the repeats.

Per run (one engine, one workload, one repeat): turns per minute, TTFT and JCT (a script's
first request sent to its last response) p50/p99, reused and fresh prompt tokens as the server
reported them, errors; long prompts add prefill tok/s and the cached rerun's seconds.
Across repeats: `interval()`; engines are compared by the ratio of paired repeats (the same
repeat index ran back to back), and one is better when that ratio's interval excludes 1.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from agentserve.bench.peers.client import TurnRecord
from agentserve.sim.metrics import percentile
from agentserve.sim.sweep import t_quantile_975

# metric -> True when higher is better
METRICS: dict[str, bool] = {
    "turns_per_min": True, "ttft_p50_s": False, "ttft_p99_s": False, "jct_p50_s": False,
    "jct_p99_s": False, "prefill_tok_s": True, "rerun_s": False,
}


@dataclass(frozen=True, slots=True)
class Interval:
    mean: float
    half: float  # half-width of the 95% interval (0 for one value, nan for none)
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half

    @property
    def high(self) -> float:
        return self.mean + self.half

    def excludes(self, value: float) -> bool:
        return self.n >= 2 and not (self.low <= value <= self.high)


def interval(values: Sequence[float]) -> Interval:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return Interval(float("nan"), float("nan"), 0)
    m = statistics.fmean(vals)
    if len(vals) < 2:
        return Interval(m, 0.0, 1)
    return Interval(m, t_quantile_975(len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals)), len(vals))


def run_figures(kind: str, wall_s: float, records: Sequence[TurnRecord]) -> dict[str, float]:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    jct: dict[str, float] = {}
    for r in records:
        jct[r.script] = max(jct.get(r.script, 0.0), r.sent_s + r.latency_s)
    first: dict[str, float] = {}
    for r in records:
        first[r.script] = min(first.get(r.script, math.inf), r.sent_s)
    failed = {r.script for r in records if r.error is not None}
    jcts = [jct[s] - first[s] for s in jct if s not in failed]  # a session with a failed turn never completed
    reused = sum(r.cached_tokens or 0 for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    out = {
        "wall_s": wall_s,
        "turns_per_min": 60 * len(ok) / wall_s if wall_s > 0 else float("nan"),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "jct_p50_s": percentile(jcts, 50), "jct_p99_s": percentile(jcts, 99),
        "reused_tokens": float(reused), "fresh_tokens": float(prompt - reused),
        "errors": float(len(records) - len(ok)),
        "unreported": float(sum(1 for r in ok if r.cached_tokens is None)),  # no reuse field came back
        "turns": float(len(ok)),
        "recovered": float(sum(1 for r in ok if r.recovered)),  # llama.cpp turns whose ids needed a re-read
    }
    if kind == "long" and len(ok) == 2:
        out["prefill_tok_s"] = ok[0].prompt_tokens / ok[0].latency_s
        out["rerun_s"] = ok[1].latency_s
    return out


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> Interval:
    """a_i / b_i over the repeats both have."""
    return interval([x / y for x, y in zip(a, b, strict=False) if y and not math.isnan(x) and not math.isnan(y)])


def winner(metric: str, per_engine: dict[str, list[float]]) -> str | None:
    """The engine whose mean is best and whose paired ratio to every other engine excludes 1."""
    higher = METRICS[metric]
    means = {e: interval(v).mean for e, v in per_engine.items() if interval(v).n}
    if len(means) < 2:
        return None
    best = (max if higher else min)(means, key=lambda e: means[e])
    for other in means:
        if other != best and not paired_ratio(per_engine[best], per_engine[other]).excludes(1.0):
            return None
    return best
