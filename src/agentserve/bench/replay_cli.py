"""`agentserve replay TRACE --target URL`: replay agent sessions against a live server."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

from agentserve.bench.replay import ReplayConfig, ReplayRecord, Replayer
from agentserve.sim.metrics import percentile
from agentserve.workload.load import FORMATS, load_workload, take_sessions
from agentserve.workload.model import TraceError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("replay", help="replay agent traces against a live OpenAI-compatible server")
    p.add_argument("trace", nargs="*")
    p.add_argument("--target", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default="default")
    p.add_argument("--format", default="auto", choices=FORMATS)
    p.add_argument("--synthetic-sessions", type=int, default=4)
    p.add_argument("--max-sessions", type=int, default=None)
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies think times, trace times and Poisson gaps")
    p.add_argument("--poisson", action="store_true", help="Poisson session starts even where the trace has times")
    p.add_argument("--session-rate", type=float, default=1 / 300, help="sessions per second (Poisson)")
    p.add_argument("--closed-loop", type=int, default=None, metavar="N",
                   help="at most N requests in flight (closed loop; labelled in every record)")
    p.add_argument("--token-scale", type=float, default=1.0, help="scale prompt/output lengths (0, 1]")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--no-append-replies", action="store_true", help="never splice generated ids into prompts")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write records.jsonl and summary.json here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        workload = take_sessions(load_workload(args.trace, args.format, args.synthetic_sessions, args.seed),
                                 args.max_sessions)
        cfg = ReplayConfig(args.target, args.model, args.time_scale, args.poisson, args.session_rate,
                           args.closed_loop, args.token_scale, args.vocab_size, not args.no_append_replies,
                           args.timeout, args.seed)
    except (TraceError, ValueError) as e:
        print(f"agentserve replay: {e}", file=sys.stderr)
        return 2
    for s in workload.skipped[:10]:
        print(f"skipped {s}", file=sys.stderr)
    records = asyncio.run(_replay(workload, cfg))
    summary = summarize(records)
    print(json.dumps(summary, indent=1))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with (out / "records.jsonl").open("w") as f:
            for r in records:
                f.write(json.dumps(asdict(r)) + "\n")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if summary["errors"] < summary["requests"] else 1


async def _replay(workload, cfg: ReplayConfig) -> list[ReplayRecord]:  # type: ignore[no-untyped-def]
    import httpx
    from rich.progress import Progress

    with Progress(transient=False) as bar:
        task = bar.add_task(f"replay ({'closed' if cfg.closed_loop else 'open'} loop)", total=workload.num_requests)
        async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s)) as client:
            replayer = Replayer(workload, cfg, client, on_record=lambda r: bar.advance(task))
            return await replayer.run()


def summarize(records: list[ReplayRecord]) -> dict[str, object]:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    span = max((r.sent_s + r.e2e_s for r in records), default=0.0)
    return dict(
        mode=records[0].mode if records else "open-loop", requests=len(records),
        errors=len(records) - len(ok), first_errors=[r.error for r in records if r.error][:5],
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        e2e_p50_s=percentile(e2e, 50), e2e_p99_s=percentile(e2e, 99),
        prompt_tokens=prompt, cached_tokens=cached, cached_fraction=cached / prompt if prompt else 0.0,
        generated_tokens=sum(r.generated_tokens or 0 for r in ok), wall_s=span)
