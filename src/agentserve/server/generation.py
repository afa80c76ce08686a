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
    """Output so far. Invariant: `emitted` is a prefix of the final text."""

    tokenizer: Any
    stop: tuple[str, ...]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> tuple[str, list[int]]:
        """Append an output; return the text and ids that can be shown now."""
        self.token_ids.extend(out.new_token_ids)
        self.last = out
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if out.finished:
            if out.matched_stop is not None:
                text = text[: text.find(out.matched_stop)]
            self.text = text
            safe = len(text)
        else:
            if not text.endswith("\ufffd"):  # an incomplete UTF-8 sequence waits for its rest
                self.text = text
            hold = max((len(s) for s in self.stop), default=1) - 1  # a stop string may be starting
            safe = max(self.emitted, len(self.text) - hold)
        delta, self.emitted = self.text[self.emitted : safe], safe
        return delta, list(out.new_token_ids)


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
