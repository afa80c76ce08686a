"""Ledger rows as OpenTelemetry spans, one trace per task (root trajectory).

    task     a root trajectory: its first arrival to the last finish of it and its sub-agents
      turn     one turn: its first attempt's arrival to its last attempt's finish
        attempt  one row: arrival_s to arrival_s + e2e_s
        task     a sub-agent, under the parent turn that began last at or before the sub-agent's
                 first arrival (the turn whose tool calls started it); one that began before
                 every parent turn hangs under the parent's task span

Ids are hashes of the ids in the rows (tenant, trajectory, turn, request, attempt), so exporting
the same ledger again gives the same trace and span ids. The spans are built with the
OpenTelemetry SDK (explicit start and end times) and either written as OTLP/JSON lines (what
the Collector's `otlpjsonfile` receiver reads) or sent with the SDK's OTLP/HTTP exporter.
Attribute names follow the GenAI semantic conventions where one exists (`gen_ai.*`); the rest
are `agentserve.*` (docs/ledger-otel.md lists them).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Tracer, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode

from agentserve import __version__
from agentserve.ledger.cost import TrajectoryRef, ref_of
from agentserve.ledger.rows import TIERS, Outcome, Row

SCOPE = "agentserve.ledger"
JSON_SPANS_PER_LINE = 128  # a line stays well under 1 MiB: line-based file readers cap a line
HTTP_SPANS_PER_REQUEST = 512
_OPERATION = {"chat": "chat", "completions": "text_completion", "offline": "text_completion"}
_MISS_FIELDS = ("reason", "cause", "block", "token", "policy", "evicted_s", "message_index", "role")
Attributes = dict[str, str | bool | int | float | list[str]]


class OtelExportError(RuntimeError):
    """No spans could be exported: the endpoint did not take them (the exporter logged why), or
    the SDK is switched off."""


@dataclass(slots=True)
class _Trajectory:
    ref: TrajectoryRef
    parent: TrajectoryRef | None
    rows: list[Row] = field(default_factory=list)
    children: list[TrajectoryRef] = field(default_factory=list)
    start_ns: int = 0  # itself and every descendant
    end_ns: int = 0


class _PlannedIds(IdGenerator):
    """Hands the tracer the ids planned for the span it starts next, so ids are derived from the
    ledger's ids rather than drawn at random."""

    def __init__(self) -> None:
        self.trace_id = 0
        self.span_id = 0

    def generate_trace_id(self) -> int:
        return self.trace_id

    def generate_span_id(self) -> int:
        return self.span_id


def export_spans(rows: Iterable[Row], *, json_path: str | Path | None = None,
                 endpoint: str | None = None, outcomes: Iterable[Outcome] = (),
                 model: str | None = None, service_name: str = "agentserve",
                 timeout_s: float = 10.0) -> int:
    """Spans for `rows` written to `json_path` (OTLP/JSON lines) and/or sent to `endpoint`
    (OTLP/HTTP protobuf; a URL without a path gets /v1/traces). Returns the spans exported."""
    if json_path is None and endpoint is None:
        raise ValueError("export_spans: give json_path, endpoint or both")
    url = traces_url(endpoint) if endpoint is not None else None
    spans = build_spans(rows, outcomes, model=model, service_name=service_name)
    if json_path is not None:
        write_otlp_json(spans, Path(json_path))
    if url is not None:
        send_otlp_http(spans, url, timeout_s)
    return len(spans)


def traces_url(endpoint: str) -> str:
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"endpoint {endpoint!r}: expected http(s)://HOST:PORT[/v1/traces]")
    return endpoint.rstrip("/") + "/v1/traces" if parts.path in ("", "/") else endpoint


def build_spans(rows: Iterable[Row], outcomes: Iterable[Outcome] = (), *, model: str | None = None,
                service_name: str = "agentserve") -> list[ReadableSpan]:
    """The task -> turn -> attempt spans of every trajectory in `rows`, parents before children."""
    trajs = _trajectories(rows)
    verdicts = {(o.tenant, o.trajectory_id): o.success for o in outcomes}  # the latest wins
    ids = _PlannedIds()
    memory = InMemorySpanExporter()
    provider = TracerProvider(
        sampler=ALWAYS_ON, id_generator=ids, shutdown_on_exit=False,
        resource=Resource({"service.name": service_name, "service.version": __version__}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer(SCOPE, __version__)
    if not isinstance(tracer, Tracer):  # the SDK hands out a no-op tracer when disabled
        raise OtelExportError("the OpenTelemetry SDK is disabled (OTEL_SDK_DISABLED=true): "
                              "unset it to export spans")
    emit = _Emitter(tracer, ids, verdicts, model)
    for root in _roots(trajs):
        trace_id = _id(16, "trace", *root.ref)
        emit.task(trajs, root, trace_id, None, None)
    provider.shutdown()
    return list(memory.get_finished_spans())


def _trajectories(rows: Iterable[Row]) -> dict[TrajectoryRef, _Trajectory]:
    trajs: dict[TrajectoryRef, _Trajectory] = {}
    for row in sorted(rows, key=lambda r: (r.arrival_s, r.request_id, r.turn, r.attempt)):
        ref = ref_of(row)
        t = trajs.get(ref)
        if t is None:
            parent = row.parent_trajectory_id
            t = trajs[ref] = _Trajectory(ref, None if parent is None else (row.tenant, parent),
                                         start_ns=_ns(row.arrival_s))
        t.rows.append(row)
        t.end_ns = max(t.end_ns, _end_ns(row))
    for t in trajs.values():
        if t.parent is not None and t.parent in trajs and t.parent != t.ref:
            trajs[t.parent].children.append(t.ref)
    return trajs


def _roots(trajs: dict[TrajectoryRef, _Trajectory]) -> list[_Trajectory]:
    """Trajectories with no known parent, then (to break a cycle of parent links) the earliest
    not yet reached; each root's descendants get their times folded in."""
    order = [t for t in trajs.values() if t.parent is None or t.parent not in trajs]
    order += [t for t in trajs.values() if t.parent is not None and t.parent in trajs]
    roots, seen = [], set[TrajectoryRef]()
    for t in order:
        if t.ref not in seen:
            roots.append(t)
            _fold_times(trajs, t.ref, seen)
    return roots


def _fold_times(trajs: dict[TrajectoryRef, _Trajectory], ref: TrajectoryRef,
                seen: set[TrajectoryRef]) -> tuple[int, int]:
    seen.add(ref)
    t = trajs[ref]
    t.children = [c for c in t.children if c not in seen]  # a link that closes a cycle is dropped
    for c in t.children:
        start, end = _fold_times(trajs, c, seen)
        t.start_ns, t.end_ns = min(t.start_ns, start), max(t.end_ns, end)
    return t.start_ns, t.end_ns


@dataclass(slots=True)
class _Emitter:
    tracer: Tracer
    ids: _PlannedIds
    verdicts: dict[TrajectoryRef, bool]
    model: str | None
    used: set[int] = field(default_factory=set)  # span ids handed out, to keep duplicates apart

    def task(self, trajs: dict[TrajectoryRef, _Trajectory], t: _Trajectory, trace_id: int,
             parent: SpanContext | None, parent_turn: int | None) -> None:
        turns: dict[int, list[Row]] = {}
        for row in t.rows:
            turns.setdefault(row.turn, []).append(row)
        verdict = self.verdicts.get(t.ref)
        attrs = _task_attributes(t, len(turns), parent_turn, verdict)
        failed = verdict is False
        status = Status(StatusCode.ERROR, "the harness reported failure") if failed else None
        task = self.span("task" if parent is None else "sub-agent", trace_id,
                         self.unique("task", *t.ref), parent, t.start_ns, t.end_ns, attrs, status)
        starts: list[tuple[int, int, SpanContext]] = []  # (turn start, turn, its span)
        for n, attempts in sorted(turns.items(), key=lambda kv: _ns(kv[1][0].arrival_s)):
            start, end = _ns(attempts[0].arrival_s), max(_end_ns(r) for r in attempts)
            turn_id = self.unique("turn", *t.ref, str(n))
            turn = self.span("turn", trace_id, turn_id, task, start, end,
                             _turn_attributes(t, n, attempts))
            starts.append((start, n, turn))
            for row in attempts:
                self.attempt(row, trace_id, turn)
        for c in t.children:
            child = trajs[c]
            placed = [(n, ctx) for start, n, ctx in starts if start <= child.start_ns]
            n, under = placed[-1] if placed else (None, task)
            self.task(trajs, child, trace_id, under, n)

    def attempt(self, row: Row, trace_id: int, parent: SpanContext) -> None:
        op = _OPERATION.get(row.route)
        name = " ".join(x for x in (op or "attempt", self.model) if x)
        failed = row.finish_reason == "error"
        status = Status(StatusCode.ERROR, row.error or "error") if failed else None
        span_id = self.unique("attempt", *ref_of(row), row.request_id, str(row.turn),
                              str(row.attempt))
        self.span(name, trace_id, span_id, parent, _ns(row.arrival_s), _end_ns(row),
                  attempt_attributes(row, op, self.model), status)

    def unique(self, *parts: str) -> int:
        span_id, n = _id(8, *parts), 0
        while span_id in self.used:  # the same attempt twice (a ledger read twice): keep both
            n += 1
            span_id = _id(8, *parts, f"#{n}")
        self.used.add(span_id)
        return span_id

    def span(self, name: str, trace_id: int, span_id: int, parent: SpanContext | None, start: int,
             end: int, attrs: Attributes, status: Status | None = None) -> SpanContext:
        self.ids.trace_id, self.ids.span_id = trace_id, span_id
        ctx = None if parent is None else trace.set_span_in_context(NonRecordingSpan(parent))
        span = self.tracer.start_span(name, context=ctx, start_time=start, attributes=attrs)
        if status is not None:
            span.set_status(status)
        span.end(end_time=max(start, end))
        got = span.get_span_context()
        assert (got.trace_id, got.span_id) == (trace_id, span_id)
        return got


def _task_attributes(t: _Trajectory, num_turns: int, parent_turn: int | None,
                     verdict: bool | None) -> Attributes:
    sessions = sorted({r.session_id for r in t.rows if r.session_id is not None})
    return _clean({
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.conversation.id": sessions[0] if len(sessions) == 1 else None,
        "agentserve.trajectory_id": t.ref[1], "agentserve.tenant": t.ref[0] or None,
        "agentserve.parent_trajectory_id": None if t.parent is None else t.parent[1],
        "agentserve.parent_turn": parent_turn, "agentserve.session_ids": sessions or None,
        "agentserve.num_turns": num_turns, "agentserve.num_attempts": len(t.rows),
        "agentserve.num_sub_agents": len(t.children), "agentserve.outcome.success": verdict})


def _turn_attributes(t: _Trajectory, turn: int, attempts: list[Row]) -> Attributes:
    return _clean({
        "gen_ai.conversation.id": attempts[0].session_id, "agentserve.trajectory_id": t.ref[1],
        "agentserve.turn": turn, "agentserve.num_attempts": len(attempts),
        "agentserve.finish_reason": attempts[-1].finish_reason})


def attempt_attributes(row: Row, operation: str | None, model: str | None) -> Attributes:
    a: dict[str, object] = {
        "gen_ai.operation.name": operation, "gen_ai.request.model": model,
        "gen_ai.response.id": row.request_id, "gen_ai.conversation.id": row.session_id,
        "gen_ai.usage.input_tokens": row.prompt_tokens,  # P: fresh and cached alike
        "gen_ai.usage.cache_read.input_tokens": row.reused_tokens,
        "gen_ai.usage.output_tokens": row.generated_tokens,
        "gen_ai.response.finish_reasons": [row.finish_reason],
        "agentserve.request_id": row.request_id, "agentserve.trajectory_id": row.trajectory_id,
        "agentserve.parent_trajectory_id": row.parent_trajectory_id,
        "agentserve.session_id": row.session_id, "agentserve.tenant": row.tenant or None,
        "agentserve.route": row.route, "agentserve.turn": row.turn,
        "agentserve.attempt": row.attempt,
        "agentserve.finish_reason": row.finish_reason, "agentserve.error": row.error,
        "agentserve.reused_tokens": row.reused_tokens, "agentserve.fresh_tokens": row.fresh_tokens,
        "agentserve.recomputed_tokens": row.recomputed_tokens,
        "agentserve.rebuilt_tokens": row.rebuilt_tokens,
        "agentserve.eligible_tokens": row.eligible_tokens,
        "agentserve.preemptions": row.preemptions}
    for tier in TIERS:
        a[f"agentserve.reused_tokens.{tier}"] = getattr(row, f"reused_{tier}")
    for name in ("queue_s", "prefill_s", "decode_s", "ttft_s", "e2e_s", "busy_s"):
        a[f"agentserve.{name}"] = getattr(row, name)
    for tier, token_s in sorted(row.kv_token_s.items()):
        a[f"agentserve.kv_token_s.{tier}"] = token_s
    if row.miss is not None:  # the text window (old/new) stays out: prompts do not go to tracing
        for name in _MISS_FIELDS:
            a[f"agentserve.miss.{name}"] = getattr(row.miss, name)
        if row.miss.reason == "diverged":
            a["agentserve.miss.exact"] = row.miss.exact
    if row.decision is not None:
        for name in ("action", "p_return", "pause_class", "reason", "policy_version"):
            a[f"agentserve.decision.{name}"] = getattr(row.decision, name)
    return _clean(a)


def _clean(attrs: dict[str, object]) -> Attributes:
    return {k: v for k, v in attrs.items() if v is not None}  # type: ignore[misc]


def write_otlp_json(spans: Sequence[ReadableSpan], path: Path) -> None:
    """OTLP/JSON lines: each line one ExportTraceServiceRequest, ids in hex, enums as integers."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for line in otlp_json_lines(spans):
            f.write(line + "\n")
    os.replace(tmp, path)


def otlp_json_lines(spans: Sequence[ReadableSpan]) -> Iterator[str]:
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    for i in range(0, len(spans), JSON_SPANS_PER_LINE):
        batch = encode_spans(spans[i:i + JSON_SPANS_PER_LINE])
        doc = MessageToDict(batch, use_integers_for_enums=True)
        for rs in doc.get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                for span in ss.get("spans", []):
                    _hex_ids(span)
                    for link in span.get("links", []):
                        _hex_ids(link)
        yield json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


def _hex_ids(obj: dict[str, object]) -> None:
    """Protobuf's JSON mapping writes bytes as base64; OTLP/JSON wants trace and span ids in hex."""
    for key in ("traceId", "spanId", "parentSpanId"):
        if isinstance(value := obj.get(key), str):
            obj[key] = base64.b64decode(value).hex()


def send_otlp_http(spans: Sequence[ReadableSpan], url: str, timeout_s: float) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = OTLPSpanExporter(endpoint=url, timeout=timeout_s)
    try:
        for i in range(0, len(spans), HTTP_SPANS_PER_REQUEST):
            if exporter.export(spans[i:i + HTTP_SPANS_PER_REQUEST]) is not SpanExportResult.SUCCESS:
                raise OtelExportError(f"OTLP/HTTP export to {url} failed after {i} of {len(spans)} "
                                      f"spans (the exporter's log line above says why)")
    finally:
        exporter.shutdown()


def _id(num_bytes: int, *parts: str) -> int:
    digest = hashlib.sha256("\x1f".join(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:num_bytes], "big") or 1  # 0 is the invalid id


def _ns(seconds: float) -> int:
    """Unix seconds to nanoseconds, whole seconds kept exact (a float's 53 bits cannot hold
    1.7e18 ns to the nanosecond)."""
    whole = math.floor(seconds)
    return whole * 1_000_000_000 + round((seconds - whole) * 1e9)


def _end_ns(row: Row) -> int:
    return _ns(row.arrival_s) + round(row.e2e_s * 1e9)
