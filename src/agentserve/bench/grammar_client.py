"""The grammar bench's moving parts: a server subprocess on 127.0.0.1, streaming requests that
timestamp every token chunk, and the forced-call request whose grammar is new."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import agentserve
from agentserve import omp_env
from agentserve.bench.served import served


@dataclass(frozen=True, slots=True)
class ServerSpec:
    model: str
    dtype: str
    device: str | None
    port: int
    max_num_seqs: int
    inline: bool  # --grammar-inline: compile on the step thread (the old behaviour)
    src: Path | None  # run this checkout's src/ instead (e.g. main's, which has no grammar flags)


@contextlib.contextmanager
def server(spec: ServerSpec, log_path: Path, start_timeout_s: float) -> Iterator[str]:
    """`agentserve serve` in a subprocess; yields its base URL and stops it on exit. It runs with
    serve's own OpenMP wait (a short spin) unless the bench was started with one set
    (omp_env.for_server)."""
    args = ["--model", spec.model, "--dtype", spec.dtype, "--max-num-seqs", str(spec.max_num_seqs),
            "--kv-cache-memory-gib", "2"]
    if spec.device:
        args += ["--device", spec.device]
    if spec.inline:
        args.append("--grammar-inline")
    env = omp_env.for_server(os.environ)
    src = spec.src or Path(agentserve.__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH")) if p)
    with log_path.open("w") as log, served(args, log, start_timeout_s, env, spec.port) as s:
        yield s.url


async def stream_tokens(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                        stamps: list[float]) -> None:
    """A long completion; appends the arrival time of every chunk that carries tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "return_token_ids": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"stream: HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if any(ch.get("token_ids") for ch in json.loads(line[6:]).get("choices", [])):
                    stamps.append(time.perf_counter())


@dataclass(frozen=True, slots=True)
class ForcedCall:
    sent: float  # perf_counter when the request left
    admitted: float | None  # its first SSE chunk: past the door (tool checks, compile), in the engine
    done: float
    status: int
    cached_tokens: int | None  # prompt tokens served from the prefix cache
    prompt_tokens: int | None
    error: str | None


async def forced_call(client: httpx.AsyncClient, model: str, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]], max_tokens: int, tool_choice: str | None = "required") -> ForcedCall:
    """A streamed chat request; with no tools and tool_choice None, a plain one."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if tools:
        body |= {"tools": tools, "tool_choice": tool_choice}
    sent, admitted, usage = time.perf_counter(), None, {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode()[:300]
            return ForcedCall(sent, None, time.perf_counter(), r.status_code, None, None, text)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            admitted = admitted or time.perf_counter()
            usage = json.loads(line[6:]).get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return ForcedCall(sent, admitted, time.perf_counter(), 200, cached, usage.get("prompt_tokens"), None)


async def prefill(client: httpx.AsyncClient, model: str, prompt_ids: list[int]) -> None:
    """Put a prompt in the prefix cache (one generated token), so a later request with the same
    prompt measures its grammar, not its prefill."""
    body = {"model": model, "prompt": prompt_ids, "max_tokens": 1, "temperature": 0}
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"prefill: HTTP {r.status_code}: {r.text[:300]}")
