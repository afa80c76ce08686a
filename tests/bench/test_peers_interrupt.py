"""SIGTERM half-way: the server is stopped, the rows measured are kept, the missing ones named."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path

from agentserve.bench.peers import cli, runner
from agentserve.bench.peers.engines import Launch, port_in_use
from agentserve.bench.peers.install import Installed
from agentserve.bench.peers.runner import plan, read_rows
from agentserve.bench.peers.settings import load_settings
from agentserve.bench.peers.workloads import agent_like, long_prompt

FAKE = Path(__file__).with_name("fake_peer.py")


def test_sigterm_keeps_rows_and_reports_the_missing(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    ports: list[int] = []

    def command(e, inst, settings, group, port):  # noqa: ANN001, ANN202
        ports.append(port)
        return Launch("fake", (sys.executable, str(FAKE), "ok", str(port), str(tmp_path / "child.pid")), (), port,
                      "openai")

    monkeypatch.setattr(runner, "command", command)
    monkeypatch.setattr(cli, "_meta", lambda *a: "")
    s = load_settings()
    s = dataclasses.replace(s, idle_busy_below=1.01, idle_wait_s=0, start_timeout_s=20,
                            groups=(dataclasses.replace(s.groups[0], workloads=("long-2k", "fanout")),))
    workloads = {"long-2k": long_prompt(32, 1, 2), "fanout": agent_like(1, 1, 4, 10, 5, 5, 2, 1.0)}
    cells = plan(s, ["agentserve"], list(workloads), 2)
    installed = {"agentserve": Installed("agentserve", True)}
    args = argparse.Namespace(lock="none", shared=str(tmp_path), quick=False)
    results = tmp_path / "r.jsonl"
    stop = threading.Event()

    def interrupt_after_the_first_row() -> None:  # the second workload has 3 s of think time
        while not stop.is_set() and not (results.is_file() and results.read_text().count("\n") >= 1):
            time.sleep(0.05)
        if not stop.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=interrupt_after_the_first_row)
    killer.start()
    try:
        rc = cli._execute(args, s, ["agentserve"], installed, workloads, cells, cells, results, tmp_path)
    finally:
        stop.set()
        killer.join()
    assert rc == 130
    rows = read_rows(results)
    assert [r.key for r in rows] == [("long-2k", "agentserve", 0)]
    report = (tmp_path / "peers.md").read_text()
    assert "missing rows: 3" in report and "fanout, agentserve, repeat 0" in report
    assert not port_in_use(ports[0])
    child = int((tmp_path / "child.pid").read_text())
    assert not Path(f"/proc/{child}").exists() or open(f"/proc/{child}/stat").read().split()[2] == "Z"
