"""`agentserve bench agent --target URL`: the agent-4x6 protocol against any OpenAI-compatible
server (../shared/bench/README.md): 4 sessions x 6 turns, 2 s think time, token-id prompts,
32 generated tokens appended as ids. Measured at the client."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

@dataclass(frozen=True, slots=True)
class TurnRecord:
    set_name: str
    session: int
    turn: int  # 1-based
    prompt_tokens: int
    cached_tokens: int
    generated: int
    ttft_s: float
    latency_s: float

@dataclass(frozen=True, slots=True)
class SetResult:
    set_name: str
    wall_s: float
    ttft_later_p50_s: float
    ttft_later_p90_s: float
    ttft_turn1_p50_s: float
    cached_later: float  # cached / prompt tokens on turns 2-6
    cached_turn1: float
    generated_tok_s: float

async def _request(client: httpx.AsyncClient, model: str, prompt: list[int], n_out: int
                   ) -> tuple[list[int], dict[str, Any], float, float]:
    body = {"model": model, "prompt": prompt, "max_tokens": n_out, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "min_tokens": n_out,
            "return_token_ids": True}
    start = time.perf_counter()
    ttft: float | None = None
    ids: list[int] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                new = ch.get("token_ids") or []
                if (new or ch.get("text")) and ttft is None:
                    ttft = time.perf_counter() - start
                ids.extend(new)
    return ids, usage, ttft or 0.0, time.perf_counter() - start

async def _session(client: httpx.AsyncClient, model: str, set_name: str, idx: int, prefix: list[int],
                   sess: dict[str, Any], think_s: float, n_out: int) -> list[TurnRecord]:
    prompt = prefix + sess["task"]
    records = []
    turns = 1 + len(sess["tool_results"])
    for t in range(turns):
        ids, usage, ttft, lat = await _request(client, model, prompt, n_out)
        if len(ids) != n_out:
            raise RuntimeError(f"set {set_name} session {idx} turn {t + 1}: got {len(ids)} ids, expected {n_out}; "
                               "the server must honour ignore_eos, min_tokens and return_token_ids")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        records.append(TurnRecord(set_name, idx, t + 1, len(prompt), cached, len(ids), ttft, lat))
        if t + 1 < turns:
            await asyncio.sleep(think_s)
            prompt = prompt + ids + sess["tool_results"][t]
    return records

def summarize(set_name: str, wall: float, recs: list[TurnRecord]) -> SetResult:
    later = [r for r in recs if r.turn > 1]
    first = [r for r in recs if r.turn == 1]
    return SetResult(
        set_name=set_name, wall_s=wall,
        ttft_later_p50_s=statistics.median(r.ttft_s for r in later),
        ttft_later_p90_s=sorted(r.ttft_s for r in later)[int(0.9 * (len(later) - 1))],
        ttft_turn1_p50_s=statistics.median(r.ttft_s for r in first),
        cached_later=sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later),
        cached_turn1=sum(r.cached_tokens for r in first) / sum(r.prompt_tokens for r in first),
        generated_tok_s=sum(r.generated for r in recs) / wall,
    )

async def run_agent_bench(target: str, workload: Path, think_s: float = 2.0, n_out: int = 32,
                          model: str | None = None, timeout_s: float = 600,
                          transport: httpx.AsyncBaseTransport | None = None,
                          ) -> tuple[list[SetResult], list[TurnRecord]]:
    data = json.loads(workload.read_text())
    async with httpx.AsyncClient(base_url=target.rstrip("/"), timeout=timeout_s, transport=transport) as client:
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await _request(client, model, [data["sets"]["A"]["prefix"][0], 13], 2)  # warm-up
        results, records = [], []
        for set_name, s in data["sets"].items():
            start = time.perf_counter()
            per = await asyncio.gather(*(
                _session(client, model, set_name, i, s["prefix"], sess, think_s, n_out)
                for i, sess in enumerate(s["sessions"])))
            wall = time.perf_counter() - start
            recs = [r for rs in per for r in rs]
            records.extend(recs)
            results.append(summarize(set_name, wall, recs))
    return results, records

def write_json(path: Path, results: list[SetResult], records: list[TurnRecord]) -> None:
    path.write_text(json.dumps({"sets": [asdict(r) for r in results],
                                "turns": [asdict(r) for r in records]}, indent=2))
