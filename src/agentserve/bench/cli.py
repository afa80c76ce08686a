"""`agentserve bench ...`: benchmarks whose results go to docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from rich.console import Console
from rich.table import Table


def _engine(args: argparse.Namespace) -> int:
    import torch

    from agentserve.bench.engine_bench import rows_as_dicts, run_bench

    torch.set_num_threads(args.threads or torch.get_num_threads())
    rows = run_bench(args.model, args.dtype, args.cache_root, prompt_len=args.prompt_len,
                     decode_tokens=args.decode_tokens, concurrency=args.concurrency,
                     repeats=args.repeats)
    t = Table(title=f"engine bench: {args.model}, {args.dtype}, {torch.get_num_threads()} threads, "
                    f"{platform.processor() or platform.machine()}")
    for col in ("metric", "agentserve", "transformers", "ratio"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for r in rows:
        t.add_row(r.metric, f"{r.agentserve:.1f}", f"{r.transformers:.1f}", f"{r.ratio:.2f}x")
    Console().print(t)
    if args.json:
        Path(args.json).write_text(json.dumps(rows_as_dicts(rows), indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (see docs/benchmarks.md)")
    sub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    e = sub.add_parser("engine", help="our engine vs transformers on the same weights")
    e.add_argument("--model", default="qwen2.5-coder-0.5b")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    e.add_argument("--prompt-len", type=int, default=1000)
    e.add_argument("--decode-tokens", type=int, default=64)
    e.add_argument("--concurrency", type=int, default=8)
    e.add_argument("--repeats", type=int, default=2)
    e.add_argument("--threads", type=int, default=None)
    e.add_argument("--json", default=None, help="also write the rows to this JSON file")
    e.set_defaults(func=_engine)
