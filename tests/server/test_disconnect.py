"""A client that goes away aborts its request and frees its blocks, at any moment: streaming
or not, before its first token or mid-generation, even while its body is still arriving.
Over real HTTP (uvicorn on 127.0.0.1), with raw sockets so the moment is exact."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.server.conftest import http_server

pytestmark = pytest.mark.slow
M = "smollm2-135m"


def request_bytes(path: str, body: dict, port: int, cut: int | None = None) -> bytes:
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    return head + (payload if cut is None else payload[:cut])


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def engine_idle(state) -> bool:
    sch = state.llm.engine.scheduler
    return not sch.requests and sch.pool.stats().num_used == 0 and not state.live


def first_token_seen(state) -> bool:
    return any(r.first_token_time is not None for r in state.llm.engine.scheduler.requests.values())


def long_prompt(n: int = 300, salt: str = "") -> str:
    return " ".join([salt, *(f"word{i}" for i in range(n))]).lstrip()


CASES = {
    # (path, body extras, when to hang up)
    "stream-before-first-token": ("/v1/chat/completions", {"stream": True}, "admitted"),
    "stream-mid-generation": ("/v1/chat/completions", {"stream": True}, "generating"),
    "one-shot-before-first-token": ("/v1/chat/completions", {}, "admitted"),
    "one-shot-mid-generation": ("/v1/chat/completions", {}, "generating"),
    "completions-one-shot-mid-generation": ("/v1/completions", {}, "generating"),
    "completions-stream-before-first-token": ("/v1/completions", {"stream": True}, "admitted"),
}


@pytest.mark.parametrize("case", CASES)
def test_disconnect_aborts_and_frees_blocks(smol_llm, case):
    path, extra, when = CASES[case]
    # A prompt of its own: one another case left in the prefix cache would be a one-step prefill,
    # and "before its first token" would be a race with that step.
    prompt = long_prompt(salt=f"{case}:")
    if path == "/v1/chat/completions":
        body = {"model": M, "messages": [{"role": "user", "content": prompt}]}
    else:
        body = {"model": M, "prompt": prompt}
    body |= {"max_tokens": 2000, "min_tokens": 2000, "ignore_eos": True, **extra}
    with http_server(smol_llm) as (url, state):
        port = int(url.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port))
        try:
            sock.sendall(request_bytes(path, body, port))
            def holds_blocks() -> bool:  # (allocated in the step after the engine takes it)
                return state.llm.engine.scheduler.pool.stats().num_used > 0

            if when == "admitted":
                wait_for(lambda: state.llm.engine.scheduler.requests and holds_blocks(),
                         "the request never reached the engine")
                assert not first_token_seen(state)
            else:
                wait_for(lambda: first_token_seen(state), "no token was generated")
                time.sleep(0.3)
                assert holds_blocks()
        finally:
            sock.close()  # (a failed check above then fails alone: the server still drains)
        wait_for(lambda: engine_idle(state), "blocks not freed after the client went away", 20)


def test_disconnect_while_the_body_is_still_arriving(smol_llm):
    body = {"model": M, "messages": [{"role": "user", "content": long_prompt()}], "max_tokens": 5}
    with http_server(smol_llm) as (url, state):
        port = int(url.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(request_bytes("/v1/chat/completions", body, port, cut=100))
        wait_for(lambda: state.admission.num_queued == 1, "the door never saw the request")
        sock.close()
        wait_for(lambda: state.admission.num_queued == 0, "the door kept the slot of a gone client", 10)
        assert engine_idle(state)
