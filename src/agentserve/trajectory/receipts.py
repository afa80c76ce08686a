"""Advice at a tool boundary, and the receipt that settles it once the outcome is known.

At every pause the policy records a `CacheAdvice` (what it decided and why). When the
trajectory comes back, or leaves without coming back (finished, cancelled, expired), a
`DecisionReceipt` records what happened to its blocks and what the decision cost.

One unit for every cost: **seconds of prefill compute**. Recomputing a token costs
1 / prefill_tokens_per_s; holding one token of KV idle for one second costs
1 / (prefill_tokens_per_s x hold_break_even_s), i.e. holding a token for `hold_break_even_s`
costs as much as computing it again. The regret of a decision is what it cost beyond the
alternative (retain <-> release at the pause), floored at zero:
- retain: cost = recomputed tokens (those evicted anyway) + the idle token-seconds held;
  alternative = release at once: every block recomputed if it returns, nothing held.
- release: cost = every block recomputed if it returns; alternative = hold them all until then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

POLICY_VERSION = "agent-ev-1"


@dataclass(frozen=True, slots=True)
class CostRates:
    prefill_tokens_per_s: float = 2_000.0  # this machine, SmolLM2-135M bf16 (docs/residency.md)
    hold_break_even_s: float = 600.0

    def recompute_s(self, tokens: float) -> float:
        return tokens / self.prefill_tokens_per_s

    def hold_s(self, token_seconds: float) -> float:
        return token_seconds / (self.prefill_tokens_per_s * self.hold_break_even_s)


@dataclass(frozen=True, slots=True)
class CacheAdvice:
    """What the policy decided for a trajectory at a tool boundary (recorded; it acts through
    the eviction order, and with KV tiers through offload, prefetch and release)."""

    action: str  # retain | offload (with KV tiers: its copy below is kept) | release
    expected_value: float  # blocks expected to be reused
    p_return: float  # P(return within the horizon)
    ttl_ms: int  # protection ends after this long paused
    reason: str
    at_s: float  # when it was given (the pause)
    pause_class: str
    blocks: int
    predicted_p50_s: float | None  # the class's median gap at the pause; None: most never return
    samples: int = 0  # the class's pauses observed before this one (the prediction's evidence)
    policy_version: str = POLICY_VERSION

    def as_dict(self) -> dict[str, object]:
        return {"action": self.action, "expected_value": round(self.expected_value, 3),
                "p_return": round(self.p_return, 4), "ttl_ms": self.ttl_ms, "reason": self.reason,
                "at": self.at_s, "class": self.pause_class, "blocks": self.blocks,
                "predicted_p50_s": self.predicted_p50_s, "samples": self.samples,
                "policy_version": self.policy_version}


@dataclass(frozen=True, slots=True)
class DecisionReceipt:
    trajectory_id: str
    advice: CacheAdvice
    outcome: str  # returned | finished | cancelled | expired | dropped
    gap_s: float  # pause to return, or to leaving (censored)
    cdf_at_gap: float  # P(gap <= realized) predicted at the pause: uniform when calibrated
    log_error: float | None  # ln(realized / predicted median), for returns with a median
    blocks: int
    resident_blocks: int  # its leading blocks still cached when it returned (or left)
    resident_tokens: int
    recomputed_tokens: int  # tokens its return had to compute again (0 if it never returned)
    first_eviction_after_s: float | None  # pause to its first evicted block, from tombstones
    evicted_by: str | None  # the policy that evicted it
    held_token_s: float  # idle KV held for it, token-seconds
    cost_s: float
    alternative_cost_s: float
    regret_s: float

    @property
    def returned(self) -> bool:
        return self.outcome == "returned"

    def as_dict(self) -> dict[str, object]:
        return {"trajectory_id": self.trajectory_id, "advice": self.advice.as_dict(), "outcome": self.outcome,
                "gap_s": round(self.gap_s, 3), "cdf_at_gap": round(self.cdf_at_gap, 4),
                "log_error": None if self.log_error is None else round(self.log_error, 4),
                "blocks": self.blocks, "resident_blocks": self.resident_blocks,
                "resident_tokens": self.resident_tokens,
                "recomputed_tokens": self.recomputed_tokens,
                "first_eviction_after_s": self.first_eviction_after_s, "evicted_by": self.evicted_by,
                "held_token_s": round(self.held_token_s, 1), "cost_s": round(self.cost_s, 6),
                "alternative_cost_s": round(self.alternative_cost_s, 6), "regret_s": round(self.regret_s, 6)}


def settle(trajectory_id: str, advice: CacheAdvice, outcome: str, gap_s: float, cdf_at_gap: float,
           resident_blocks: int, evictions_after_s: list[tuple[float, str]], block_size: int,
           rates: CostRates) -> DecisionReceipt:
    """The receipt of one pause. evictions_after_s: (pause to eviction, policy) for each of
    its blocks that was evicted during the pause (tombstones)."""
    returned = outcome == "returned"
    n, bs = advice.blocks, block_size
    recomputed = (n - resident_blocks) * bs if returned else 0
    # each block is held until it was evicted, or for the whole gap
    evicted = sorted(evictions_after_s)
    held = bs * (sum(min(gap_s, max(0.0, t)) for t, _ in evicted) + (n - len(evicted)) * gap_s)
    cost = rates.recompute_s(recomputed) + rates.hold_s(held)
    if advice.action == "retain":  # the alternative: released at once, all of it recomputed
        alternative = rates.recompute_s(n * bs) if returned else 0.0
    else:  # the alternative: all of it held until then, nothing recomputed
        alternative = rates.hold_s(n * bs * gap_s)
    p50 = advice.predicted_p50_s
    log_error = math.log(max(gap_s, 1e-3) / p50) if returned and p50 else None
    return DecisionReceipt(
        trajectory_id, advice, outcome, gap_s, cdf_at_gap, log_error, n, resident_blocks, resident_blocks * bs,
        recomputed,
        evicted[0][0] if evicted else None, evicted[0][1] if evicted else None, held, cost, alternative,
        max(0.0, cost - alternative))
