"""Planning a run of pure decode steps, so a simulator can take k steps in one call.

A step is pure decode when every running request has its whole prompt computed and samples its
next token, nothing waiting can be admitted, no request finishes and no block is short. Then k
such steps differ only in which blocks are allocated and published, and when: step j allocates
a block for each request whose next position starts a block (in running order), then publishes
each block that the step filled (in running order). `plan_events` lists exactly those
operations in that order, so replaying them gives the pool state k single steps would.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from agentserve.config import SchedulerConfig
from agentserve.engine.request import Request


class DecodeOp(enum.Enum):
    ALLOCATE = 0  # schedule(): a new block for the token about to be computed
    PUBLISH = 1  # update(): a block the step filled enters the prefix cache


# (step, DecodeOp value, index of the request in the running list): sorts into execution order
DecodeEvent = tuple[int, int, int]


def _steps_until(first: int, period: int, num_steps: int) -> range:
    """Steps j in [0, num_steps) with j = first (mod period)."""
    return range(first % period, num_steps, period)


def decode_horizon(
    running: Sequence[Request], num_waiting: int, config: SchedulerConfig, num_free_blocks: int
) -> int:
    """Largest k such that the next k steps are pure decode (module docstring); 0 if none."""
    if not running or len(running) > config.max_num_batched_tokens:
        return 0
    if num_waiting and len(running) < config.max_num_seqs:
        return 0
    k = None
    for r in running:
        if r.num_computed_tokens != r.num_tokens - 1 or r.first_token_time is None:
            return 0
        # a request ends in the step where n_out reaches max_tokens or the context fills up
        left = min(r.sampling.max_tokens - r.num_output_tokens, config.max_model_len - r.num_tokens)
        k = left - 1 if k is None else min(k, left - 1)
    assert k is not None
    return _fit_blocks(running, max(k, 0), config.block_size, num_free_blocks)


def _num_allocations(running: Sequence[Request], k: int, bs: int) -> int:
    return sum(len(_steps_until(-r.num_computed_tokens, bs, k)) for r in running)


def _fit_blocks(running: Sequence[Request], k: int, bs: int, num_free_blocks: int) -> int:
    """Largest k' <= k whose allocations fit in the free blocks (no preemption)."""
    lo, hi = 0, k
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _num_allocations(running, mid, bs) <= num_free_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_events(running: Sequence[Request], num_steps: int, bs: int, publish: bool) -> list[DecodeEvent]:
    """The block operations of num_steps pure decode steps, in the order single steps do them.

    A decode at position p needs a new block when p starts one (p % bs == 0) and fills a block
    when p + 1 ends one; request i computes position num_computed_tokens + j at step j.
    """
    events: list[DecodeEvent] = []
    for i, r in enumerate(running):
        c = r.num_computed_tokens
        assert len(r.block_ids) == -(-c // bs), "a decoding request's blocks cover its computed tokens"
        events.extend((j, DecodeOp.ALLOCATE.value, i) for j in _steps_until(-c, bs, num_steps))
        if publish:
            events.extend((j, DecodeOp.PUBLISH.value, i) for j in _steps_until(-c - 1, bs, num_steps))
    events.sort()
    return events
