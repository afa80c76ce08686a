"""`agentserve bench overload`: a burst of 10x the server's queue bound, large bodies included,
against a server this command starts (so it can read the server's memory). Reports what
happened to every request — accepted and completed, shed (429), refused (413 / 400), lost
(anything else: a 5xx, a dropped connection, a stream without its end) — and the server's
peak RSS during the burst against its RSS before it. docs/reliability.md has the figures."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from agentserve.bench.served import served


@dataclass(frozen=True, slots=True)
class OverloadResult:
    sent: int
    completed: int  # 200 with a whole response
    shed: int  # 429
    too_large: int  # 413
    rejected: int  # other 4xx (a prompt over the context)
    lost: int  # 5xx, connection errors, streams without [DONE]: must be 0
    wall_s: float
    idle_rss_mib: float
    peak_rss_mib: float
    alive_after: bool
    used_blocks_after: int
    statuses: dict[str, int]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _bodies(model: str, n: int, large_bytes: int, max_tokens: int) -> list[tuple[str, dict]]:
    """Every 10th request is large (a long tool result, beyond the context), every 10th + 5
    is over the body limit, every 3rd streams."""
    out = []
    for i in range(n):
        content = f"Request {i}: name a colour."
        if i % 10 == 0:
            content = "lorem ipsum " * (large_bytes // 12)
        kind = "large" if i % 10 == 0 else "huge" if i % 10 == 5 else "stream" if i % 3 == 0 else "small"
        body = {"model": model, "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "temperature": 0, "stream": kind == "stream"}
        out.append((kind, body))
    return out


async def _one(client: httpx.AsyncClient, kind: str, body: dict, huge: bytes) -> str:
    try:
        if kind == "huge":
            r = await client.post("/v1/chat/completions", content=huge,
                                  headers={"content-type": "application/json"})
            return str(r.status_code)
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            text = (await r.aread()).decode()
            if r.status_code == 200 and body["stream"] and not text.rstrip().endswith("data: [DONE]"):
                return "stream-cut"
            if r.status_code == 200 and body["stream"] and '"error"' in text:
                return "stream-error"
            return str(r.status_code)
    except httpx.HTTPError as exc:
        return f"conn:{type(exc).__name__}"


async def _burst(url: str, pid: int, bodies: list[tuple[str, dict]], huge: bytes) -> tuple[Counter, float, float]:
    peak = _rss_mib(pid)
    done = False

    async def sample() -> None:
        nonlocal peak
        while not done:
            peak = max(peak, _rss_mib(pid))
            await asyncio.sleep(0.01)

    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        sampler = asyncio.create_task(sample())
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(_one(client, k, b, huge) for k, b in bodies))
        wall = time.perf_counter() - start
        done = True
        await sampler
    return Counter(outcomes), wall, peak


def run_overload(model: str, max_queued: int, factor: int, large_bytes: int, body_limit: int,
                 max_tokens: int, extra_args: list[str]) -> OverloadResult:
    args = ["--model", model, "--max-queued-requests", str(max_queued),
            "--max-request-body-bytes", str(body_limit), *extra_args]
    with served(args) as server:
        url, pid = server.url, server.proc.pid
        warm = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens}
        httpx.post(url + "/v1/chat/completions", json=warm, timeout=300).raise_for_status()
        idle = _rss_mib(pid)
        bodies = _bodies(model, max_queued * factor, large_bytes, max_tokens)
        huge = b'{"model": "' + model.encode() + b'", "messages": [], "pad": "' + b"x" * (body_limit + 1) + b'"}'
        counts, wall, peak = asyncio.run(_burst(url, pid, bodies, huge))
        alive = httpx.get(url + "/health", timeout=10).status_code == 200
        used = _used_blocks(httpx.get(url + "/metrics", timeout=10).text)
    known = {"200", "429", "413"}
    rejected = sum(v for k, v in counts.items() if k.isdigit() and 400 <= int(k) < 500 and k not in known)
    lost = sum(v for k, v in counts.items() if not k.isdigit() or int(k) >= 500)
    return OverloadResult(sent=len(bodies), completed=counts["200"], shed=counts["429"],
                          too_large=counts["413"], rejected=rejected, lost=lost, wall_s=wall,
                          idle_rss_mib=idle, peak_rss_mib=peak, alive_after=alive,
                          used_blocks_after=used, statuses=dict(counts))


def _used_blocks(metrics: str) -> int:
    for line in metrics.splitlines():
        if line.startswith('agentserve_kv_blocks{state="used"}'):
            return int(float(line.split()[-1]))
    raise RuntimeError("agentserve_kv_blocks{state=\"used\"} missing from /metrics")
