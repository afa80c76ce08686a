"""`agentserve serve`'s exit path: after an unrecoverable engine failure the process answers
the failed request with its error, then exits with status 1 (for a supervisor to restart it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from agentserve.bench.served import free_port

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import logging, sys
    from agentserve.api import LLM
    from agentserve.config import ServerConfig
    from agentserve.engine.engine import RunResult
    from agentserve.server.app import ServerState
    from agentserve.server.cli import serve
    from agentserve.server.tool_parsers import get_parser

    class Failing:  # the real runner, until a request with seed 999 is in the batch
        def __init__(self, inner):
            self.inner = inner
        def run(self, batch):
            if any(c.sampling.seed == 999 for c in batch.chunks):
                raise RuntimeError("injected device failure")
            return self.inner.run(batch)

    logging.basicConfig(level=logging.INFO)
    llm = LLM("smollm2-135m", dtype="float32", num_kv_blocks=256, max_model_len=1024)
    llm.engine.runner = Failing(llm.engine.runner)
    state = ServerState(llm=llm, model_name="smollm2-135m", tool_parser=get_parser("auto"),
                        config=ServerConfig(failure_grace_s=2.0))
    sys.exit(serve(state, "127.0.0.1", int(sys.argv[1])))
""")


def test_serve_exits_1_after_an_engine_failure():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        ok = httpx.post(url + "/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi",
                                                       "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200
        r = httpx.post(url + "/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi",
                                                      "max_tokens": 3, "seed": 999}, timeout=60)
        assert r.status_code == 503 and "injected device failure" in r.json()["error"]["message"]
        assert proc.wait(timeout=30) == 1
        log = proc.stdout.read()
        assert "exiting with status 1 after an unrecoverable engine failure" in log
    finally:
        if proc.poll() is None:
            proc.kill()
