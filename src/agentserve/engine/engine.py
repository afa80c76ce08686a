"""The engine: add / abort / step over a Scheduler and a Runner.

step() is schedule -> run -> update, then stop strings. It is synchronous; a server drives it
from its own thread.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from agentserve.engine.request import (
    FinishReason,
    Request,
    RequestId,
    RequestOutput,
    SamplingParams,
    make_output,
)
from agentserve.engine.scheduler import Batch, Scheduler
from agentserve.kv.hashing import ExtraKeys

Clock = Callable[[], float]


class Runner(Protocol):
    """Computes a batch and samples: the real model, or a cost model in the simulator."""

    def run(self, batch: Batch) -> dict[RequestId, int]: ...


class Detokenizer(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        model_id: str,
        vocab_size: int,
        clock: Clock = time.monotonic,
        detokenizer: Detokenizer | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.model_id = model_id
        self.vocab_size = vocab_size
        self.clock = clock
        self.detokenizer = detokenizer
        self._ids = itertools.count()
        self._extra_keys: dict[str | None, ExtraKeys] = {}

    def add(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestId:
        """Queue a request. Raises ValueError (with the numbers) if it can never run; the
        engine and its other requests are untouched by a rejected one."""
        tokens = list(prompt_token_ids)
        if not tokens:
            raise ValueError("prompt is empty: at least 1 token is needed")
        bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if sampling.stop and self.detokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass stop_token_ids instead")
        rid = RequestId(request_id if request_id is not None else f"req-{next(self._ids)}")
        request = Request(
            request_id=rid,
            token_ids=tokens,
            num_prompt_tokens=len(tokens),
            sampling=sampling,
            extra_keys=self._keys(cache_salt),
            arrival_time=self.clock(),
        )
        self.scheduler.add(request)
        return rid

    def _keys(self, cache_salt: str | None) -> ExtraKeys:
        keys = self._extra_keys.get(cache_salt)
        if keys is None:
            keys = self._extra_keys[cache_salt] = ExtraKeys(self.model_id, cache_salt)
        return keys

    def abort(self, request_id: RequestId) -> RequestOutput | None:
        """Stop a request now and free its blocks. None if it already finished or is unknown."""
        request = self.scheduler.finish(request_id, FinishReason.ABORT)
        return None if request is None else make_output(request, ())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule(self.clock())
        if not batch.chunks:
            return []
        sampled = self.runner.run(batch)
        outputs = self.scheduler.update(batch, sampled, self.clock())
        return [self._check_stop_strings(o) for o in outputs]

    def _check_stop_strings(self, output: RequestOutput) -> RequestOutput:
        request = self.scheduler.requests.get(output.request_id)
        if output.finished or request is None or not request.sampling.stop:
            return output
        assert self.detokenizer is not None
        text = self.detokenizer.decode(request.output_token_ids)
        # Only the tail can hold a new match: earlier text was checked in earlier steps.
        window = len(self.detokenizer.decode(output.new_token_ids)) + max(map(len, request.sampling.stop))
        tail_start = max(0, len(text) - window)
        hits = [(i, s) for s in request.sampling.stop if (i := text.find(s, tail_start)) >= 0]
        if not hits:
            return output
        _, stop = min(hits)
        self.scheduler.finish(request.request_id, FinishReason.STOP)
        return replace(make_output(request, output.new_token_ids), matched_stop=stop)
