"""The ledger's records: one row per generation attempt, one per reported outcome.

A row is what one attempt cost and why: its prompt P, the part reused H by tier (device, host,
disk), the fresh part U = P - H, what it generated O, what it computed again after a
preemption, its times, how it ended, the residency decision that applied to the pause before
it, and the reason its first missed block was missed (ledger/miss.py). Rows are plain data:
the server writes them as JSON lines (format version `FORMAT`), the simulator writes the same
rows, and `agentserve report` reads either (ledger/reader.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

FORMAT = 1
TIERS = ("device", "host", "disk")
REASONS = ("cold", "evicted", "diverged", "identity", "partial_block")


@dataclass(frozen=True, slots=True)
class Miss:
    """Why the first block of a prompt that was not served from cache was missed.

    reason: cold (never computed) | evicted (computed once, gone: `cause` from the pool's
    tombstone, `unknown` once the tombstone is gone) | diverged (the prompt differs from its
    trajectory's previous sequence at token `token`) | identity (the same tokens were cached
    under another model, template or tenant) | partial_block (only the tail below one block).
    """

    reason: str
    block: int  # index of the first block not served
    token: int  # its first token; for `diverged`, the first token that differs
    cause: str | None = None  # evicted: capacity | preemption | protection_expired | ...
    policy: str | None = None  # evicted: the eviction policy that evicted it
    evicted_s: float | None = None  # evicted: when (wall clock, Unix seconds)
    exact: bool = True  # diverged: False when only the block is known (old tokens not kept)
    message_index: int | None = None  # diverged: the message of the new prompt it falls in
    role: str | None = None
    old: str | None = None  # diverged, only with the opt-in text window: text around it
    new: str | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """The residency advice given at the pause this attempt returned from."""

    action: str  # retain | offload | release
    p_return: float
    pause_class: str
    reason: str
    policy_version: str


@dataclass(frozen=True, slots=True)
class Row:
    """One generation attempt (retries, cancelled and aborted attempts are rows too)."""

    request_id: str
    trajectory_id: str | None  # None: a request with no trajectory (offline, or untracked)
    session_id: str | None
    parent_trajectory_id: str | None  # a sub-agent's parent
    tenant: str  # a digest of the tenant (cache salt), never the salt itself; "" for none
    turn: int  # 1-based within its trajectory
    attempt: int  # 1-based within its turn: a retry of the same prompt, or after a failed attempt
    route: str  # chat | completions | offline | sim
    arrival_s: float  # wall clock, Unix seconds
    queue_s: float | None  # arrival -> first scheduled
    prefill_s: float | None  # first scheduled -> first token
    decode_s: float | None  # first token -> finished
    ttft_s: float | None  # arrival -> first token
    e2e_s: float  # arrival -> finished
    busy_s: float  # its share of the engine's step time (each step split by tokens computed)
    prompt_tokens: int  # P
    reused_device: int  # H, by tier
    reused_host: int
    reused_disk: int
    generated_tokens: int  # O
    recomputed_tokens: int  # computed again after preemption
    preemptions: int
    eligible_tokens: int  # of P, in full blocks of its trajectory's previous sequence
    finish_reason: str  # stop | length | abort | error
    error: str | None = None
    decision: Decision | None = None
    miss: Miss | None = None  # None: every full block was served, or it never ran
    kv_token_s: dict[str, float] = field(default_factory=dict)  # KV held for it while paused, by tier
    kind: str = "attempt"

    @property
    def reused_tokens(self) -> int:
        return self.reused_device + self.reused_host + self.reused_disk

    @property
    def fresh_tokens(self) -> int:
        """U = P - H: the prompt tokens this attempt computed (once)."""
        return self.prompt_tokens - self.reused_tokens

    @property
    def rebuilt_tokens(self) -> int:
        """Computed again: eligible (its trajectory had computed them) but not found, plus the
        preemption recompute. Rebuild tax = rebuilt / prefilled (the simulator's definition)."""
        return max(0, self.eligible_tokens - self.reused_tokens) + self.recomputed_tokens

    @property
    def prefilled_tokens(self) -> int:
        return self.fresh_tokens + self.recomputed_tokens

    def as_dict(self) -> dict[str, Any]:
        """The JSON object of a ledger line (by hand: dataclasses.asdict deep-copies, 5x slower)."""
        d = {name: getattr(self, name) for name in _ROW_FIELDS}
        if self.miss is not None:
            d["miss"] = {name: getattr(self.miss, name) for name in _MISS_FIELDS}
        if self.decision is not None:
            d["decision"] = {name: getattr(self.decision, name) for name in _DECISION_FIELDS}
        d["kv_token_s"] = dict(self.kv_token_s)
        d["v"] = FORMAT
        d["fresh_tokens"] = self.fresh_tokens
        return d


_ROW_FIELDS = tuple(f.name for f in fields(Row))
_MISS_FIELDS = tuple(f.name for f in fields(Miss))
_DECISION_FIELDS = tuple(f.name for f in fields(Decision))


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a harness reported about a task (trajectory_finished with success)."""

    trajectory_id: str
    tenant: str
    success: bool
    at_s: float  # wall clock, Unix seconds
    kind: str = "outcome"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["v"] = FORMAT
        return d
