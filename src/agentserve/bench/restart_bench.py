"""`agentserve bench restart`: a session whose server restarted between two turns, against the
same turn on a cold server.

Per repeat: a server with `--kv-disk-dir` (a fresh directory) answers the session's first turn
(a long system prompt, a task) and stops; a second server on the same directory and key answers
the next turn; a cold server (a fresh directory) answers the same next turn. Reported: the next
turn's reused tokens by tier and its TTFT (the server's arrival-to-first-token) on the restarted
and the cold server. Files are dropped from the page cache (`--kv-disk-no-page-cache`), so the
restarted server reads them from the disk. Repeats alternate which of the two runs first.
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from agentserve.bench.served import served
from agentserve.sim.sweep import mean_ci

KEY = "ab" * 32


@dataclass(frozen=True, slots=True)
class TurnResult:
    server: str  # restarted | cold
    repeat: int
    prompt_tokens: int
    reused_tokens: int
    disk_tokens: int
    ttft_ms: float


def _conversation(rng: random.Random, words: int) -> list[dict[str, str]]:
    vocab = ("module", "cache", "token", "router", "schema", "worker", "driver", "index", "parser", "queue")
    notes = " ".join(f"{rng.choice(vocab)}_{rng.randrange(1000)}" for _ in range(words))
    return [{"role": "system", "content": f"You are a coding agent. Repository notes: {notes}"},
            {"role": "user", "content": "Summarize the repository layout in one sentence."}]


def _ask(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def _server(args, disk_dir: Path) -> list[str]:  # type: ignore[no-untyped-def]
    return ["--model", args.model, "--dtype", "bfloat16", "--residency", "off", "--kv-disk-dir", str(disk_dir),
            "--kv-disk-gib", "4", "--kv-key", KEY, "--kv-disk-no-page-cache"]


def _next_turn(args, disk_dir: Path, messages, repeat: int, server: str) -> TurnResult:  # type: ignore[no-untyped-def]
    with served(_server(args, disk_dir)) as srv:
        u = _ask(srv.url, args.model, messages, args.max_tokens)["usage"]
    a = u["agentserve"]
    return TurnResult(server, repeat, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                      a["reused_tokens_by_tier"]["disk"], a["time_to_first_token_ms"])


def run(args) -> int:  # type: ignore[no-untyped-def]
    results: list[TurnResult] = []
    for repeat in range(args.repeats):
        messages = _conversation(random.Random(repeat), args.system_words)
        with tempfile.TemporaryDirectory(prefix="agentserve-restart-") as warm, \
                tempfile.TemporaryDirectory(prefix="agentserve-cold-") as cold:
            with served(_server(args, Path(warm))) as srv:
                reply = _ask(srv.url, args.model, messages, args.max_tokens)
            follow = [*messages, {"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""},
                      {"role": "user", "content": "Which module would you change first?"}]
            order = [("restarted", Path(warm)), ("cold", Path(cold))]
            for server, d in order if repeat % 2 == 0 else order[::-1]:
                r = _next_turn(args, d, follow, repeat, server)
                results.append(r)
                print(json.dumps(asdict(r)), flush=True)
    lines = ["| server | prompt tokens | reused (from disk) | TTFT ms (mean ± 95% CI) |", "|---|---:|---:|---:|"]
    for server in ("restarted", "cold"):
        rs = [r for r in results if r.server == server]
        mean, half = mean_ci([r.ttft_ms for r in rs])
        lines.append(f"| {server} | {rs[0].prompt_tokens} | {sum(r.reused_tokens for r in rs) / len(rs):.0f} "
                     f"({sum(r.disk_tokens for r in rs) / len(rs):.0f}) | {mean:,.0f} ± {half:,.0f} |")
    by = {(r.server, r.repeat): r.ttft_ms for r in results}
    ratio, half = mean_ci([by["restarted", i] / by["cold", i] for i in range(args.repeats)])
    lines += ["", f"TTFT restarted / cold, per repeat: {ratio:.3f} ± {half:.3f}"]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "restart.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
        Path(args.out, "restart.md").write_text(table + "\n")
    return 0


def add_args(p) -> None:  # type: ignore[no-untyped-def]
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--system-words", type=int, default=900, help="about 2,000 tokens of system prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default=None)
