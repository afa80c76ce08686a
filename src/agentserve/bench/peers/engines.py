"""How each server is started, checked and stopped.

`command()` turns an engine's frozen settings, its install and a group's KV budget into one
`Launch` (argv, env, health route, dialect). `serve()` runs it in its own process group with its
log in a file, waits for health, and on every way out (return, exception, SIGINT/SIGTERM turned
into an exception by the runner) stops the whole group — SIGTERM, then SIGKILL — and checks
that the port is free again. A server that exits or hangs while starting raises `EngineFailed`
with the tail of its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from agentserve import omp_env
from agentserve.bench.peers.install import Installed
from agentserve.bench.peers.settings import EVENTS_ENGINE, EngineSettings, Group, Settings

GIB = 1 << 30


class EngineFailed(RuntimeError):
    """A server that did not start, or did not stop; `log_tail` is the end of its log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


@dataclass(frozen=True, slots=True)
class Launch:
    engine: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # added to the harness's environment
    port: int
    dialect: str  # openai | llama.cpp
    health_path: str = "/health"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def shell(self) -> str:
        """The command as one line, for the report."""
        env = " ".join(f"{k}={v}" for k, v in self.env)
        return (env + " " if env else "") + " ".join(self.argv)


# The harness's own thread settings (make bench-peers runs it under OMP_WAIT_POLICY=PASSIVE) are
# not a server's: each engine runs with its project's default unless settings.yaml sets one (the
# first full run leaked PASSIVE into every server; agentserve's serve default spins).
HARNESS_ONLY = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS", omp_env.MARK)


def server_env(inherited: Mapping[str, str], launch: Launch) -> dict[str, str]:
    return {k: v for k, v in inherited.items() if k not in HARNESS_ONLY} | dict(launch.env)


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def command(e: EngineSettings, inst: Installed, settings: Settings, group: Group, port: int) -> Launch:
    kv_bytes = settings.kv_bytes(group.kv_tokens)
    name = settings.model
    if e.name in ("agentserve", EVENTS_ENGINE):  # the same server; the client tells them apart
        argv = (sys.executable, "-m", "agentserve.cli", "serve", "--model", name, "--host", "127.0.0.1",
                "--port", str(port), "--kv-cache-memory-gib", f"{kv_bytes / GIB:.6f}",
                "--max-model-len", str(group.max_model_len), *e.args)
        return Launch(e.name, argv, e.env, port, "openai-events" if e.name == EVENTS_ENGINE else "openai")
    if e.name == "vllm":
        preload = ":".join(inst.preload[p] for p in e.preload if p in inst.preload)
        argv = (inst.python, "-m", "vllm.entrypoints.openai.api_server", "--model", inst.model_dir,
                "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
                "--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(group.max_model_len), *e.args)
        env = (("LD_PRELOAD", preload),) if preload else ()
        return Launch(e.name, argv, (*env, *e.env), port, "openai")
    if e.name == "llama.cpp":
        argv = (inst.binary, "-m", inst.model_file, "--alias", name, "--host", "127.0.0.1", "--port", str(port),
                "-c", str(group.kv_tokens), *e.args)
        return Launch(e.name, argv, e.env, port, "llama.cpp")
    raise ValueError(f"unknown engine {e.name!r}")


def log_tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def wait_healthy(launch: Launch, proc: subprocess.Popen, log: Path, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> float:
    """Seconds until the health route answered 200; EngineFailed if it exits or times out."""
    start = clock()
    while clock() - start < timeout_s:
        if proc.poll() is not None:
            raise EngineFailed(f"{launch.engine} exited with status {proc.returncode} while starting", log_tail(log))
        try:
            if httpx.get(launch.url + launch.health_path, timeout=2).status_code == 200:
                return clock() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise EngineFailed(f"{launch.engine} did not answer {launch.health_path} in {timeout_s:.0f} s", log_tail(log))


def stop(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGTERM to the process group, then SIGKILL to whatever is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # children (vLLM's engine core) may outlive the leader
    proc.wait()


def wait_port_free(port: int, timeout_s: float = 15) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not port_in_use(port):
            return True
        time.sleep(0.2)
    return False


@dataclass(frozen=True, slots=True)
class Running:
    launch: Launch
    pid: int
    start_s: float  # until healthy


@contextlib.contextmanager
def serve(launch: Launch, log: Path, start_timeout_s: float, stop_grace_s: float = 20) -> Iterator[Running]:
    if port_in_use(launch.port):
        raise EngineFailed(f"port {launch.port} is taken before {launch.engine} starts")
    log.parent.mkdir(parents=True, exist_ok=True)
    env = server_env(os.environ, launch)
    with log.open("w") as out:
        out.write(f"$ {launch.shell()}\n")
        out.flush()
        proc = subprocess.Popen(launch.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    try:
        yield Running(launch, proc.pid, wait_healthy(launch, proc, log, start_timeout_s))
    finally:
        stop(proc, stop_grace_s)
        free = wait_port_free(launch.port)
    if not free:  # only on a clean exit: an error already on its way out is the one to report
        raise EngineFailed(f"port {launch.port} still answers after {launch.engine} stopped", log_tail(log))
