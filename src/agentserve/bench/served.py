"""`agentserve serve` as a subprocess on a free 127.0.0.1 port, for benchmarks and end-to-end
tests: started, waited for until /health answers 200, and always stopped."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import httpx

from agentserve import omp_env


@dataclass(frozen=True, slots=True)
class Served:
    url: str
    proc: subprocess.Popen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(args: list[str], output: int | IO[str] = subprocess.DEVNULL, start_timeout_s: float = 300,
           env: dict[str, str] | None = None, port: int | None = None) -> Iterator[Served]:
    """`agentserve serve ARGS --port P`; output: where its log goes (PIPE to read it). env: the
    server's environment, by default this process's less the OpenMP wait setting a command
    defaulted for itself (the server then runs with serve's own: omp_env.py)."""
    port = port or free_port()
    env = omp_env.for_server(os.environ) if env is None else env
    proc = subprocess.Popen([sys.executable, "-m", "agentserve.cli", "serve", *args, "--port", str(port)],
                            stdout=output, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, start_timeout_s)
        yield Served(url, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = proc.stdout.read()[-3000:] if proc.stdout else ""
            raise RuntimeError(f"the server exited with status {proc.returncode}: {log}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not become healthy in {timeout_s:.0f} s")
