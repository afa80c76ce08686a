"""A ledger row for tests: every field given, zero or empty unless the test says otherwise."""

from __future__ import annotations

from typing import Any

from agentserve.ledger.rows import Row

T0 = 1_700_000_000  # a Unix time for arrivals (an int: nanosecond times stay exact)


def build_row(request_id: str, trajectory_id: str | None, **over: Any) -> Row:
    fields: dict[str, Any] = dict(
        request_id=request_id, trajectory_id=trajectory_id, session_id=None, parent_trajectory_id=None,
        tenant="", turn=1, attempt=1, route="chat", arrival_s=T0, queue_s=0.0, prefill_s=0.0, decode_s=0.0,
        ttft_s=0.0, e2e_s=0.0, busy_s=0.0, prompt_tokens=0, reused_device=0, reused_host=0, reused_disk=0,
        generated_tokens=0, recomputed_tokens=0, preemptions=0, eligible_tokens=0, finish_reason="stop")
    fields.update(over)
    return Row(**fields)
