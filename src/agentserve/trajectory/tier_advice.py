"""Which tier a paused trajectory's KV should wait in: the pool, a lower tier, or none.

At a pause the policy compares, for the trajectory's blocks, three expected costs in seconds of
prefill compute (trajectory/receipts.py's unit):

| action  | what happens                                        | expected cost                       |
|---------|-----------------------------------------------------|-------------------------------------|
| retain  | protected in the pool until it returns              | hold: blocks x E[gap] x device cost |
| offload | its copy below is kept; the pool may drop its own   | P(return) x reload seconds          |
| release | dropped everywhere (its private blocks)             | P(return) x recompute seconds       |

The device cost of a block-second is the pool's current opportunity cost: at the churn the
policy measures (blocks evicted per second), holding one block displaces another block's
residency for the same time, and a displaced block is recomputed when it is hit again
(`reuse_after_eviction` of the time, measured by the pool's tombstones where they exist).
Reload seconds are bytes over the tier's measured bandwidth plus a per-restore overhead;
recompute seconds are tokens over the measured prefill rate. All rates come from the running
engine (`TierRates`), never from constants, once measured; the first figures are from a probe
at start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from agentserve.kv.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class TierRates:
    """What moving and recomputing KV costs on this machine now (measured)."""

    block_nbytes: int
    block_size: int
    prefill_tokens_per_s: float
    reload_bytes_per_s: float  # the slowest tier a returning trajectory reads from (disk if any)
    reload_overhead_s: float = 0.002  # per restore: a worker hand-off, a step
    lower_holds_all: bool = True  # write-through: every paused sequence has a copy below


class TierActions(Protocol):
    """The tiers' side (engine/tiers.py): executed on the engine thread."""

    def rates(self) -> TierRates: ...
    def prefetch(self, hashes: Sequence[BlockHash], tenant: str) -> int: ...
    def release(self, hashes: Sequence[BlockHash], tenant: str) -> int: ...


@dataclass(frozen=True, slots=True)
class TierChoice:
    action: str  # retain | offload | release
    hold_s: float
    reload_s: float
    recompute_s: float

    def reason(self) -> str:
        return (f"expected cost: hold {self.hold_s:.3f} s, reload {self.reload_s:.3f} s, "
                f"recompute {self.recompute_s:.3f} s (prefill-seconds)")


def choose_tier(num_blocks: int, p_return: float, expected_gap_s: float | None, churn_blocks_per_s: float,
                pool_blocks: int, rates: TierRates, reuse_after_eviction: float = 0.5) -> TierChoice:
    """The cheapest of retain / offload / release for `num_blocks` blocks paused now."""
    tokens = num_blocks * rates.block_size
    recompute_block_s = rates.block_size / rates.prefill_tokens_per_s
    gap = expected_gap_s if expected_gap_s is not None else 0.0
    per_block_s = churn_blocks_per_s / max(1, pool_blocks) * reuse_after_eviction * recompute_block_s
    hold = num_blocks * gap * per_block_s
    reload = p_return * (num_blocks * rates.block_nbytes / rates.reload_bytes_per_s + rates.reload_overhead_s)
    recompute = p_return * tokens / rates.prefill_tokens_per_s
    costs = {"retain": hold, "offload": reload, "release": recompute}
    if not rates.lower_holds_all:  # no copy below to fall back on
        del costs["offload"]
    action = min(costs, key=lambda a: (costs[a], ("retain", "offload", "release").index(a)))
    return TierChoice(action, hold, reload, recompute)
