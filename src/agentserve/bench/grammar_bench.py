"""`agentserve bench grammar`: does a request bringing a new 40-tool forced-call grammar stall
the streams already running?

Per mode, a fresh `agentserve serve` subprocess on 127.0.0.1 runs N streaming completions; then,
round after round, a chat request forcing a call over 40 realistic tools, with names salted so
every round is a grammar the server has never seen, and its control: the same request with
tool_choice "auto" (same body, same prompt, no grammar), in alternating order. The round's prompt
is put in the prefix cache first (a completion over the same token ids), so the windows measure
the door and the grammar rather than a prefill. Inter-token latency (ITL) of the running streams,
at the client, from chunks arriving
  before:  just before each of those requests is sent, for as long as it then took;
  control: while the control is in flight (sent -> done; it generates a few tokens);
  new:     while the forced call is in flight;
  plain:   while a request with the same messages and no tools at all is in flight (its prompt
           prefilled too): what any request joining the batch costs the streams.
On a shared machine the control is the fair yardstick: new vs control is what the grammar costs.
Modes: `worker` (compiled once per grammar on a worker before the engine sees it), `inline`
(--grammar-inline: tools checked on the event loop and the grammar compiled on the step thread,
the behaviour before issue 9), `baseline` (another checkout's src/, e.g. main's).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from agentserve.bench.grammar_client import (ForcedCall, ServerSpec, forced_call, prefill, server,
                                             stream_tokens)
from agentserve.bench.tool_schemas import agent_tools

MODES = ("worker", "inline", "baseline")
MESSAGES = [{"role": "user", "content": "Book a 30-minute meeting with bob@example.com on Monday at 10:00."}]


@dataclass(frozen=True, slots=True)
class GrammarBenchConfig:
    model: str = "smollm2-135m"
    dtype: str = "bfloat16"
    device: str | None = None
    streams: int = 4
    rounds: int = 16
    guided_max_tokens: int = 4
    quiet_s: float = 1.5
    port: int = 8731
    modes: tuple[str, ...] = ("worker", "inline")
    baseline_src: Path | None = None
    startup_timeout_s: float = 300.0
    log_dir: Path = Path("/tmp")

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:  # a typo would otherwise run as `worker`
            raise ValueError(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(MODES)}")
        if "baseline" in self.modes and self.baseline_src is None:
            raise ValueError("mode 'baseline' needs --baseline-src (a checkout's src/ directory)")


@dataclass(frozen=True, slots=True)
class Latency:
    p50_ms: float
    p99_ms: float
    num_gaps: int
    # The longest gap in each window, median over the windows: a stall shows in every window it
    # hits, while a stray OS hiccup moves the p99 of a few hundred gaps but not this.
    stall_ms: float


@dataclass(frozen=True, slots=True)
class ModeResult:
    mode: str
    before: Latency  # ITL in the quiet windows
    control: Latency  # ITL while the same request with tool_choice "auto" (no grammar) is in flight
    new: Latency  # ITL while the forced call with a never-seen grammar is in flight
    plain: Latency  # ITL while a request with no tools (no schema, no grammar) is in flight
    door_control_p50_ms: float  # sent -> first chunk: past the door and into the engine
    door_new_p50_ms: float  # the same, with tool checks and the grammar's compile when off-thread
    num_ok: int  # requests answered 200 (of 3 per round)
    cached_fraction: float  # of their prompt tokens, from the prefix cache
    errors: tuple[str, ...]

    @property
    def p99_vs_before(self) -> float:
        return self.new.p99_ms / self.before.p99_ms

    @property
    def p99_vs_control(self) -> float:
        return self.new.p99_ms / self.control.p99_ms

    @property
    def plain_vs_before(self) -> float:
        return self.plain.p99_ms / self.before.p99_ms

    @property
    def p50_vs_before(self) -> float:
        return self.new.p50_ms / self.before.p50_ms

    @property
    def stall_vs_before(self) -> float:
        return self.new.stall_ms / self.before.stall_ms


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile; nan for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def gaps_in(stamps: list[list[float]], windows: list[tuple[float, float]]) -> list[float]:
    """Every stream's inter-chunk gaps whose later chunk arrived inside one of the windows, in ms."""
    out = []
    for s in stamps:
        for a, b in zip(s, s[1:], strict=False):
            if any(lo <= b < hi for lo, hi in windows):
                out.append((b - a) * 1000)
    return out


def chat_prompt_ids(tokenizer: Any, tools: list[dict[str, Any]]) -> list[int]:
    """The token ids the server will render for the forced call, or with no tools for a plain
    request (its own prompt builder)."""
    from agentserve.server.chat import build_chat_prompt
    from agentserve.server.protocol import ChatCompletionRequest

    fields = {"tools": tools, "tool_choice": "required"} if tools else {}
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})
    return build_chat_prompt(body, tokenizer).token_ids


Windows = dict[str, list[tuple[float, float]]]  # kind -> (start, end) perf_counter windows


async def _rounds(client: httpx.AsyncClient, cfg: GrammarBenchConfig, model: str, tokenizer: Any,
                  salt: str) -> tuple[list[tuple[str, ForcedCall]], Windows]:
    """Each round: a new tool set, its prompt prefilled, then (in rotating order) the control,
    the forced call and the plain request, each after a quiet window. A request's "before"
    window is the end of its quiet window, as long as the request then took (so both windows
    hold as many steps)."""
    calls: list[tuple[str, ForcedCall]] = []
    windows: Windows = {"before": [], "control": [], "new": [], "plain": []}
    await prefill(client, model, chat_prompt_ids(tokenizer, []))
    kinds = ("control", "new", "plain")
    for r in range(cfg.rounds):
        tools = agent_tools(f"_{salt}{r}")
        await prefill(client, model, chat_prompt_ids(tokenizer, tools))
        for kind in kinds[r % 3:] + kinds[: r % 3]:
            await asyncio.sleep(cfg.quiet_s)
            quiet_from = time.perf_counter() - cfg.quiet_s
            if kind == "plain":
                call = await forced_call(client, model, MESSAGES, [], cfg.guided_max_tokens, None)
            else:
                choice = "auto" if kind == "control" else "required"
                call = await forced_call(client, model, MESSAGES, tools, cfg.guided_max_tokens, choice)
            windows["before"].append((max(quiet_from, 2 * call.sent - call.done), call.sent))
            windows[kind].append((call.sent, call.done))
            calls.append((kind, call))
    return calls, windows


async def run_mode(cfg: GrammarBenchConfig, mode: str, tokenizer: Any) -> ModeResult:
    spec = ServerSpec(cfg.model, cfg.dtype, cfg.device, cfg.port, cfg.streams + 4, inline=mode == "inline",
                      src=cfg.baseline_src if mode == "baseline" else None)
    log_path = cfg.log_dir / f"agentserve-bench-grammar-{mode}.log"
    salt = uuid.uuid4().hex[:6]  # never a grammar any cache has seen
    with server(spec, log_path, cfg.startup_timeout_s) as url:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            await forced_call(client, model, MESSAGES, agent_tools(f"_{salt}w"), cfg.guided_max_tokens)  # one-offs
            stamps: list[list[float]] = [[] for _ in range(cfg.streams)]
            tasks = [asyncio.create_task(stream_tokens(client, model, f"Story {i}: once upon a time", 100_000, s))
                     for i, s in enumerate(stamps)]
            try:
                while min(len(s) for s in stamps) < 5:
                    await asyncio.sleep(0.1)
                calls, windows = await _rounds(client, cfg, model, tokenizer, salt)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    return _summarize(mode, stamps, calls, windows)


def _latency(stamps: list[list[float]], windows: list[tuple[float, float]]) -> Latency:
    gaps = gaps_in(stamps, windows)
    longest = [max(g) for g in (gaps_in(stamps, [w]) for w in windows) if g]
    return Latency(percentile(gaps, 50), percentile(gaps, 99), len(gaps), percentile(longest, 50))


def _summarize(mode: str, stamps: list[list[float]], calls: list[tuple[str, ForcedCall]],
               windows: Windows) -> ModeResult:
    ok = [(k, c) for k, c in calls if c.status == 200]

    def door(kind: str) -> float:
        return percentile([(c.admitted - c.sent) * 1000 for k, c in ok if k == kind and c.admitted], 50)

    cached = sum(c.cached_tokens or 0 for _, c in ok) / max(1, sum(c.prompt_tokens or 0 for _, c in ok))
    return ModeResult(
        mode=mode, before=_latency(stamps, windows["before"]), control=_latency(stamps, windows["control"]),
        new=_latency(stamps, windows["new"]), plain=_latency(stamps, windows["plain"]), door_control_p50_ms=door("control"), door_new_p50_ms=door("new"),
        num_ok=len(ok), cached_fraction=cached,
        errors=tuple(f"{k}: HTTP {c.status}: {c.error}" for k, c in calls if c.status != 200))


async def run_grammar_bench(cfg: GrammarBenchConfig) -> list[ModeResult]:
    from agentserve.model.loader import load_tokenizer, resolve_model_dir

    root = Path.home() / ".cache" / "agentserve"
    tokenizer = load_tokenizer(resolve_model_dir(cfg.model, root))
    return [await run_mode(cfg, mode, tokenizer) for mode in cfg.modes]


def result_dicts(results: list[ModeResult]) -> list[dict[str, Any]]:
    return [{**asdict(r), "p99_vs_before": r.p99_vs_before, "p99_vs_control": r.p99_vs_control,
             "plain_vs_before": r.plain_vs_before,
             "p50_vs_before": r.p50_vs_before, "stall_vs_before": r.stall_vs_before} for r in results]
