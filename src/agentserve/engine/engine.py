"""The engine: add / abort / step over a Scheduler and a Runner.

step() is schedule -> run -> update, then stop strings. It is synchronous; a server drives it
from its own thread.

Faults: a failure that belongs to one request (the runner could not sample its row, its stop
strings could not be checked) ends that request with FinishReason.ERROR and its reason; the
others in the batch go on. An exception that escapes step() means the engine's own state can
no longer be trusted (the forward failed, an invariant broke): the caller must fail every
request and stop using the engine (server/async_engine.py does).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from agentserve.engine.request import (
    FinishReason,
    Request,
    RequestId,
    RequestOutput,
    SamplingParams,
    make_output,
)
from agentserve.engine.detokenize import IncrementalDecoder
from agentserve.engine.scheduler import Batch, Scheduler
from agentserve.engine.tiers import KvTiers
from agentserve.kv.hashing import BlockHash, ExtraKeys, extend_block_hashes
from agentserve.ledger.ledger import Ledger

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class RunResult:
    """A run's sampled token per sampling chunk, except the requests in `failed` (with why),
    whose rows could not be sampled (a row with no allowed token, a grammar error)."""

    sampled: dict[RequestId, int]
    failed: dict[RequestId, str] = field(default_factory=dict)


class Runner(Protocol):
    """Computes a batch and samples: the real model, or a cost model in the simulator."""

    def run(self, batch: Batch) -> RunResult: ...


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
        tiers: KvTiers | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        """tiers: host and disk KV tiers (engine/tiers.py); the scheduler must have been built
        with them as its `lower` tier. ledger: a row per attempt (ledger/ledger.py), told of
        every request's first chunk and end, and of each step's time."""
        assert (tiers is None) == (scheduler.lower is None) or not scheduler.config.enable_prefix_caching
        self.scheduler = scheduler
        self.tiers = tiers
        self.runner = runner
        self.model_id = model_id
        self.vocab_size = vocab_size
        self.clock = clock
        self.detokenizer = detokenizer
        self._ids = itertools.count()
        self._extra_keys: dict[str | None, ExtraKeys] = {}
        self._stop_text: dict[RequestId, IncrementalDecoder] = {}  # requests with stop strings
        self.ledger = ledger
        if ledger is not None:
            ledger.attach(scheduler, tiers)

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
        if sampling.stop:
            assert self.detokenizer is not None
            self._stop_text[rid] = IncrementalDecoder(self.detokenizer.decode)
        return rid

    def _keys(self, cache_salt: str | None) -> ExtraKeys:
        keys = self._extra_keys.get(cache_salt)
        if keys is None:
            keys = self._extra_keys[cache_salt] = ExtraKeys(self.model_id, cache_salt)
        return keys

    def prompt_hashes(self, request_id: RequestId) -> list[BlockHash]:
        """The hashes of a queued request's full prompt blocks (computed now, once: the
        scheduler's prefix match reuses them)."""
        r = self.scheduler.requests[request_id]
        if len(r.block_hashes) < r.num_prompt_tokens // self.scheduler.pool.block_size:
            extend_block_hashes(r.block_hashes, r.token_ids[: r.num_prompt_tokens],
                                self.scheduler.pool.block_size, r.extra_keys)
        return r.block_hashes

    def prompt_hashes_of_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None
                                ) -> list[BlockHash]:
        """The block hashes a prompt of these tokens would have (tests, tools)."""
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, list(token_ids), self.scheduler.pool.block_size, self._keys(cache_salt))
        return hashes

    def abort(self, request_id: RequestId) -> RequestOutput | None:
        """Stop a request now and free its blocks. None if it already finished or is unknown."""
        self._stop_text.pop(request_id, None)
        request = self.scheduler.finish(request_id, FinishReason.ABORT)
        if request is None:
            return None
        self._offload()
        return make_output(request, ())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        tiers = self.tiers
        if tiers is not None:
            tiers.apply_loads(self.scheduler)
        batch = self.scheduler.schedule(self.clock())
        if tiers is not None:
            self._before_run(tiers, batch)
        if not batch.chunks:
            if tiers is not None and tiers.loading and tiers.worker is not None:
                tiers.worker.wake.wait(0.005)  # nothing to run until a disk read ends
            return []
        t0 = self.clock()
        result = self.runner.run(batch)
        elapsed = self.clock() - t0
        if tiers is not None:
            tiers.timed_step(batch.num_tokens, elapsed)
        if self.ledger is not None:
            self.ledger.on_step(batch, elapsed)
        outputs = self.scheduler.update(batch, result.sampled, self.clock(), result.failed)
        outputs = [self._check_stop_strings(o) for o in outputs]
        self._offload()
        return outputs

    def _before_run(self, tiers: KvTiers, batch: Batch) -> None:
        if batch.restores:
            tiers.restore(batch.restores)
        for request in self.scheduler.take_started():
            tiers.on_started(request.block_hashes[: request.num_cached_blocks])

    def _offload(self) -> None:
        """Write through to the lower tiers what the requests that just finished leave cached:
        their trajectories' next turns match it (engine/tiers.py)."""
        for request in self.scheduler.take_finished():
            if self.tiers is not None and request.final_block_hashes:
                self.tiers.offload(request.final_block_hashes, request.extra_keys)

    def _check_stop_strings(self, output: RequestOutput) -> RequestOutput:
        decoder = self._stop_text.get(output.request_id)
        if decoder is None:
            return output
        if output.finished:
            del self._stop_text[output.request_id]
            return output
        request = self.scheduler.requests[output.request_id]
        try:
            stop = _find_stop(decoder, output.new_token_ids, request.sampling.stop)
        except Exception as exc:  # this request's tokens or text: the others go on
            del self._stop_text[output.request_id]
            self.scheduler.finish(request.request_id, FinishReason.ERROR, f"stop-string check failed: {exc!r}")
            return make_output(request, output.new_token_ids)
        if stop is None:
            return output
        del self._stop_text[output.request_id]
        self.scheduler.finish(request.request_id, FinishReason.STOP)
        return replace(make_output(request, output.new_token_ids), matched_stop=stop)


def _find_stop(decoder: IncrementalDecoder, new_token_ids: Sequence[int], stops: Sequence[str]) -> str | None:
    """The stop string that the new ids complete, if any (the earliest in the text). Only text
    that reaches into the new part can hold a new match: earlier text was checked before."""
    old_len = len(decoder.text)
    if not decoder.add(new_token_ids):
        return None
    text = decoder.text
    hits = [(i, s) for s in stops if (i := text.find(s, max(0, old_len - len(s) + 1))) >= 0]
    return min(hits)[1] if hits else None
