"""Drive one workload against one server and record every request at the client.

Two dialects of the same request (token-id prompt, greedy, exactly max_tokens out, streamed,
generated ids read back as ids):
- `openai` (agentserve, vLLM): POST /v1/completions with `return_token_ids`, `ignore_eos`,
  `min_tokens`, `stream_options.include_usage`; reuse from `usage.prompt_tokens_details.cached_tokens`.
- `openai-events` (the extra engine `agentserve-events`): the same, plus what a harness that
  speaks agentserve's lifecycle would send and nothing it could not know: each request names its
  trajectory (`trajectory_id`: the workload and the script), and the script's last request says
  the task ends with it (`agent_hints.last_turn`, i.e. `trajectory_finished`). No tool classes,
  no durations: the workload's think times stay unknown to the server, as they are to the peers.
- `llama.cpp`: its OpenAI route returns no token ids, so its native POST /completion with the same
  prompt ids, `n_predict`, `ignore_eos`, `cache_prompt`, `return_tokens`; reuse from the final
  chunk's `timings.cache_n` (prompt tokens taken from its cache). Its stream withholds the chunk
  of a token that ends inside a UTF-8 character and never sends that id (the final chunk carries
  no ids when streaming); when ids are missing and the next turn needs them, they are read from a
  second, non-streamed request of the same prompt (fully cached, so it only decodes), sent at once;
  the turn's figures are the streamed request's, and the record counts the recovery.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from agentserve.bench.peers.workloads import Script, Workload

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Completion:
    ids: tuple[int, ...]
    ttft_s: float | None
    latency_s: float
    cached_tokens: int | None  # as the server reports it
    num_generated: int  # as the server reports it, else the ids received


@dataclass(frozen=True, slots=True)
class TurnRecord:
    script: str
    turn: int  # 1-based
    sent_s: float  # after the workload started
    prompt_tokens: int
    cached_tokens: int | None
    generated: int
    ttft_s: float | None
    latency_s: float
    error: str | None = None
    recovered: bool = False  # the ids came from a second, non-streamed request (llama.cpp)


@dataclass(frozen=True, slots=True)
class Dialect:
    name: str  # openai | llama.cpp
    model: str

    @property
    def path(self) -> str:
        return "/completion" if self.name == "llama.cpp" else "/v1/completions"

    def body(self, prompt: list[int], max_tokens: int, stream: bool = True, trajectory: str | None = None,
             last_turn: bool = False) -> dict[str, Any]:
        if self.name == "llama.cpp":
            return {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
                    "cache_prompt": True, "return_tokens": True, "stream": stream, "seed": 0}
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                "min_tokens": max_tokens, "return_token_ids": True}
        if self.name == "openai-events" and trajectory is not None:
            body["trajectory_id"] = trajectory
            if last_turn:
                body["agent_hints"] = {"last_turn": True}
        return body

    def parse(self, event: dict[str, Any]) -> tuple[list[int], int | None, int | None]:
        """(new generated ids, cached prompt tokens, generated count) — the last two where reported."""
        if self.name == "llama.cpp":
            if not event.get("stop"):
                return list(event.get("tokens") or []), None, None
            timings = event.get("timings") or {}
            return list(event.get("tokens") or []), timings.get("cache_n"), event.get("tokens_predicted")
        ids = [i for ch in event.get("choices", []) for i in (ch.get("token_ids") or [])]
        usage = event.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return ids, details.get("cached_tokens") if usage else None, usage.get("completion_tokens")


async def complete(client: httpx.AsyncClient, dialect: Dialect, prompt: list[int], max_tokens: int,
                   clock: Clock, trajectory: str | None = None, last_turn: bool = False) -> Completion:
    start = clock()
    ttft: float | None = None
    ids: list[int] = []
    cached: int | None = None
    generated: int | None = None
    body = dialect.body(prompt, max_tokens, trajectory=trajectory, last_turn=last_turn)
    async with client.stream("POST", dialect.path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            new, c, n = dialect.parse(json.loads(line[6:]))
            if new and ttft is None:
                ttft = clock() - start
            ids.extend(new)
            cached = c if c is not None else cached
            generated = n if n is not None else generated
    return Completion(tuple(ids), ttft, clock() - start, cached, len(ids) if generated is None else generated)


async def generated_ids(client: httpx.AsyncClient, dialect: Dialect, prompt: list[int], max_tokens: int
                        ) -> tuple[int, ...]:
    """The ids of a non-streamed request (llama.cpp's complete `tokens`)."""
    r = await client.post(dialect.path, json=dialect.body(prompt, max_tokens, stream=False))
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    return tuple(r.json().get("tokens") or [])


async def run_script(client: httpx.AsyncClient, dialect: Dialect, script: Script, t0: float, clock: Clock,
                     sleep: Callable[[float], Any] = asyncio.sleep, trajectory: str | None = None
                     ) -> list[TurnRecord]:
    """The script's requests in order; it stops at its first failed request. `trajectory` names
    it to a dialect that sends lifecycle hints (`openai-events`); the others ignore it."""
    records: list[TurnRecord] = []
    context: list[int] = []
    out: tuple[int, ...] = ()
    for k, step in enumerate(script.steps):
        if step.think_s > 0:
            await sleep(step.think_s)
        context = context + (list(out) if step.keep_output else []) + list(step.append)
        sent = clock() - t0
        try:
            c = await complete(client, dialect, context, step.max_tokens, clock, trajectory,
                               last_turn=k + 1 == len(script.steps))
        except (httpx.HTTPError, RuntimeError, ValueError) as e:
            records.append(TurnRecord(script.name, k + 1, sent, len(context), None, 0, None, clock() - t0 - sent,
                                      f"{type(e).__name__}: {e}"[:300]))
            break
        out, recovered = c.ids, False
        needed = k + 1 < len(script.steps) and script.steps[k + 1].keep_output
        error = None
        if needed and len(out) < c.num_generated and dialect.name == "llama.cpp":
            try:  # a failure here is this turn's, like the request's own (the server may be gone)
                out, recovered = await generated_ids(client, dialect, context, step.max_tokens), True
            except (httpx.HTTPError, RuntimeError, ValueError) as e:
                error = f"recovering ids: {type(e).__name__}: {e}"[:300]
        if error is None and not (c.num_generated == step.max_tokens and (len(out) == step.max_tokens or not needed)):
            error = f"got {len(out)} ids ({c.num_generated} reported), expected {step.max_tokens}"
        records.append(TurnRecord(script.name, k + 1, sent, len(context), c.cached_tokens, c.num_generated,
                                  c.ttft_s, c.latency_s, error, recovered))
        if error:
            break
    return records


async def run_workload(client: httpx.AsyncClient, dialect: Dialect, workload: Workload, clock: Clock,
                       sleep: Callable[[float], Any] = asyncio.sleep) -> tuple[float, list[TurnRecord]]:
    """All scripts at their start times (children after their parent); (wall s, records)."""
    t0 = clock()
    done: dict[str, asyncio.Event] = {s.name: asyncio.Event() for s in workload.scripts}

    async def one(s: Script) -> list[TurnRecord]:
        if s.after is not None:
            await done[s.after].wait()
        if s.start_s > 0:
            await sleep(s.start_s)
        try:
            # the workload's name too: two workloads on one server replay the same sessions
            return await run_script(client, dialect, s, t0, clock, sleep, trajectory=f"{workload.name}/{s.name}")
        finally:
            done[s.name].set()

    per = await asyncio.gather(*(one(s) for s in workload.scripts))
    return clock() - t0, [r for rs in per for r in rs]


async def warm_up(client: httpx.AsyncClient, dialect: Dialect, clock: Clock) -> None:
    """One short request that no workload shares, so first-request costs stay out of the rows."""
    await complete(client, dialect, [1001, 1002, 1003, 1004], 2, clock)
