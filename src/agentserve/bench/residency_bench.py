"""`agentserve bench residency`: concurrent agent sessions against the real server with
`--residency off | shadow | on`, on a KV pool too small for all of them.

Each session replays one real Claude Code session's turn sequence (taken from the even-numbered
trace files: the odd ones are for tuning): its stop reasons decide each turn's request (a tool
call, forced with `tool_choice: required`, or an answer), and its real gaps, scaled down by
`time_scale` and capped, separate the turns (closed loop: a gap starts when the response
arrives). Contents are synthetic: a per-session system prompt, a task, tool results of a few
hundred tokens, follow-ups. Sessions carry `prompt_cache_key` (the identity an OpenAI client sends).

Per run: session JCT (first request to last response), later-turn TTFT (the server's
arrival-to-first-token, turns after the first), recomputed tokens (a turn's cached full blocks
of the previous prompt it resends, which is a prefix of it, that were not reused). Modes run in
turn for each seed, so slow drift of a shared machine spreads over all of them. Figures are
means over seeds with 95% t-intervals, and the per-seed ratios to `off`.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from agentserve.bench.served import served
from agentserve.sim.metrics import percentile
from agentserve.sim.sweep import mean_ci

BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command in the repository",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
WORDS = ("src", "test", "config", "module", "build", "cache", "parser", "server", "client", "index", "router",
         "schema", "token", "block", "engine", "report", "driver", "handler", "worker", "queue")


@dataclass(frozen=True, slots=True)
class Script:
    """One session: the stop reason of each turn and the gap before each later turn."""

    name: str
    stops: tuple[str, ...]  # tool_use | end_turn, per turn
    gaps_s: tuple[float, ...]  # before turns 1..n-1, already scaled


def real_sequences(trace_dir: Path, even: bool = True, max_files: int = 200) -> list[list[tuple[str, float]]]:
    """(stop reason, the real gap after it) sequences of top-level Claude Code sessions."""
    from agentserve.workload.claude_code import read_claude_code

    files = sorted(p for p in trace_dir.glob("trace_*.json*") if (int(p.name[6:10]) % 2 == 0) == even)
    workload = read_claude_code(files[:max_files])
    out = []
    for s in workload.sessions:
        seq = [(s.turns[j].stop.value, s.turns[j + 1].think_s) for j in range(len(s.turns) - 1)]
        seq = [(stop if stop in ("tool_use", "end_turn") else "end_turn", gap) for stop, gap in seq]
        if len(seq) >= 3:
            out.append(seq)
    return out


def scripts(sequences: list[list[tuple[str, float]]], n: int, turns: int, time_scale: float, max_gap_s: float,
            rng: random.Random) -> list[Script]:
    out = []
    for i in range(n):
        seq = rng.choice(sequences)
        start = rng.randrange(0, max(1, len(seq) - turns + 1))
        part = (seq[start:] + seq[:start])[:turns]
        while len(part) < turns:
            part += seq[: turns - len(part)]
        stops = tuple(stop for stop, _ in part)
        gaps = tuple(min(max_gap_s, gap * time_scale) for _, gap in part[:-1])
        out.append(Script(f"s{i}-{rng.randrange(1 << 30):08x}", stops, gaps))
    return out


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) + (f"_{rng.randrange(100)}" if rng.random() < 0.3 else "")
                    for _ in range(words))


@dataclass(slots=True)
class TurnRecord:
    session: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    eligible_tokens: int
    ttft_ms: float | None
    latency_s: float
    status: int
    host_tokens: int = 0  # of cached_tokens, restored from the host tier
    disk_tokens: int = 0  # ... read from disk


async def run_session(client: httpx.AsyncClient, model: str, script: Script, start_delay_s: float,
                      system_words: int, result_words: int, max_tokens: int, seed: int,
                      outcome: bool = False) -> tuple[float, list[TurnRecord]]:
    rng = random.Random(f"{seed}-{script.name}")
    await asyncio.sleep(start_delay_s)
    messages = [{"role": "system", "content": f"You are coding agent {script.name}. Repository notes: "
                                              + _text(rng, system_words)},
                {"role": "user", "content": "Task: " + _text(rng, 30)}]
    records: list[TurnRecord] = []
    prev_prompt = 0
    t0 = time.monotonic()
    for j, stop in enumerate(script.stops):
        if j:
            await asyncio.sleep(script.gaps_s[j - 1])
        body = {"model": model, "messages": messages, "tools": [BASH], "temperature": 0, "max_tokens": max_tokens,
                "tool_choice": "required" if stop == "tool_use" else "none", "prompt_cache_key": script.name}
        sent = time.monotonic()
        r = await client.post("/v1/chat/completions", json=body)
        latency = time.monotonic() - sent
        if r.status_code != 200:
            records.append(TurnRecord(script.name, j, 0, 0, 0, None, latency, r.status_code))
            break
        reply = r.json()
        u = reply["usage"]
        eligible = (prev_prompt // 16) * 16
        tiers = u["agentserve"].get("reused_tokens_by_tier", {})
        records.append(TurnRecord(script.name, j, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                                  eligible, u["agentserve"]["time_to_first_token_ms"], latency, 200,
                                  tiers.get("host", 0), tiers.get("disk", 0)))
        prev_prompt = u["prompt_tokens"]
        msg = reply["choices"][0]["message"]
        calls = msg.get("tool_calls") or []
        if calls:
            messages.append({"role": "assistant", "content": msg.get("content") or "", "tool_calls": calls[:1]})
            messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": _text(rng, result_words)})
        else:
            messages.append({"role": "assistant", "content": msg.get("content") or ""})
            messages.append({"role": "user", "content": "Next: " + _text(rng, 25)})
    if outcome:  # the harness's verdict, for the ledger's cost per successful task
        await client.post(f"/v1/trajectories/{script.name}/events",
                          json={"event": "trajectory_finished", "success": all(r.status == 200 for r in records)})
    return time.monotonic() - t0, records


@dataclass(frozen=True, slots=True)
class RunResult:
    mode: str
    seed: int
    jct_p50_s: float
    jct_p99_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    recomputed_tokens: int
    eligible_tokens: int
    reused_tokens: int
    errors: int
    wall_s: float
    receipts: int
    policy_seconds: float
    host_tokens: int = 0  # reused tokens restored from host
    disk_tokens: int = 0  # reused tokens read from disk
    tier_bytes: dict[str, float] | None = None  # agentserve_kv_tier_bytes_moved by path, at the end


async def one_run(url: str, model: str, mode: str, seed: int, plans: list[Script], args) -> RunResult:
    rng = random.Random(seed)
    delays = [rng.uniform(0, args.stagger_s) for _ in plans]
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        results = await asyncio.gather(*[
            run_session(client, model, s, d, args.system_words, args.result_words, args.max_tokens, seed,
                        getattr(args, "outcomes", False))
            for s, d in zip(plans, delays)])
        stats = {}
        if residency_of(mode) != "off":
            stats = (await client.get("/v1/trajectories/stats")).json()
        metrics = (await client.get("/metrics")).text
        moved = tier_bytes(metrics)
        if getattr(args, "out", None):
            Path(args.out, f"metrics-{mode}-{seed}.txt").write_text(metrics)
    wall = time.monotonic() - t0
    jct = [j for j, _ in results]
    recs = [r for _, rs in results for r in rs]
    later = [r.ttft_ms for r in recs if r.turn > 0 and r.ttft_ms is not None]
    return RunResult(mode, seed, percentile(jct, 50), percentile(jct, 99), percentile(later, 50),
                     percentile(later, 99),
                     sum(max(0, r.eligible_tokens - r.cached_tokens) for r in recs),
                     sum(r.eligible_tokens for r in recs), sum(r.cached_tokens for r in recs),
                     sum(r.status != 200 for r in recs), wall, int(stats.get("receipts", 0)),
                     float(stats.get("policy_seconds", 0.0)), sum(r.host_tokens for r in recs),
                     sum(r.disk_tokens for r in recs), moved)


# Ablations at equal memory (issue 11): the residency mode and whether the KV tiers are on.
# B: LRU prefix cache; D: B + host/disk tiers; E: B + residency; G: all.
ABLATIONS = {"B": ("off", False), "D": ("off", True), "E": ("on", False), "G": ("on", True)}


def residency_of(mode: str) -> str:
    return ABLATIONS[mode][0] if mode in ABLATIONS else mode


def tier_bytes(metrics: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith("agentserve_kv_tier_bytes_moved_total{"):
            path = line.split('path="', 1)[1].split('"', 1)[0]
            out[path] = float(line.rsplit(" ", 1)[1])
    return out


def server_args(args, mode: str, disk_dir: Path, ledger: Path | None = None) -> list[str]:
    """Every ablation gets the same RAM for KV: with tiers the device pool gives up
    --kv-host-share of it to the host store (one DRAM here); the disk tier is extra, its files
    kept out of the page cache so that they cost no RAM either."""
    residency, tiers = ABLATIONS.get(mode, (mode, False))
    total = args.kv_cache_memory_gib
    device = total * (1 - args.kv_host_share) if tiers else total
    out = ["--model", args.model, "--dtype", "bfloat16", "--residency", residency,
           "--kv-cache-memory-gib", f"{device:.6f}", "--max-model-len", str(args.max_model_len),
           "--admission", args.admission]
    if tiers:
        out += ["--kv-host-gib", f"{total * args.kv_host_share:.6f}", "--kv-disk-dir", str(disk_dir),
                "--kv-disk-gib", str(args.kv_disk_gib), "--kv-key", "00" * 32, "--kv-disk-no-page-cache"]
    if ledger is not None:
        out += ["--ledger", str(ledger)]
    return out


def summarize(results: list[RunResult], modes: Sequence[str]) -> str:
    fields = [("jct_p50_s", "JCT p50 s"), ("jct_p99_s", "JCT p99 s"), ("ttft_p50_ms", "later TTFT p50 ms"),
              ("ttft_p99_ms", "later TTFT p99 ms"), ("recomputed_tokens", "recomputed tokens"),
              ("host_tokens", "from host"), ("disk_tokens", "from disk")]
    lines = ["| mode | " + " | ".join(label for _, label in fields) + " | errors |",
             "|---|" + "---:|" * (len(fields) + 1)]
    by = {m: [r for r in results if r.mode == m] for m in modes}
    for m in modes:
        cells = []
        for f, _ in fields:
            mean, half = mean_ci([getattr(r, f) for r in by[m]])
            cells.append(f"{mean:,.1f} ± {half:,.1f}")
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {sum(r.errors for r in by[m])} |")
    base_mode = "off" if "off" in by else "B" if "B" in by else None
    if base_mode is not None:
        lines += ["", f"Per-seed ratio to {base_mode} (mean ± 95% t-interval over seeds):", "",
                  "| mode | " + " | ".join(label for _, label in fields) + " |", "|---|" + "---:|" * len(fields)]
        base = {r.seed: r for r in by[base_mode]}
        for m in modes:
            if m == base_mode:
                continue
            cells = []
            for f, _ in fields:
                ratios = [getattr(r, f) / getattr(base[r.seed], f) for r in by[m]
                          if r.seed in base and getattr(base[r.seed], f)]
                mean, half = mean_ci(ratios)
                cells.append(f"{mean:.3f} ± {half:.3f}")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args) -> int:
    trace_dir = Path(args.traces)
    if not trace_dir.is_dir():
        raise SystemExit(f"no trace directory {trace_dir}; pass --traces DIR (../shared/traces/weka-claude-code)")
    sequences = real_sequences(trace_dir, even=True, max_files=args.max_files)
    if not sequences:
        raise SystemExit(f"no usable sessions in {trace_dir}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[RunResult] = []
    for seed in range(args.seeds):
        plans = scripts(sequences, args.sessions, args.turns, args.time_scale, args.max_gap_s, random.Random(seed))
        order = modes if seed % 2 == 0 else list(reversed(modes))  # no mode always runs first
        for mode in order:
            with tempfile.TemporaryDirectory(prefix="agentserve-bench-kv-") as disk_dir:  # cold per run
                ledger = out_dir / f"ledger-{mode}-s{seed}.jsonl" if args.ledger else None
                if ledger is not None:
                    ledger.unlink(missing_ok=True)
                with served(server_args(args, mode, Path(disk_dir), ledger)) as srv:
                    r = asyncio.run(one_run(srv.url, args.model, mode, seed, plans, args))
            results.append(r)
            print(json.dumps(asdict(r)), flush=True)
            (out_dir / "results.json").write_text(json.dumps([asdict(x) for x in results], indent=1))
    table = summarize(results, modes)
    (out_dir / "summary.md").write_text(table + "\n")
    print(table)
    if args.ledger:  # the modes of seed 0 side by side (docs/ledger.md)
        from agentserve.cli import main as cli

        files = [str(out_dir / f"ledger-{m}-s0.jsonl") for m in modes]
        cli(["report", *files, *[f"--label={m}" for m in modes], "--out", str(out_dir / "report"),
             "--title", f"agentserve bench residency, seed 0: {', '.join(modes)}"])
    return 0


def add_args(p) -> None:
    p.add_argument("--traces", default="../shared/traces/weka-claude-code")
    p.add_argument("--max-files", type=int, default=200, help="even-numbered trace files read for gaps")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--modes", default="off,shadow,on",
                   help="residency modes, or the tier ablations B,D,E,G (B LRU, D +tiers, E +residency, G all)")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=1 / 30, help="real gaps are multiplied by this")
    p.add_argument("--max-gap-s", type=float, default=20.0)
    p.add_argument("--stagger-s", type=float, default=5.0, help="sessions start uniformly within this")
    p.add_argument("--system-words", type=int, default=250)
    p.add_argument("--result-words", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-cache-memory-gib", type=float, default=0.12,
                   help="RAM for KV: the device pool, or pool + host store for D and G")
    p.add_argument("--kv-host-share", type=float, default=0.25, help="D, G: share of that RAM in the host store")
    p.add_argument("--kv-disk-gib", type=float, default=4.0, help="D, G: the disk tier's bound")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--admission", default="auto", choices=("auto", "eager", "protective"),
                   help="every server's --admission (auto: protective with residency on, else eager)")
    p.add_argument("--out", default="bench-residency")
    p.add_argument("--ledger", action="store_true",
                   help="each server writes its ledger to OUT/ledger-MODE-sSEED.jsonl; OUT/report shows seed 0's modes")
    p.add_argument("--outcomes", action="store_true",
                   help="end each session with trajectory_finished and success (changes what residency sees)")
