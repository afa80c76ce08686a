"""The harness never leaves a server behind, and a server that fails is reported with its log."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from agentserve.bench.peers.engines import EngineFailed, Launch, command, port_in_use, serve, server_env
from agentserve.bench.peers.install import Installed
from agentserve.bench.peers.settings import ENGINES, load_settings
from agentserve.bench.served import free_port

FAKE = Path(__file__).with_name("fake_peer.py")


def _launch(mode: str, pidfile: Path) -> Launch:
    port = free_port()
    return Launch("fake", (sys.executable, str(FAKE), mode, str(port), str(pidfile)), (), port, "openai")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _gone(pidfile: Path) -> None:
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the server's child outlived it"


@pytest.mark.parametrize("mode", ["ok", "ignore-term"])
def test_a_healthy_server_and_its_children_are_stopped(tmp_path: Path, mode: str) -> None:
    pidfile = tmp_path / "child.pid"
    launch = _launch(mode, pidfile)
    with serve(launch, tmp_path / "log", 20, stop_grace_s=1) as running:
        assert port_in_use(launch.port) and running.start_s >= 0
    assert not port_in_use(launch.port)
    _gone(pidfile)


def test_an_exception_inside_stops_the_server(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    launch = _launch("ok", pidfile)
    with pytest.raises(KeyboardInterrupt), serve(launch, tmp_path / "log", 20):
        raise KeyboardInterrupt
    assert not port_in_use(launch.port)
    _gone(pidfile)


def test_a_server_that_exits_is_reported_with_its_log_tail(tmp_path: Path) -> None:
    with pytest.raises(EngineFailed) as e, serve(_launch("exit", tmp_path / "p"), tmp_path / "log", 20):
        pass
    assert "exited with status 3" in str(e.value)
    assert "cannot start (as asked)" in e.value.log_tail


def test_a_server_that_hangs_times_out_and_is_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    with pytest.raises(EngineFailed) as e, serve(_launch("hang", pidfile), tmp_path / "log", 2):
        pass
    assert "did not answer /health" in str(e.value) and "fake peer listening" in e.value.log_tail
    _gone(pidfile)


def test_the_harness_thread_settings_do_not_reach_a_server() -> None:
    """make bench-peers runs the harness with OMP_WAIT_POLICY=PASSIVE; a server gets its own
    default (agentserve's serve spins), or what settings.yaml names for it."""
    inherited = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "PATH": "/bin"}
    plain = Launch("agentserve", ("serve",), (), 1, "openai")
    assert server_env(inherited, plain) == {"PATH": "/bin"}
    named = Launch("vllm", ("serve",), (("OMP_WAIT_POLICY", "ACTIVE"),), 1, "openai")
    assert server_env(inherited, named) == {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE"}


def test_the_events_row_is_the_same_agentserve_server_with_the_events_client() -> None:
    s = load_settings()
    assert "agentserve-events" not in ENGINES  # never in the default table: an extra row, run when named
    inst = Installed("agentserve", True)
    group = s.groups[-1]
    plain = command(s.engines["agentserve"], inst, s, group, 8000)
    events = command(s.engines["agentserve-events"], inst, s, group, 8000)
    assert events.argv == plain.argv and events.env == plain.env  # the frozen flags, the same budget
    assert (plain.dialect, events.dialect) == ("openai", "openai-events")
