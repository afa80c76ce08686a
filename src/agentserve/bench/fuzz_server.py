"""The server under fuzz: the real app on 127.0.0.1, in this process, on the small model.

Over a real socket (uvicorn on a thread) rather than in-process ASGI, so the fuzzer exercises
what clients meet: HTTP framing and Content-Length, event streams read to the end, connections
closed by a client mid-response. In this process, so that after the run the block pool itself
is read: a leak is an exact block count and `pool.check()` is asserted, not inferred from
/metrics.

Generation is capped at the door by `CapTokens`, an ASGI middleware of the harness (not of the
server): a request whose `max_tokens` is a valid integer above the cap, or absent (chat then
generates up to the rest of the context), is sent on with the cap. Invalid values pass through
untouched, so the server's validation of them is what gets fuzzed.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from agentserve.api import LLM
from agentserve.server.app import ServerState, build_app
from agentserve.server.tool_parsers import get_parser

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


def _valid_count(value: Any) -> bool:
    """A value the server takes as a token count: an integer >= 1, 2.0 included (protocol.py)."""
    if isinstance(value, float) and value.is_integer():
        return value >= 1
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def cap_body(body: Any, cap: int) -> Any | None:
    """`body` with generation capped at `cap` tokens, or None when it needs no change."""
    if not isinstance(body, dict):
        return None
    out = dict(body)
    keys = [k for k in ("max_tokens", "max_completion_tokens") if k in body]
    for k in keys:
        if _valid_count(body[k]) and body[k] > cap:
            out[k] = cap
    if not keys or all(body[k] is None for k in keys):
        out["max_tokens"] = cap
    return None if out == body else out


class CapTokens:
    """ASGI middleware: cap_body on every JSON POST to a generation route."""

    def __init__(self, app: Any, cap: int) -> None:
        self.app, self.cap = app, cap

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message]), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        try:
            capped = cap_body(json.loads(raw), self.cap)
        except (ValueError, RecursionError):  # not JSON: the server's to reject
            capped = None
        if capped is not None:
            raw = json.dumps(capped).encode()
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
        await self.app(scope, _replay([{"type": "http.request", "body": raw, "more_body": False}], receive), send)


def _replay(messages: list[dict[str, Any]], then: Any = None) -> Any:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive


@dataclass(slots=True)
class FuzzServer:
    """The app on a loopback port; `stop()` shuts it down and joins its threads."""

    llm: LLM
    state: ServerState
    url: str
    _server: Any
    _thread: threading.Thread

    @classmethod
    def start(cls, llm: LLM, model_name: str, cap: int) -> FuzzServer:
        import uvicorn

        if llm.runner.guided is not None:
            llm.runner.guided.warm()  # as `agentserve serve` does: not on the first forced call
        state = ServerState(llm=llm, model_name=model_name, tool_parser=get_parser("auto"))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(CapTokens(build_app(state), cap), log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="fuzz-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server under fuzz did not start")
            time.sleep(0.05)
        return cls(llm, state, f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)

    def alive(self, model_name: str) -> bool:
        """The server answers health and still generates."""
        try:
            health = httpx.get(self.url + "/health", timeout=10)
            chat = httpx.post(self.url + "/v1/chat/completions", timeout=120, json={
                "model": model_name, "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 4, "temperature": 0})
        except httpx.HTTPError:
            return False
        return health.status_code == 200 and chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until no request is in flight (aborts of hung-up clients land within a second)."""
        deadline = time.monotonic() + timeout_s
        while self.llm.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
