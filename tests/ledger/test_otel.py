"""Ledger rows as OpenTelemetry spans: the task -> turn -> attempt tree with sub-agents placed by
time, times to the nanosecond, attributes, ids that a re-export repeats, the OTLP/JSON file's
shape, an OTLP/HTTP export to a local collector stand-in, and the CLI.

Fleet (tenant "t0"; seconds after T0, all exact in binary):
  task-1  session s1   turn 1: r1 [0, 1] error, r1b [1.25, 2.75] (retry)
                       turn 2: r2 [5, 6]        turn 3: r3 [9, 9.5]
    early   sub-agent  e1 [-1, -0.5]            began before every turn: under the task span
    sub-a   sub-agent  a1 [3, 3.75], a2 [4, 4.5] began after turn 1 began: under turn 1
    sub-b   sub-agent  b1 [6.5, 8.5]            after turn 2 began: under turn 2
      sub-b-1          bb1 [7, 7.5]             under sub-b's turn 1
  task-2  completions  q1 [20, 21]              the harness reported failure
  (none)  solo         s [30, 30.25]            a request with no trajectory: a task of its own
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import ParseDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from agentserve.cli import main
from agentserve.ledger.otel import OtelExportError, build_spans, export_spans, traces_url
from tests.ledger.rows import T0, build_row
from agentserve.ledger.rows import Decision, Miss, Outcome, Row

NS = 1_000_000_000


def ns(offset_s: float) -> int:
    return T0 * NS + round(offset_s * NS)


def row(request_id: str, trajectory_id: str | None, turn: int, at: float, e2e: float, *,
        attempt: int = 1, parent: str | None = None, session: str | None = "s1",
        **over: Any) -> Row:
    return build_row(request_id, trajectory_id, session_id=session, parent_trajectory_id=parent,
                     turn=turn, attempt=attempt, arrival_s=T0 + at, e2e_s=e2e,
                     **{**dict(tenant="t0", queue_s=0.125, prefill_s=0.25, decode_s=0.5, ttft_s=0.375, busy_s=0.5, prompt_tokens=100, generated_tokens=10), **over})


def fleet() -> list[Row]:
    return [
        row("r1", "task-1", 1, 0.0, 1.0, finish_reason="error", error="engine crashed"),
        row("r1b", "task-1", 1, 1.25, 1.5, attempt=2, prompt_tokens=1000, reused_device=512,
            reused_host=256, reused_disk=64, generated_tokens=42, recomputed_tokens=16,
            preemptions=1, eligible_tokens=960,
            miss=Miss("evicted", 52, 832, cause="capacity", policy="lru", evicted_s=T0 + 0.5),
            decision=Decision("offload", 0.75, "tool", "short tool pause", "v3"),
            kv_token_s={"device": 12.5, "host": 100.0}),
        row("r2", "task-1", 2, 5.0, 1.0),
        row("r3", "task-1", 3, 9.0, 0.5, miss=Miss("diverged", 3, 50, exact=False, message_index=2)),
        row("e1", "early", 1, -1.0, 0.5, parent="task-1"),
        row("a1", "sub-a", 1, 3.0, 0.75, parent="task-1", session="s2"),
        row("a2", "sub-a", 2, 4.0, 0.5, parent="task-1", session="s2"),
        row("b1", "sub-b", 1, 6.5, 2.0, parent="task-1"),
        row("bb1", "sub-b-1", 1, 7.0, 0.5, parent="sub-b"),
        row("q1", "task-2", 1, 20.0, 1.0, route="completions", session=None),
        row("s", None, 1, 30.0, 0.25, route="sim", session=None),
    ]


OUTCOMES = [Outcome("task-1", "t0", True, T0 + 10.0), Outcome("task-2", "t0", False, T0 + 22.0)]


class Tree:
    """The spans by what they stand for."""

    def __init__(self, spans: list[ReadableSpan]) -> None:
        self.spans = spans
        self.by_id = {s.context.span_id: s for s in spans}
        assert len(self.by_id) == len(spans)  # no id handed out twice

    def attempt(self, request_id: str) -> ReadableSpan:
        [s] = [s for s in self.spans if s.attributes.get("agentserve.request_id") == request_id]
        return s

    def task(self, trajectory_id: str) -> ReadableSpan:
        [s] = [s for s in self.spans if s.name in ("task", "sub-agent")
               and s.attributes["agentserve.trajectory_id"] == trajectory_id]
        return s

    def turn(self, trajectory_id: str, turn: int) -> ReadableSpan:
        [s] = [s for s in self.spans if s.name == "turn" and s.attributes["agentserve.turn"] == turn
               and s.attributes["agentserve.trajectory_id"] == trajectory_id]
        return s

    def parent(self, span: ReadableSpan) -> ReadableSpan | None:
        return None if span.parent is None else self.by_id[span.parent.span_id]


@pytest.fixture
def tree() -> Tree:
    return Tree(build_spans(fleet(), OUTCOMES, model="qwen"))


def test_span_tree(tree: Tree) -> None:
    # 7 trajectories (task spans) + 10 turns (task-1 3, sub-a 2, five others 1) + 11 attempts
    assert len(tree.spans) == 7 + 10 + 11
    root = tree.task("task-1")
    assert root.name == "task" and tree.parent(root) is None
    for n in (1, 2, 3):
        assert tree.parent(tree.turn("task-1", n)) is root
    assert tree.parent(tree.attempt("r1")) is tree.turn("task-1", 1)
    assert tree.parent(tree.attempt("r1b")) is tree.turn("task-1", 1)
    assert tree.parent(tree.attempt("r3")) is tree.turn("task-1", 3)
    # sub-agents: under the parent turn that began last before them, else under the task
    assert tree.parent(tree.task("sub-a")) is tree.turn("task-1", 1)
    assert tree.parent(tree.task("sub-b")) is tree.turn("task-1", 2)
    assert tree.parent(tree.task("early")) is root
    assert tree.parent(tree.task("sub-b-1")) is tree.turn("sub-b", 1)
    assert tree.parent(tree.attempt("a2")) is tree.turn("sub-a", 2)
    assert tree.parent(tree.attempt("bb1")) is tree.turn("sub-b-1", 1)
    assert tree.task("sub-a").name == "sub-agent"
    assert tree.task("sub-a").attributes["agentserve.parent_turn"] == 1
    assert tree.task("sub-b").attributes["agentserve.parent_turn"] == 2
    assert "agentserve.parent_turn" not in tree.task("early").attributes
    # one trace per task: every sub-agent's spans share their root's trace
    family = ("task-1", "early", "sub-a", "sub-b", "sub-b-1")
    assert {tree.task(t).context.trace_id for t in family} == {root.context.trace_id}
    traces = {tree.task(t).context.trace_id for t in ("task-1", "task-2", "request:s")}
    assert len(traces) == 3
    assert tree.parent(tree.attempt("s")) is tree.turn("request:s", 1)


def test_times_to_the_nanosecond(tree: Tree) -> None:
    def span_ns(s: ReadableSpan) -> tuple[int | None, int | None]:
        return s.start_time, s.end_time

    assert span_ns(tree.attempt("r1b")) == (ns(1.25), ns(2.75))
    assert span_ns(tree.turn("task-1", 1)) == (ns(0.0), ns(2.75))  # covers both attempts
    assert span_ns(tree.turn("task-1", 3)) == (ns(9.0), ns(9.5))
    # a task covers its sub-agents too: `early` began at -1, turn 3 ends last at 9.5
    assert span_ns(tree.task("task-1")) == (ns(-1.0), ns(9.5))
    assert span_ns(tree.task("sub-b")) == (ns(6.5), ns(8.5))
    assert span_ns(tree.task("sub-a")) == (ns(3.0), ns(4.5))
    assert span_ns(tree.attempt("s")) == (ns(30.0), ns(30.25))


def test_attempt_attributes(tree: Tree) -> None:
    r1b = tree.attempt("r1b")
    assert r1b.name == "chat qwen"
    assert dict(r1b.attributes) == {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "qwen",
        "gen_ai.response.id": "r1b", "gen_ai.conversation.id": "s1",
        "gen_ai.usage.input_tokens": 1000, "gen_ai.usage.cache_read.input_tokens": 832,
        "gen_ai.usage.output_tokens": 42, "gen_ai.response.finish_reasons": ("stop",),
        "agentserve.request_id": "r1b", "agentserve.trajectory_id": "task-1",
        "agentserve.session_id": "s1", "agentserve.tenant": "t0", "agentserve.route": "chat",
        "agentserve.turn": 1, "agentserve.attempt": 2, "agentserve.finish_reason": "stop",
        "agentserve.reused_tokens": 832, "agentserve.reused_tokens.device": 512,
        "agentserve.reused_tokens.host": 256, "agentserve.reused_tokens.disk": 64,
        "agentserve.fresh_tokens": 168, "agentserve.recomputed_tokens": 16,
        "agentserve.rebuilt_tokens": 960 - 832 + 16, "agentserve.eligible_tokens": 960,
        "agentserve.preemptions": 1,
        "agentserve.queue_s": 0.125, "agentserve.prefill_s": 0.25, "agentserve.decode_s": 0.5,
        "agentserve.ttft_s": 0.375, "agentserve.e2e_s": 1.5, "agentserve.busy_s": 0.5,
        "agentserve.kv_token_s.device": 12.5, "agentserve.kv_token_s.host": 100.0,
        "agentserve.miss.reason": "evicted", "agentserve.miss.cause": "capacity",
        "agentserve.miss.block": 52, "agentserve.miss.token": 832, "agentserve.miss.policy": "lru",
        "agentserve.miss.evicted_s": T0 + 0.5,
        "agentserve.decision.action": "offload", "agentserve.decision.p_return": 0.75,
        "agentserve.decision.pause_class": "tool", "agentserve.decision.reason": "short tool pause",
        "agentserve.decision.policy_version": "v3",
    }
    assert tree.attempt("r1b").status.status_code is StatusCode.UNSET
    r3 = tree.attempt("r3").attributes
    assert r3["agentserve.miss.reason"] == "diverged"
    assert (r3["agentserve.miss.exact"], r3["agentserve.miss.message_index"]) == (False, 2)
    a1 = tree.attempt("a1").attributes
    assert (a1["agentserve.parent_trajectory_id"], a1["gen_ai.conversation.id"]) == ("task-1", "s2")


def test_names_statuses_and_outcomes(tree: Tree) -> None:
    r1 = tree.attempt("r1")
    assert (r1.status.status_code, r1.status.description) == (StatusCode.ERROR, "engine crashed")
    assert r1.attributes["agentserve.error"] == "engine crashed"
    q1 = tree.attempt("q1")
    assert q1.name == "text_completion qwen" and "gen_ai.conversation.id" not in q1.attributes
    assert tree.attempt("s").name == "attempt qwen"  # a simulated attempt: no GenAI operation
    assert "gen_ai.operation.name" not in tree.attempt("s").attributes
    task1, task2 = tree.task("task-1"), tree.task("task-2")
    assert task1.status.status_code is StatusCode.UNSET
    assert task1.attributes["agentserve.outcome.success"] is True
    assert task2.status.status_code is StatusCode.ERROR
    assert task2.attributes["agentserve.outcome.success"] is False
    assert "agentserve.outcome.success" not in tree.task("sub-a").attributes
    assert dict(task1.attributes) == {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "s1",
        "agentserve.trajectory_id": "task-1", "agentserve.tenant": "t0",
        "agentserve.session_ids": ("s1",), "agentserve.num_turns": 3, "agentserve.num_attempts": 4,
        "agentserve.num_sub_agents": 3, "agentserve.outcome.success": True}
    assert dict(tree.turn("task-1", 1).attributes) == {
        "gen_ai.conversation.id": "s1", "agentserve.trajectory_id": "task-1", "agentserve.turn": 1,
        "agentserve.num_attempts": 2, "agentserve.finish_reason": "stop"}
    assert tree.task("sub-a").resource.attributes["service.name"] == "agentserve"
    plain = Tree(build_spans(fleet()))
    assert plain.attempt("r1b").name == "chat"
    assert "gen_ai.request.model" not in plain.attempt("r1b").attributes


def ids(spans: list[ReadableSpan]) -> set[tuple[str, int, int, int | None]]:
    return {(s.name, s.context.trace_id, s.context.span_id, s.parent and s.parent.span_id)
            for s in spans}


def test_ids_are_deterministic() -> None:
    first = build_spans(fleet(), OUTCOMES)
    shuffled = fleet()
    random.Random(7).shuffle(shuffled)
    assert ids(build_spans(shuffled, OUTCOMES)) == ids(first)
    tree = Tree(first)
    # the documented derivation: sha256 of the ids joined by \x1f, truncated
    digest = hashlib.sha256(b"trace\x1ft0\x1ftask-1").digest()
    assert tree.task("sub-b-1").context.trace_id == int.from_bytes(digest[:16], "big")
    digest = hashlib.sha256(b"task\x1ft0\x1fsub-a").digest()
    assert tree.task("sub-a").context.span_id == int.from_bytes(digest[:8], "big")
    digest = hashlib.sha256(b"attempt\x1ft0\x1ftask-1\x1fr1b\x1f1\x1f2").digest()
    assert tree.attempt("r1b").context.span_id == int.from_bytes(digest[:8], "big")
    # another tenant's trajectory of the same name is another trace
    other = Tree(build_spans([row("x", "task-1", 1, 0.0, 1.0, tenant="t1")]))
    assert other.task("task-1").context.trace_id != tree.task("task-1").context.trace_id


def test_a_row_read_twice_keeps_distinct_ids() -> None:
    rows = [row("r", "t", 1, 0.0, 1.0), row("r", "t", 1, 0.0, 1.0)]
    spans = build_spans(rows)
    assert len(spans) == 4 and len({s.context.span_id for s in spans}) == 4


def test_a_cycle_of_parent_links_still_exports() -> None:
    rows = [row("x", "a", 1, 0.0, 1.0, parent="b"), row("y", "b", 1, 2.0, 1.0, parent="a")]
    tree = Tree(build_spans(rows))
    assert tree.parent(tree.task("a")) is None  # the earliest becomes the root
    assert tree.parent(tree.task("b")) is tree.turn("a", 1)


def to_base64(hex_id: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_id)).decode()


def test_otlp_json_file(tmp_path: Path) -> None:
    out = tmp_path / "spans.jsonl"
    n = export_spans(fleet(), json_path=out, outcomes=OUTCOMES, model="qwen")
    assert n == 28
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1
    doc = json.loads(lines[0])
    [rs] = doc["resourceSpans"]
    service = {"key": "service.name", "value": {"stringValue": "agentserve"}}
    assert service in rs["resource"]["attributes"]
    [ss] = rs["scopeSpans"]
    assert ss["scope"]["name"] == "agentserve.ledger"
    spans = ss["spans"]
    assert len(spans) == n
    for s in spans:
        assert len(s["traceId"]) == 32 and int(s["traceId"], 16)
        assert len(s["spanId"]) == 16 and int(s["spanId"], 16)
        assert s["kind"] == 1  # SPAN_KIND_INTERNAL, as an integer
        assert int(s["endTimeUnixNano"]) >= int(s["startTimeUnixNano"])
    by_id = {s["spanId"]: s for s in spans}
    r1b = next(s for s in spans if {"key": "agentserve.request_id", "value": {"stringValue": "r1b"}}
               in s["attributes"])
    assert (r1b["startTimeUnixNano"], r1b["endTimeUnixNano"]) == (str(ns(1.25)), str(ns(2.75)))
    assert {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "1000"}} in r1b["attributes"]
    turn = by_id[r1b["parentSpanId"]]
    assert turn["name"] == "turn" and by_id[turn["parentSpanId"]]["name"] == "task"
    assert "parentSpanId" not in by_id[turn["parentSpanId"]]
    r1 = next(s for s in spans if s["name"] == "chat qwen" and s["startTimeUnixNano"] == str(ns(0.0)))
    assert r1["status"] == {"message": "engine crashed", "code": 2}
    # the same message as the SDK's exporter sends, once ids are put back in base64
    for s in spans:
        for key in ("traceId", "spanId", "parentSpanId"):
            if key in s:
                s[key] = to_base64(s[key])
    parsed = ParseDict(doc, ExportTraceServiceRequest())
    assert parsed == encode_spans(build_spans(fleet(), OUTCOMES, model="qwen"))


def test_json_lines_stay_short(tmp_path: Path) -> None:
    rows = [row(f"r{i}", f"t{i}", 1, float(i), 0.5) for i in range(100)]  # 300 spans
    out = tmp_path / "many.jsonl"
    assert export_spans(rows, json_path=out) == 300
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3  # 128 + 128 + 44
    counts = [len(json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]) for line in lines]
    assert counts == [128, 128, 44]


class Collector:
    """A stand-in OTLP/HTTP receiver: records each POST, answers with `status`."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, str, bytes]] = []
        self.status = 200
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                collector.posts.append((self.path, self.headers["Content-Type"], body))
                self.send_response(collector.status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list[Any]:
        out = []
        for path, content_type, body in self.posts:
            assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
            req = ExportTraceServiceRequest.FromString(body)
            out += [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
        return out


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[Collector]:
    for var in ("HTTP_PROXY", "http_proxy", "OTEL_EXPORTER_OTLP_COMPRESSION",
                "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    c = Collector()
    thread = threading.Thread(target=c.server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield c
    c.server.shutdown()
    c.server.server_close()
    thread.join()


def test_endpoint_export(collector: Collector) -> None:
    n = export_spans(fleet(), endpoint=collector.url, outcomes=OUTCOMES)  # no path: /v1/traces added
    spans = collector.spans()
    assert n == len(spans) == 28
    got = {(s.span_id.hex(), s.parent_span_id.hex(), s.start_time_unix_nano, s.end_time_unix_nano)
           for s in spans}
    want = {(f"{s.context.span_id:016x}", "" if s.parent is None else f"{s.parent.span_id:016x}",
             s.start_time, s.end_time) for s in build_spans(fleet(), OUTCOMES)}
    assert got == want


def test_endpoint_batches_large_exports(collector: Collector) -> None:
    rows = [row(f"r{i}", f"t{i}", 1, float(i), 0.5) for i in range(200)]  # 600 spans
    assert export_spans(rows, endpoint=collector.url + "/v1/traces") == 600
    assert len(collector.posts) == 2 and len(collector.spans()) == 600


def test_endpoint_refusal_is_an_error(collector: Collector) -> None:
    collector.status = 400  # not retryable: fails at once
    with pytest.raises(OtelExportError, match="failed after 0 of 28 spans"):
        export_spans(fleet(), endpoint=collector.url, timeout_s=2.0)


def test_traces_url() -> None:
    assert traces_url("http://h:4318") == "http://h:4318/v1/traces"
    assert traces_url("http://h:4318/") == "http://h:4318/v1/traces"
    assert traces_url("https://h/custom/path") == "https://h/custom/path"
    for bad in ("ftp://h", "localhost:4318", "http://"):
        with pytest.raises(ValueError, match="expected http"):
            traces_url(bad)
    with pytest.raises(ValueError, match="give json_path, endpoint or both"):
        export_spans(fleet())


def write_ledger(path: Path, rows: list[Row], *extra: str) -> Path:
    lines = [json.dumps(r.as_dict()) for r in rows] + [json.dumps(o.as_dict()) for o in OUTCOMES]
    path.write_text("\n".join([*lines, *extra]) + "\n", encoding="utf-8")
    return path


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger = write_ledger(tmp_path / "ledger.jsonl", fleet())
    out = tmp_path / "spans.jsonl"
    assert main(["ledger", "otel", str(ledger), "--json", str(out), "--model", "qwen"]) == 0
    assert capsys.readouterr().out.strip() == f"28 spans from 11 attempts to {out}"
    lines = out.read_text(encoding="utf-8").splitlines()
    spans = json.loads(lines[0])["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert len(spans) == 28 and sum(s["name"] == "chat qwen" for s in spans) == 9
    failed = next(s for s in spans if s["name"] == "task" and s.get("status", {}).get("code") == 2)
    task2 = {"key": "agentserve.trajectory_id", "value": {"stringValue": "task-2"}}
    assert task2 in failed["attributes"]


def test_cli_lists_problems_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger = write_ledger(tmp_path / "ledger.jsonl", fleet()[:2], "{not json")
    out = tmp_path / "spans.jsonl"
    assert main(["ledger", "otel", str(ledger), "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"agentserve ledger otel: {ledger}:5: not JSON" in err
    assert out.exists()


def test_cli_unreadable_ledger_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "spans.jsonl"
    assert main(["ledger", "otel", str(tmp_path / "missing.jsonl"), "--json", str(out)]) == 2
    assert "no ledger at" in capsys.readouterr().err
    assert main(["ledger", "otel", str(tmp_path), "--json", str(out)]) == 2
    assert "is a directory" in capsys.readouterr().err
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("nope\n", encoding="utf-8")
    assert main(["ledger", "otel", str(garbage), "--json", str(out)]) == 2
    assert f"no valid ledger rows in {garbage}: {garbage}:1: not JSON" in capsys.readouterr().err
    assert not out.exists()
    ledger = write_ledger(tmp_path / "ledger.jsonl", fleet())
    assert main(["ledger", "otel", str(ledger), "--json", str(tmp_path / "no" / "x.jsonl")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_cli_endpoint(tmp_path: Path, collector: Collector, capsys: pytest.CaptureFixture[str]) -> None:
    ledger = write_ledger(tmp_path / "ledger.jsonl", fleet())
    assert main(["ledger", "otel", str(ledger), "--endpoint", collector.url]) == 0
    assert len(collector.spans()) == 28
    assert capsys.readouterr().out.strip() == f"28 spans from 11 attempts to {collector.url}/v1/traces"
    assert main(["ledger", "otel", str(ledger), "--endpoint", "ftp://nowhere"]) == 2
    assert "expected http(s)://HOST:PORT" in capsys.readouterr().err
    collector.status = 400
    assert main(["ledger", "otel", str(ledger), "--endpoint", collector.url, "--timeout", "2"]) == 2
    assert "OTLP/HTTP export to" in capsys.readouterr().err


def test_sdk_switched_off_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    ledger = write_ledger(tmp_path / "ledger.jsonl", fleet())
    assert main(["ledger", "otel", str(ledger), "--json", str(tmp_path / "x.jsonl")]) == 2
    assert "OTEL_SDK_DISABLED" in capsys.readouterr().err


def test_cli_needs_exactly_one_output(tmp_path: Path) -> None:
    ledger = write_ledger(tmp_path / "ledger.jsonl", fleet())
    with pytest.raises(SystemExit) as exc:
        main(["ledger", "otel", str(ledger)])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["ledger", "otel", str(ledger), "--json", "a", "--endpoint", "http://h"])


def test_no_torch_in_the_ledger_modules() -> None:
    code = ("import sys, agentserve.ledger.otel, agentserve.ledger.cli, agentserve.ledger.reader, "
            "agentserve.ledger.cost, agentserve.ledger.prices, agentserve.ledger.rows; "
            "from agentserve.cli import build_parser; build_parser(['ledger']); "
            "sys.exit(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
