"""The door: pure ASGI middleware in front of every route, before any request body is read.

- While the engine is failed (it cannot recover; the process is about to exit), every POST
  gets 503 at once.
- A generation request takes a queue slot (server/admission.py) first: past the bound it gets
  429 with Retry-After without its body being read.
- A body over `max_request_body_bytes` gets 413 (from Content-Length at once, else as soon as
  the bytes read pass the bound); one slower than `request_body_timeout_s` gets 408. The body
  is read here, whole, then replayed to the app.
- Every response's status is counted in `agentserve_request_errors` when it is 4xx or 5xx.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from agentserve.server.admission import Overloaded, Slot
from agentserve.server.async_engine import ClientGone
from agentserve.server.errors import APIError

if TYPE_CHECKING:
    from agentserve.server.app import ServerState

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
SLOT_KEY = "agentserve.slot"  # scope key: the generation request's queue slot


def slot_of(scope: Scope) -> Slot | None:
    return scope.get(SLOT_KEY)


class Door:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = self._counting(send)
        if scope["method"] != "POST":
            await self._call(scope, receive, send)
            return
        slot: Slot | None = None
        try:
            failure = self.state.engine_failure()
            if failure is not None:
                raise engine_failed(failure)
            if scope["path"] in GENERATION_PATHS:
                slot = scope[SLOT_KEY] = self.state.enter()
            body = await self._read_body(scope, receive)
        except (APIError, ClientGone) as exc:
            if slot is not None:
                slot.release()
            if isinstance(exc, APIError):
                await _reply(send, exc)
            return
        try:
            await self._call(scope, _replay(body, receive), send)
        finally:
            if slot is not None:
                slot.release()

    async def _call(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception:
            self.state.metrics.errors.labels("500").inc()  # answered by Starlette's 500 handler
            raise

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.state.config.max_request_body_bytes
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(int(length), limit)
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.state.config.request_body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientGone()
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise _too_large(size, limit)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError as exc:
            raise APIError(408, f"the request body took longer than "
                                f"{self.state.config.request_body_timeout_s:g} s to arrive",
                           code="request_timeout") from exc

    def _counting(self, send: Send) -> Send:
        errors = self.state.metrics.errors

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                errors.labels(str(message["status"])).inc()
            await send(message)

        return counted


def overloaded(exc: Overloaded) -> APIError:
    return APIError(429, str(exc), type_="rate_limit_error", code="server_overloaded",
                    headers={"Retry-After": str(exc.retry_after_s)})


def engine_failed(reason: str) -> APIError:
    return APIError(503, f"the engine failed and this server is stopping: {reason}",
                    type_="server_error", code="engine_failed")


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body has {size} bytes or more; this server takes at most "
                         f"{limit} (--max-request-body-bytes)", code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read at the door, then the client's own channel (for its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _reply(send: Send, exc: APIError) -> None:
    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
