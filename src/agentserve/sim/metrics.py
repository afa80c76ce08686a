"""Per-request records and the per-run summary row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestRecord:
    session: int
    chain: int
    turn: int
    replica: int
    arrival_s: float
    first_token_s: float
    done_s: float
    prompt_tokens: int
    reused_tokens: int  # prompt tokens served from the prefix cache
    eligible_tokens: int  # prompt tokens an infinite cache could serve, from the workload alone (sim/eligible.py)
    preempt_recomputed_tokens: int  # computed again after a preemption
    generated_tokens: int
    preemptions: int
    host_tokens: int = 0  # of reused_tokens, restored from the host tier
    disk_tokens: int = 0  # ... read from disk

    @property
    def eligible_reused_tokens(self) -> int:
        """Reused within the eligible prefix: a policy cannot score more than the workload offers
        (a hit on a block the plan's order has not computed yet is not credited)."""
        return min(self.reused_tokens, self.eligible_tokens)

    @property
    def rebuilt_tokens(self) -> int:
        """Computed again: eligible but not found, plus preemption recompute."""
        return self.eligible_tokens - self.eligible_reused_tokens + self.preempt_recomputed_tokens

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens + self.preempt_recomputed_tokens


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(records: Sequence[RequestRecord], session_jct: Sequence[float], makespan_s: float,
              busy_s: float, num_replicas: int) -> dict[str, float | int]:
    prompt = sum(r.prompt_tokens for r in records)
    reused = sum(r.reused_tokens for r in records)
    eligible_reused = sum(r.eligible_reused_tokens for r in records)
    eligible = sum(r.eligible_tokens for r in records)
    rebuilt = sum(r.rebuilt_tokens for r in records)
    prefill = sum(r.prefill_tokens for r in records)
    generated = sum(r.generated_tokens for r in records)
    ttft = [r.first_token_s - r.arrival_s for r in records]
    span = max(makespan_s, 1e-9)
    return dict(
        requests=len(records), sessions=len(session_jct), prompt_tokens=prompt, reused_tokens=reused,
        eligible_tokens=eligible, recomputed_tokens=rebuilt, prefill_tokens=prefill,
        generated_tokens=generated, preemptions=sum(r.preemptions for r in records),
        reused_host_tokens=sum(r.host_tokens for r in records),
        reused_disk_tokens=sum(r.disk_tokens for r in records),
        reuse_ratio=eligible_reused / eligible if eligible else 0.0,
        rebuild_tax=rebuilt / prefill if prefill else 0.0,
        jct_p50_s=percentile(session_jct, 50), jct_p95_s=percentile(session_jct, 95),
        jct_p99_s=percentile(session_jct, 99),
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        makespan_s=makespan_s, prompt_tok_per_s=prompt / span, output_tok_per_s=generated / span,
        requests_per_s=len(records) / span, busy_fraction=busy_s / (span * num_replicas),
    )
