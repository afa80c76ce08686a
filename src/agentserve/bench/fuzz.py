"""`agentserve bench fuzz`: schemathesis against the server's own OpenAPI document.

Every route, in schemathesis' phases: the schema's examples, coverage (each field at its
boundaries, of every wrong JSON type, missing), and hypothesis fuzzing, positive and negative.
The server (fuzz_server.py) runs the small model on 127.0.0.1 with generation capped. The
report counts what was sent and what came back, from the wire (schemathesis' after_call hook),
then checks the server is alive and that the pool holds no block once nothing is in flight.

Checks: not_a_server_error (no 5xx), negative_data_rejection (a body the schema rejects is a
4xx: validation has no gap), status_code/content_type/response_schema conformance (every
response is documented, error bodies included), unsupported_method. Not
positive_data_acceptance: a body the schema accepts may still be refused for what no schema
states (a tool message answering no call, a prompt longer than the context).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

CHECKS = ("not_a_server_error", "negative_data_rejection", "status_code_conformance",
          "content_type_conformance", "response_schema_conformance", "unsupported_method")
OFF = ("positive_data_acceptance", "missing_required_header", "use_after_free", "ensure_resource_availability",
       "ignored_auth", "response_headers_conformance")


@dataclass(frozen=True, slots=True)
class FuzzConfig:
    model: str = "smollm2-135m"
    dtype: str = "float32"
    max_model_len: int = 256  # prompts beyond it are a cheap 400; prefill stays small
    num_kv_blocks: int = 128  # 2048 tokens: several full-context requests at once
    max_tokens: int = 8  # generation cap per request (fuzz_server.CapTokens)
    max_examples: int = 25  # per operation, per phase and generation mode
    seed: int = 0
    max_time_s: int | None = None
    request_timeout_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Exchange:
    """One request as it went on the wire (before the cap), and what came back."""

    method: str
    path: str
    body: str | None
    status: int | None  # None: no response (connection error or timeout)
    response: str
    elapsed_s: float
    cut_off: bool = False  # an event stream that ended without `data: [DONE]`

    def failed(self) -> bool:
        return self.status is None or self.status >= 500 or self.cut_off

    def reproducer(self) -> str:
        status = f"{self.status} (stream cut off before [DONE])" if self.cut_off else self.status
        return f"{self.method} {self.path} {self.body or ''} -> {status}: {self.response}"


@dataclass(frozen=True, slots=True)
class CheckFailure:
    check: str
    title: str
    message: str
    exchange: Exchange | None


@dataclass(frozen=True, slots=True)
class FuzzReport:
    exchanges: tuple[Exchange, ...]
    num_examples: int
    statuses: dict[int, int]  # response status -> count; network errors under 0
    server_errors: tuple[Exchange, ...]  # status >= 500, no response or a cut-off stream
    check_failures: tuple[CheckFailure, ...]  # other checks, deduplicated by check and title
    engine_errors: tuple[str, ...]  # schemathesis could not test something
    alive: bool
    num_leaked_blocks: int  # pool blocks in use after the run with nothing in flight
    pool_ok: bool  # pool.check() held after the run
    wall_s: float

    def ok(self) -> bool:
        return not self.server_errors and self.alive and self.num_leaked_blocks == 0 and self.pool_ok


def _excerpt(content: bytes) -> str:
    text = content.decode("utf-8", "backslashreplace")
    return text if len(text) <= 400 else f"{text[:200]} ... {text[-200:]}"


@dataclass(slots=True)
class _Wire:
    """What the after_call hooks saw (they run on schemathesis' worker threads)."""

    exchanges: list[Exchange] = field(default_factory=list)
    by_case: dict[str, Exchange] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, case_id: str, request: Any, response: Any) -> None:
        """One exchange; `response` None when none came (connection error, timeout)."""
        body = request.body.decode("utf-8", "backslashreplace") if isinstance(request.body, bytes) else request.body
        content = b"(no response)" if response is None else response.content
        cut_off = (response is not None and response.status_code == 200 and not response.stream_cut_short
                   and "text/event-stream" in (response.headers.get("content-type") or [""])[0]
                   and not content.rstrip().endswith(b"data: [DONE]"))
        ex = Exchange(request.method, request.path_url, body, None if response is None else response.status_code,
                      _excerpt(content),
                      0.0 if response is None else response.elapsed, cut_off)
        with self.lock:
            self.exchanges.append(ex)
            self.by_case[case_id] = ex


def _schemathesis_config(config: FuzzConfig, base_url: str) -> Any:
    import schemathesis

    checks: dict[str, Any] = {name: {"enabled": True} for name in CHECKS}
    checks |= {name: {"enabled": False} for name in OFF}
    data: dict[str, Any] = {
        "seed": config.seed, "base-url": base_url, "workers": 1, "request-timeout": config.request_timeout_s,
        "generation": {"max-examples": config.max_examples, "mode": "all"},
        "phases": {"stateful": {"enabled": False}}, "checks": checks, "color": False,
        "suppress-health-check": ["all"], "continue-on-failure": True,
    }
    if config.max_time_s is not None:
        data["max-time"] = config.max_time_s
    return schemathesis.Config.from_dict(data)


def served_schema(url: str, model_name: str) -> dict[str, Any]:
    """The server's OpenAPI document, with `model` narrowed to the served name: most positive
    cases then reach the engine instead of ending in 404 (other names stay a negative case)."""
    import httpx

    doc = httpx.get(url + "/openapi.json", timeout=30).json()
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        doc["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": [model_name]}
    return doc


def run_schemathesis(url: str, model_name: str, config: FuzzConfig
                     ) -> tuple[_Wire, list[CheckFailure], list[str]]:
    import requests
    import schemathesis
    from schemathesis.engine import events

    schema = schemathesis.openapi.from_dict(served_schema(url, model_name),
                                            config=_schemathesis_config(config, url))
    wire = _Wire()

    @schema.hook
    def after_call(context: Any, case: Any, response: Any) -> None:
        wire.record(case.id, response.request, response)

    @schema.hook
    def after_network_error(context: Any, case: Any, request: Any) -> None:
        wire.record(case.id, request, None)

    failures: dict[tuple[str, str, str], CheckFailure] = {}
    errors: list[str] = []
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            for case_id, nodes in event.recorder.checks.items():
                for node in nodes:
                    if node.failure_info is None or node.name == "not_a_server_error":
                        continue  # 5xx are counted from the wire
                    f = node.failure_info.failure
                    key = (node.name, f.operation or "", f.title)
                    failures.setdefault(key, CheckFailure(node.name, f.title, f.message, wire.by_case.get(case_id)))
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            error = getattr(event, "value", None) or getattr(event, "exception", None)
            if not isinstance(error, requests.RequestException):  # those are on the wire, status None
                errors.append(repr(error))
    return wire, list(failures.values()), errors


def run_fuzz(config: FuzzConfig) -> FuzzReport:
    from agentserve.api import LLM
    from agentserve.bench.fuzz_server import FuzzServer

    llm = LLM(config.model, dtype=config.dtype, num_kv_blocks=config.num_kv_blocks,
              max_model_len=config.max_model_len, residency="on")
    started = time.monotonic()
    server = FuzzServer.start(llm, config.model, config.max_tokens)
    pool = llm.engine.scheduler.pool
    try:
        wire, failures, errors = run_schemathesis(server.url, config.model, config)
        answers = server.alive(config.model)
        server.drain()
        stuck = llm.engine.has_unfinished()
        used = pool.stats().num_used  # read while the engine thread idles: nothing is in flight
    finally:
        server.stop()
    try:
        pool.check()  # after the engine thread is joined
        pool_ok = True
    except AssertionError:
        pool_ok = False
    return FuzzReport(
        exchanges=tuple(wire.exchanges), num_examples=len(wire.exchanges),
        statuses=dict(sorted(Counter(ex.status or 0 for ex in wire.exchanges).items())),
        server_errors=tuple(ex for ex in wire.exchanges if ex.failed()), check_failures=tuple(failures), engine_errors=tuple(errors),
        alive=answers and not stuck, num_leaked_blocks=max(used, pool.stats().num_used),
        pool_ok=pool_ok, wall_s=time.monotonic() - started)


def summary(report: FuzzReport) -> dict[str, Any]:
    """The figures: what the issue asks for, then what was found."""
    return {
        "examples": report.num_examples, "responses_5xx": len(report.server_errors),
        "alive": report.alive,
        "leaked_blocks": report.num_leaked_blocks, "pool_check": report.pool_ok,
        "check_failures": len(report.check_failures), "wall_s": round(report.wall_s, 1),
        "statuses": report.statuses,
        "server_errors": [ex.reproducer()[:2000] for ex in report.server_errors[:20]],
        "checks": [f"{f.check}: {f.title}: {f.message[:500]} | {f.exchange.reproducer()[:1000] if f.exchange else ''}"
                   for f in report.check_failures],
        "schemathesis_errors": list(report.engine_errors[:20]),
    }


def render(report: FuzzReport) -> str:
    s = summary(report)
    lines = [f"examples sent {s['examples']}, responses >= 500: {s['responses_5xx']} "
             f"alive after: {s['alive']}, "
             f"KV blocks leaked: {s['leaked_blocks']}, pool.check(): {'holds' if s['pool_check'] else 'FAILS'}, "
             f"other check failures: {s['check_failures']}, {s['wall_s']} s",
             f"statuses: {s['statuses']}"]
    lines += [f"5xx: {x}" for x in s["server_errors"]]
    lines += [f"check: {x}" for x in s["checks"]] + [f"schemathesis: {x}" for x in s["schemathesis_errors"]]
    return "\n".join(lines)
