"""A stand-in server for the peers harness tests: `python fake_peer.py MODE PORT PIDFILE`.

MODE ok: answers /health and streams /v1/completions (OpenAI dialect, token ids, usage) after
spawning a child that sleeps (so the test sees the whole process group go); exit: prints an
error and exits 3; hang: never answers; ignore-term: ok, but ignores SIGTERM.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

mode, port, pidfile = sys.argv[1], int(sys.argv[2]), sys.argv[3]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        prompt, n = body["prompt"], body["max_tokens"]
        for k in range(n):
            chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [2000 + k]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": len(prompt) // 2}}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())


if mode == "exit":
    print("fatal: the fake peer cannot start (as asked)", flush=True)
    sys.exit(3)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(pidfile, "w") as f:
    f.write(f"{child.pid}\n")
print("fake peer listening", flush=True)
if mode == "hang":
    time.sleep(600)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
