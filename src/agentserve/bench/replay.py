"""Replay an agent workload against a live OpenAI-compatible server (`agentserve replay`).

Open loop by default: sessions start at their trace times (time-scaled) or as a Poisson
process, and each session sends its next turn only after the previous response plus its think
time (time-scaled); sub-agents run beside their parent, which waits for the awaited ones.
A closed loop (at most N requests in flight) is used only when asked for, and every record
says so. Prompts are token-id lists made from the block hashes (workload/tokens.py); with
`append_replies`, a turn that extends the previous prompt carries the ids the server
generated, as an agent harness would.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from agentserve.workload.model import AgentSession, Timing, Workload
from agentserve.workload.tokens import BlockTokens


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    target: str  # base URL, e.g. http://127.0.0.1:8000
    model: str = "default"
    time_scale: float = 1.0  # multiplies think times, trace times and Poisson gaps
    poisson: bool = False  # sessions start as a Poisson process even where the trace has times
    session_rate: float = 1 / 300  # sessions per second, for Poisson starts
    closed_loop: int | None = None  # at most this many requests in flight
    token_scale: float = 1.0  # prompt and output lengths (workload/tokens.py)
    vocab_size: int = 32000
    append_replies: bool = True
    timeout_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.closed_loop is not None and self.closed_loop < 1:
            raise ValueError(f"closed loop concurrency must be >= 1, got {self.closed_loop}")
        if self.time_scale < 0:
            raise ValueError(f"time scale must be >= 0, got {self.time_scale}")


@dataclass(frozen=True, slots=True)
class ReplayRecord:
    session: str
    turn: int
    mode: str  # "open-loop" or "closed-loop(N)"
    sent_s: float  # from the replay's start
    ttft_s: float | None
    e2e_s: float
    prompt_tokens: int  # sent
    max_tokens: int
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens
    reused_tokens: int | None  # the server's agentserve block, where present
    prefilled_tokens: int | None
    generated_tokens: int | None
    error: str | None = None


@dataclass(slots=True)
class _Reply:
    ttft_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    usage: dict[str, object] = field(default_factory=dict)


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, object], t0: float,
                  clock: Callable[[], float]) -> _Reply:
    reply = _Reply()
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code >= 400:
            text = (await resp.aread()).decode(errors="replace")[:200]
            raise httpx.HTTPStatusError(f"HTTP {resp.status_code}: {text}", request=resp.request, response=resp)
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if (ids or choice.get("text")) and reply.ttft_s is None:
                    reply.ttft_s = clock() - t0
                reply.token_ids.extend(ids)
            if chunk.get("usage"):
                reply.usage = chunk["usage"]
    return reply


def _usage_numbers(usage: dict[str, object]) -> tuple[int | None, int | None, int | None, int | None]:
    details = usage.get("prompt_tokens_details") or {}
    ours = usage.get("agentserve") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(ours, dict):
        ours = {}
    return cached, ours.get("reused_tokens"), ours.get("prefilled_tokens"), usage.get("completion_tokens")  # type: ignore[return-value]


class Replayer:
    def __init__(self, workload: Workload, cfg: ReplayConfig, client: httpx.AsyncClient,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 on_record: Callable[[ReplayRecord], None] = lambda r: None) -> None:
        self.workload, self.cfg, self.client = workload, cfg, client
        self.clock, self.sleep, self.on_record = clock, sleep, on_record
        self.tokens = BlockTokens(cfg.vocab_size, workload.block_size, cfg.token_scale, cfg.seed)
        self.records: list[ReplayRecord] = []
        self._limit = asyncio.Semaphore(cfg.closed_loop) if cfg.closed_loop else None
        self._mode = f"closed-loop({cfg.closed_loop})" if cfg.closed_loop else "open-loop"
        self._t0 = 0.0

    async def run(self) -> list[ReplayRecord]:
        self._t0 = self.clock()
        rng = random.Random(self.cfg.seed)
        tasks, t = [], 0.0
        for s in self.workload.sessions:  # trace start times where there are any, else Poisson
            t += rng.expovariate(self.cfg.session_rate) * self.cfg.time_scale
            start = t if self.cfg.poisson or s.start_s is None else s.start_s * self.cfg.time_scale
            tasks.append(asyncio.create_task(self._session(s, start)))
        await asyncio.gather(*tasks)
        return self.records

    async def _wait_until(self, t: float) -> None:
        delay = t - (self.clock() - self._t0)
        if delay > 0:
            await self.sleep(delay)

    async def _session(self, s: AgentSession, start: float) -> None:
        await self._wait_until(start)
        prev_ids: list[int] = []
        background: list[asyncio.Task[None]] = []
        waited: list[asyncio.Task[None]] = []
        hashes_iter = s.block_hashes()
        for j, turn in enumerate(s.turns):
            hashes = next(hashes_iter)
            if j:
                await asyncio.gather(*waited)
                waited = []
                if s.timing is Timing.TRACE:
                    await self._wait_until(start + turn.offset_s * self.cfg.time_scale)
                else:
                    await self.sleep(turn.think_s * self.cfg.time_scale)
            prompt = self.tokens.prompt(s.namespace, hashes, turn.prompt_tokens, (s.session_id, j))
            if self.cfg.append_replies and j and turn.shared_blocks >= s.turns[j - 1].num_blocks and prev_ids:
                prompt = prev_ids + prompt[len(prev_ids):] if len(prompt) > len(prev_ids) else prompt
            generated = await self._request(s, j, prompt, self.tokens.scaled(turn.output_tokens))
            prev_ids = prompt + generated
            for sub in turn.subagents:
                task = asyncio.create_task(self._sub(sub.session, sub.delay_s * self.cfg.time_scale))
                (waited if sub.awaited else background).append(task)
        await asyncio.gather(*waited, *background)

    async def _sub(self, s: AgentSession, delay: float) -> None:
        await self.sleep(delay)
        await self._session(s, self.clock() - self._t0)

    async def _request(self, s: AgentSession, j: int, prompt: list[int], max_tokens: int) -> list[int]:
        body = dict(model=self.cfg.model, prompt=prompt, max_tokens=max_tokens, min_tokens=max_tokens,
                    ignore_eos=True, temperature=0.0, stream=True, stream_options={"include_usage": True},
                    return_token_ids=True, session_id=s.session_id)
        if self._limit is not None:
            async with self._limit:
                return await self._send(s, j, body, len(prompt), max_tokens)
        return await self._send(s, j, body, len(prompt), max_tokens)

    async def _send(self, s: AgentSession, j: int, body: dict[str, object], n_prompt: int, max_tokens: int) -> list[int]:
        url = self.cfg.target.rstrip("/") + "/v1/completions"
        sent = self.clock()
        error, reply = None, _Reply()
        try:
            reply = await asyncio.wait_for(_stream(self.client, url, body, sent, self.clock), self.cfg.timeout_s)
        except httpx.HTTPStatusError as e:
            error = str(e)
        except (httpx.HTTPError, asyncio.TimeoutError, json.JSONDecodeError, OSError) as e:
            error = f"{type(e).__name__}: {e}"[:200]
        cached, reused, prefilled, generated = _usage_numbers(reply.usage)
        rec = ReplayRecord(s.session_id, j, self._mode, sent - self._t0, reply.ttft_s, self.clock() - sent,
                           n_prompt, max_tokens, cached, reused, prefilled, generated, error)
        self.records.append(rec)
        self.on_record(rec)
        return reply.token_ids
