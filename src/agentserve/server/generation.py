"""One request in the server: its outputs as text (stop-string hold-back), usage, its lifecycle
(abort on disconnect, errors), SSE."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from agentserve.engine.detokenize import IncrementalDecoder
from agentserve.engine.request import FinishReason, RequestOutput
from agentserve.server.admission import Slot
from agentserve.server.async_engine import AsyncEngine, ClientGone, EngineFailure, RequestStream
from agentserve.server.door import engine_failed
from agentserve.server.errors import APIError
from agentserve.server.metrics import Metrics
from agentserve.trajectory.registry import TrajectoryKey

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class TextState:
    """Output so far. Invariant: `emitted` is a prefix of the final text; a stop string may be
    starting in the text held back."""

    tokenizer: Any
    stop: tuple[str, ...]
    decoder: IncrementalDecoder = field(init=False)
    text: str = ""
    emitted: int = 0
    last: RequestOutput | None = None

    def __post_init__(self) -> None:
        tok = self.tokenizer
        self.decoder = IncrementalDecoder(lambda ids: tok.decode(list(ids), skip_special_tokens=True))

    @property
    def token_ids(self) -> list[int]:
        return self.decoder.token_ids

    def add(self, out: RequestOutput) -> tuple[str, list[int]]:
        """Append an output; return the text and ids that can be shown now."""
        self.last = out
        self.decoder.add(out.new_token_ids, flush=out.finished)
        self.text = self.decoder.text
        if out.finished:
            if out.matched_stop is not None:
                self.text = self.text[: self.text.find(out.matched_stop)]
            safe = len(self.text)
        else:
            hold = max((len(s) for s in self.stop), default=1) - 1  # a stop string may be starting
            safe = max(self.emitted, len(self.text) - hold)
        delta, self.emitted = self.text[self.emitted : safe], safe
        return delta, list(out.new_token_ids)

    def cut(self, end: int) -> None:
        """The server ends the output at `end`: it is complete, as if the model had stopped
        there. (A streamed reply's caller cuts only text that was never shown.)"""
        assert self.last is not None and end <= len(self.text)
        self.text, self.emitted = self.text[:end], min(self.emitted, end)
        self.last = replace(self.last, finished=True, finish_reason=FinishReason.STOP)


def usage(out: RequestOutput, session_id: str | None, trajectory_id: str | None = None,
          cache_receipt: dict[str, Any] | None = None) -> dict[str, Any]:
    ttft = None if out.first_token_time is None else (out.first_token_time - out.arrival_time) * 1e3
    queue = None if out.first_scheduled_time is None else (out.first_scheduled_time - out.arrival_time) * 1e3
    extra = {} if cache_receipt is None else {"cache_receipt": cache_receipt}
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_generated_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_generated_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_reused_tokens},
        "agentserve": {
            "reused_tokens": out.num_reused_tokens, "prefilled_tokens": out.num_prefilled_tokens,
            # where the reused tokens came from: the device pool, the host tier, disk
            "reused_tokens_by_tier": {
                "device": out.num_reused_tokens - out.num_host_tokens - out.num_disk_tokens,
                "host": out.num_host_tokens, "disk": out.num_disk_tokens},
            "generated_tokens": out.num_generated_tokens, "recomputed_tokens": out.num_recomputed_tokens,
            "time_to_first_token_ms": ttft, "queue_ms": queue, "session_id": session_id,
            "trajectory_id": trajectory_id, **extra,
        },
    }


FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


class Generation:
    """One accepted request in the server, from `ServerState.start` to its end.

    Invariant: `close()` runs exactly once per request — in the route's `finally`, or as the
    streaming response's close hook — and, unless the request's last output arrived, aborts
    it in the engine (freeing its blocks at once) whatever the reason: the client went away
    (at any moment, before the first token too), the handler failed or was cancelled, the
    reader stalled. It also gives back the request's queue slot."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: RequestStream, slot: Slot,
                 metrics: Metrics, route: str, on_close: Callable[[Generation], None]) -> None:
        self.engine, self.request_id, self.stream, self.slot = engine, request_id, stream, slot
        self.metrics, self.route = metrics, route
        self._on_close = on_close
        self.finished = False
        self._closed = False
        self.trajectory: TrajectoryKey | None = None  # set by the server when residency tracks it
        self.responded = False  # its response was reported to the residency policy
        self.session_id: str | None = None
        self.ledger_key: tuple[str, str] | None = None  # (tenant, trajectory id) its ledger rows carry

    @property
    def trajectory_id(self) -> str | None:
        return None if self.trajectory is None else self.trajectory.id

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes. Raises APIError when it failed (500 for
        its own fault, 503 when the engine failed) and ClientGone when its reader stalled."""
        last_time: float | None = None
        while not self.finished:
            item = await self.stream.get()  # raises ClientGone once its reader was dropped
            now = time.monotonic()
            if isinstance(item, EngineFailure):
                self.finished = True  # the engine dropped it already
                raise engine_failed(item.reason)
            if last_time is None:
                self.slot.started(now - item.arrival_time)
            elif item.new_token_ids:
                self.metrics.itl.observe(now - last_time)
            last_time = now
            self.finished = item.finished
            if self.finished:
                self.metrics.on_finish(self.route, item, now)
            if item.finish_reason is FinishReason.ERROR:
                raise APIError(500, f"this request failed: {item.error}", type_="server_error",
                               code="request_failed")
            yield item

    def end(self) -> None:
        """The server has what it needs of this request's output: abort it in the engine now
        (its blocks are freed) and read no more. The Generation stays open, its turn going on,
        until close()."""
        if not self.finished:
            self.finished = True
            self.stream.ended = True
            self.engine.abort(self.request_id)

    def drop(self, why: str) -> None:
        """Its reader stalled: abort the request and wake its handler to end."""
        log.warning("%s: %s; aborting it", self.request_id, why)
        self.stream.drop()
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self.engine.abort(self.request_id)
        self.slot.release()
        self._on_close(self)


class Watch(Protocol):
    def cut(self, text: str) -> int | None: ...


async def collect(gen: Generation, text: TextState, watch: Watch | None = None) -> None:
    """The outputs into `text`; a watch may end the request early, at an offset of the text."""
    async for out in gen.outputs():
        text.add(out)
        if watch is not None and not out.finished and (end := watch.cut(text.text)) is not None:
            text.cut(end)
            gen.end()
            return


async def run_one_shot(request: Request, gen: Generation, text: TextState,
                       watch: Watch | None = None) -> Response | None:
    """A non-streaming response's whole output into `text`, closing `gen`; a 499 response to
    return instead when the client went away (nobody is left to read it)."""
    try:
        await until_disconnected(request, collect(gen, text, watch))
    except ClientGone:
        return Response(status_code=499)
    finally:
        gen.close()
    return None


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, or ClientGone as soon as the client disconnects (it is then
    cancelled). For non-streaming responses: nothing is sent until the end, so only the
    ASGI receive channel tells that the client went away."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone()
    finally:
        watch.cancel()
        task.cancel()


async def _disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def sse(obj: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


async def _events(body: AsyncIterator[str]) -> AsyncIterator[str]:
    """A route's SSE events; a failure after the stream started is sent as an OpenAI error
    event, then [DONE] (the status line went out already)."""
    try:
        async for event in body:
            yield event
    except APIError as exc:
        yield sse(exc.body())
        yield DONE
    except ClientGone:
        return


class _GenerationResponse(StreamingResponse):
    """Closes its Generation when the response ends, however it ends (finished, client gone,
    cancelled): Starlette cancels a stream whose client disconnects, possibly before the
    body's first line ran, so the close cannot live inside the body's generator."""

    def __init__(self, body: AsyncIterator[str], generation: Generation) -> None:
        super().__init__(_events(body), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


def streaming(body: AsyncIterator[str], generation: Generation) -> StreamingResponse:
    return _GenerationResponse(body, generation)
