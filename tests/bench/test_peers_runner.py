"""Interleaving order, idle checks, rows kept as they complete, and the missing rows reported."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from agentserve.bench.peers import runner
from agentserve.bench.peers.engines import Launch
from agentserve.bench.served import free_port
from agentserve.bench.peers.install import Installed
from agentserve.bench.peers.runner import Cell, Context, Row, append, missing, plan, read_rows, run_cell, wait_idle
from agentserve.bench.peers.settings import load_settings
from agentserve.bench.peers.workloads import agent_like, long_prompt

FAKE = Path(__file__).with_name("fake_peer.py")


def test_engines_interleave_within_each_repeat() -> None:
    s = load_settings()
    cells = plan(s, ["A", "B", "C"], ["agent-4x6", "long-2k", "cc-c2"], 3)
    assert [(c.group, c.repeat, c.engine) for c in cells[:6]] == [
        ("main", 0, "A"), ("main", 0, "B"), ("main", 0, "C"), ("main", 1, "A"), ("main", 1, "B"), ("main", 1, "C")]
    assert cells[0].workloads == ("agent-4x6", "long-2k") and cells[-1] == Cell("cc", 2, "C", ("cc-c2",))


def test_a_workload_can_run_fewer_repeats() -> None:
    s = load_settings()
    s = dataclasses.replace(s, workloads=s.workloads | {"repeats_of": {"long-16k": 2}})
    cells = plan(s, ["A"], ["long-8k", "long-16k"], 3)
    assert [c.workloads for c in cells] == [("long-8k", "long-16k"), ("long-8k", "long-16k"), ("long-8k",)]


def test_wait_idle_waits_for_the_threshold_and_reports_the_last_figure() -> None:
    samples = iter([0.9, 0.5, 0.05, 0.9])
    assert wait_idle(0.1, 60, lambda: next(samples), clock=lambda: 0.0) == 0.05
    t = iter(range(100))
    assert wait_idle(0.1, 3, lambda: 0.8, clock=lambda: float(next(t))) == 0.8  # gave up


def test_missing_rows_after_an_interrupted_run(tmp_path: Path) -> None:
    cells = plan(load_settings(), ["A", "B"], ["long-2k", "long-8k"], 2)
    path = tmp_path / "r.jsonl"
    append(path, Row("long-2k", "A", 0, "ok"))
    append(path, Row("long-8k", "A", 0, "failed", error="boom"))
    with path.open("a") as f:
        f.write('{"workload": "long-2k", "engine": "B", "rep')  # cut off mid-line by the interrupt
    rows = read_rows(path)
    assert [r.key for r in rows] == [("long-2k", "A", 0), ("long-8k", "A", 0)]
    assert missing(cells, rows) == [("long-8k", "A", 0), ("long-2k", "B", 0), ("long-8k", "B", 0),
                                    ("long-2k", "A", 1), ("long-8k", "A", 1), ("long-2k", "B", 1), ("long-8k", "B", 1)]


def _ctx(tmp_path: Path, installed: dict[str, Installed]) -> Context:
    s = load_settings()
    s = dataclasses.replace(s, idle_busy_below=1.01, idle_wait_s=0, start_timeout_s=20)
    workloads = {"main-a": agent_like(1, 2, 2, 20, 10, 10, 3, 0.0), "main-b": long_prompt(64, 1, 4)}
    return Context(s, installed, workloads, tmp_path / "results.jsonl", tmp_path / "logs")


@pytest.fixture
def fake_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def command(e, inst, settings, group, port):  # noqa: ANN001, ANN202
        mode = "exit" if inst.version == "broken" else "ok"
        return Launch("fake", (sys.executable, str(FAKE), mode, str(port), str(tmp_path / f"{port}.pid")), (), port,
                      "openai")
    monkeypatch.setattr(runner, "command", command)
    monkeypatch.setattr(runner, "free_port", free_port)


def test_run_cell_measures_rows_and_reports_failures(tmp_path: Path, fake_command: None) -> None:
    ctx = _ctx(tmp_path, {"agentserve": Installed("agentserve", True), "vllm": Installed("vllm", True, "broken"),
                          "llama.cpp": Installed("llama.cpp", False, error="cmake failed", log_tail="error: no cc")})
    s = ctx.settings
    ctx = dataclasses.replace(ctx, settings=dataclasses.replace(
        s, groups=(dataclasses.replace(s.groups[0], workloads=("main-a", "main-b")),)))
    ok = run_cell(Cell("main", 0, "agentserve", ("main-a", "main-b")), ctx, say=lambda _: None)
    assert [r.status for r in ok] == ["ok", "ok"]
    assert ok[0].figures["turns"] == 4 and ok[0].figures["reused_tokens"] > 0 and ok[0].figures["errors"] == 0
    assert ok[1].figures["prefill_tok_s"] > 0 and ok[0].digest == ctx.workloads["main-a"].digest()
    broken = run_cell(Cell("main", 0, "vllm", ("main-a", "main-b")), ctx, say=lambda _: None)
    assert [r.status for r in broken] == ["failed", "failed"] and "cannot start" in broken[0].log_tail
    absent = run_cell(Cell("main", 0, "llama.cpp", ("main-a",)), ctx, say=lambda _: None)
    assert absent[0].status == "failed" and "cmake failed" in absent[0].error and absent[0].log_tail == "error: no cc"
    assert len(read_rows(ctx.results)) == 5  # every row was written as it completed
