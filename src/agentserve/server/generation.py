"""One request's outputs as text: incremental detokenization, stop-string hold-back, usage."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse

from agentserve.engine.request import RequestOutput
from agentserve.server.async_engine import AsyncEngine, EngineFailure
from agentserve.server.errors import APIError
from agentserve.server.metrics import Metrics


@dataclass(slots=True)
class TextState:
    """Output so far. Invariants: `emitted` is a prefix of the final text; `text` is the
    decoded output without an incomplete UTF-8 tail.

    Detokenization is incremental (as vLLM does it): each step decodes only the ids from
    `_prefix` on, and the new text is what decoding them adds to decoding ids[_prefix:_read].
    Starting both decodes at the same id keeps tokenizers that drop a leading space at a
    sequence start exact; decoding the whole output every step cost O(n) per token."""

    tokenizer: Any
    stop: tuple[str, ...]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    last: RequestOutput | None = None
    _prefix: int = 0
    _read: int = 0

    def add(self, out: RequestOutput) -> tuple[str, list[int]]:
        """Append an output; return the text and ids that can be shown now."""
        self.token_ids.extend(out.new_token_ids)
        self.last = out
        self._detokenize(flush=out.finished)
        if out.finished:
            if out.matched_stop is not None:
                self.text = self.text[: self.text.find(out.matched_stop)]
            safe = len(self.text)
        else:
            hold = max((len(s) for s in self.stop), default=1) - 1  # a stop string may be starting
            safe = max(self.emitted, len(self.text) - hold)
        delta, self.emitted = self.text[self.emitted : safe], safe
        return delta, list(out.new_token_ids)

    def _detokenize(self, flush: bool) -> None:
        ids, decode = self.token_ids, self.tokenizer.decode
        before = decode(ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(ids[self._prefix :], skip_special_tokens=True)
        # an incomplete UTF-8 sequence decodes to U+FFFD: wait for the ids that complete it
        if len(after) > len(before) and (flush or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(ids)


def usage(out: RequestOutput, session_id: str | None) -> dict[str, Any]:
    ttft = None if out.first_token_time is None else (out.first_token_time - out.arrival_time) * 1e3
    queue = None if out.first_scheduled_time is None else (out.first_scheduled_time - out.arrival_time) * 1e3
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_generated_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_generated_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_reused_tokens},
        "agentserve": {
            "reused_tokens": out.num_reused_tokens, "prefilled_tokens": out.num_prefilled_tokens,
            "generated_tokens": out.num_generated_tokens, "recomputed_tokens": out.num_recomputed_tokens,
            "time_to_first_token_ms": ttft, "queue_ms": queue, "session_id": session_id,
        },
    }


FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


async def outputs(engine: AsyncEngine, request_id: str, stream: asyncio.Queue,
                  metrics: Metrics, route: str, is_disconnected: Callable[[], Any] | None = None,
                  ) -> AsyncIterator[RequestOutput]:
    """The request's outputs until it finishes. Aborts it if the consumer goes away (a client
    disconnect cancels this generator) so its blocks are freed at once."""
    finished = False
    last_time: float | None = None
    try:
        while not finished:
            try:
                item = await asyncio.wait_for(stream.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if is_disconnected is not None and await is_disconnected():
                    return
                continue
            if isinstance(item, EngineFailure):
                finished = True
                raise APIError(500, item.message, type_="server_error")
            now = time.monotonic()
            if last_time is not None and item.new_token_ids:
                metrics.itl.observe(now - last_time)
            last_time = now
            finished = item.finished
            if finished:
                metrics.on_finish(route, item, now)
            yield item
    finally:
        if not finished:
            engine.abort(request_id)


def sse(obj: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def streaming(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
