"""Admission at the door: bounds on the requests and prompt tokens queued ahead of the engine.

A request holds a `Slot` from the moment it reaches the door (before its body is read) until
its first output arrives (it is then running, bounded by the engine's max_num_seqs) or it ends.
So the queue bound also bounds the bodies being read and parsed: a burst past it is refused
before any body is read, and memory stays bounded however large the burst. Used from the event
loop thread only (no locks).
"""

from __future__ import annotations

import math

from agentserve.config import ServerConfig


class Overloaded(Exception):
    """Refused at the door: 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Slot:
    """One request's place in the queue; released once, by `started` or `release`."""

    __slots__ = ("_admission", "num_tokens", "_open")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.num_tokens = 0
        self._open = True

    def started(self, waited_s: float) -> None:
        """The request produced its first output `waited_s` after it arrived: it is running,
        no longer queued."""
        self._admission.observe_wait(waited_s)
        self.release()

    def release(self) -> None:
        if self._open:
            self._open = False
            self._admission._leave(self)


class Admission:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.num_queued = 0
        self.num_queued_tokens = 0
        self._wait_s = 1.0  # moving average of the time a request spends queued

    def enter(self) -> Slot:
        """A request reached the door (its body not read yet). Raises Overloaded."""
        if self.num_queued >= self.config.max_queued_requests:
            self._shed(f"{self.num_queued} requests are queued (the bound is "
                       f"{self.config.max_queued_requests})")
        self.num_queued += 1
        return Slot(self)

    def admit(self, slot: Slot, num_tokens: int) -> None:
        """The request's prompt is known: take its tokens into the queue. Raises Overloaded;
        a request alone in the queue is always admitted."""
        bound = self.config.max_queued_prompt_tokens
        if self.num_queued_tokens and self.num_queued_tokens + num_tokens > bound:
            self._shed(f"{self.num_queued_tokens} prompt tokens are queued; this request brings "
                       f"{num_tokens} (the bound is {bound})")
        slot.num_tokens = num_tokens
        self.num_queued_tokens += num_tokens

    def observe_wait(self, seconds: float) -> None:
        """A request's time from arrival to its first output, for Retry-After."""
        self._wait_s += 0.2 * (seconds - self._wait_s)

    def retry_after_s(self) -> int:
        return max(1, min(60, math.ceil(self._wait_s)))

    def _shed(self, why: str) -> None:
        raise Overloaded(f"server overloaded: {why}; retry later", self.retry_after_s())

    def _leave(self, slot: Slot) -> None:
        self.num_queued -= 1
        self.num_queued_tokens -= slot.num_tokens
        assert self.num_queued >= 0 and self.num_queued_tokens >= 0
