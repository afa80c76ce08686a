"""`agentserve bench ...`: benchmarks whose results go to docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agentserve.config import ADMISSIONS


def _engine(args: argparse.Namespace) -> int:
    from agentserve.bench.engine_bench import rows_as_dicts, run_bench
    from agentserve.model.reference import set_threads

    threads = set_threads(args.threads)
    rows = run_bench(args.model, args.dtype, args.cache_root, prompt_len=args.prompt_len,
                     decode_tokens=args.decode_tokens, concurrency=args.concurrency,
                     repeats=args.repeats)
    t = Table(title=f"engine bench: {args.model}, {args.dtype}, {threads} threads, "
                    f"{platform.processor() or platform.machine()}")
    for col in ("metric", "agentserve", "transformers", "ratio"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for r in rows:
        t.add_row(r.metric, f"{r.agentserve:.1f}", f"{r.transformers:.1f}", f"{r.ratio:.2f}x")
    Console().print(t)
    if args.json:
        Path(args.json).write_text(json.dumps(rows_as_dicts(rows), indent=2))
    return 0


def _precision(args: argparse.Namespace) -> int:
    from agentserve.bench.precision_bench import MODES, rows_as_dicts, run_precision_bench
    from agentserve.model.precision import cpu_flags, cpu_has_native_bf16
    from agentserve.model.reference import set_threads

    threads = set_threads(args.threads)
    modes = tuple(MODES) if args.modes is None else tuple(m.strip() for m in args.modes.split(","))
    rows = run_precision_bench(args.model, modes, tuple(args.prompt_lens), tuple(args.batches),
                               args.decode_tokens, args.repeats, args.cache_root)
    native = "native bf16 (AVX512-BF16 / AMX)" if cpu_has_native_bf16() else "no bf16 dot product"
    t = Table(title=f"precision bench: {args.model}, {threads} threads, {platform.machine()}, {native}; "
                    f"best of {args.repeats}")
    metrics = list(dict.fromkeys(r.metric for r in rows))
    t.add_column("metric")
    for m in modes:
        t.add_column(m, justify="right")
    for metric in metrics:
        t.add_row(metric, *(f"{r.value:.1f}" for m in modes for r in rows if r.mode == m and r.metric == metric))
    Console().print(t)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma")))
    Console().print(f"CPU flags: {' '.join(flags) or 'none read'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows_as_dicts(rows), indent=2))
    return 0


def _attention(args: argparse.Namespace) -> int:
    from agentserve.model.attention_bench import run_attention_bench
    from agentserve.model.cpu_kernels import load_cpu_kernels
    from agentserve.model.reference import set_threads

    threads = set_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.bf16_prefill:
        print("agentserve: the bf16 prefill kernel is not built here (it needs g++ and a CPU with "
              "AVX512-BF16); bf16 prefill uses torch's SDPA")
        return 1
    rows = run_attention_bench(kernels, budget_s=args.budget)
    t = Table(title=f"prefill attention, bf16, 14 heads / 2 KV heads x 64, {threads} threads "
                    "(best of repeats, side by side)")
    for col in ("rows", "cached", "torch SDPA ms", "kernel ms", "kernel GFLOP/s", "speedup"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r.rows), str(r.start), f"{r.torch_ms:.2f}", f"{r.kernel_ms:.2f}",
                  f"{r.kernel_gflops:.0f}", f"{r.speedup:.2f}x")
    Console().print(t)
    return 0


def _decode(args: argparse.Namespace) -> int:
    from agentserve.model.cpu_kernels import load_cpu_kernels
    from agentserve.model.decode_bench import run_decode_attention_bench, run_linear_bench, run_step_bench
    from agentserve.model.reference import set_threads

    threads = set_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.bf16_small_linear:
        print("agentserve: the bf16 decode kernels are not built here (they need g++ and a CPU with "
              "AVX512-BF16); bf16 decode uses oneDNN and the fp32 attention loop")
        return 1
    t = Table(title=f"few-row bf16 linears, Qwen2.5-0.5B shapes, cold weights, {threads} threads "
                    "(best of repeats, side by side)")
    for col in ("rows", "N x K", "oneDNN ms", "GB/s", "kernel ms", "GB/s ", "speedup"):
        t.add_column(col, justify="right")
    for r in run_linear_bench(kernels, budget_s=args.budget):
        t.add_row(str(r.rows), f"{r.n} x {r.k}", f"{r.onednn_ms:.3f}", f"{r.gbps(r.onednn_ms):.1f}",
                  f"{r.kernel_ms:.3f}", f"{r.gbps(r.kernel_ms):.1f}", f"{r.speedup:.2f}x")
    Console().print(t)
    t = Table(title="bf16 decode attention per layer call, 14 heads / 2 KV heads x 64, cold KV")
    for col in ("sequences", "context", "fp32 loop ms", "bf16 tiles ms", "speedup"):
        t.add_column(col, justify="right")
    for a in run_decode_attention_bench(kernels, budget_s=args.budget):
        t.add_row(str(a.sequences), str(a.context), f"{a.loop_ms:.3f}", f"{a.tiles_ms:.3f}", f"{a.speedup:.2f}x")
    Console().print(t)
    if args.steps:
        t = Table(title=f"decode step of {args.model}, bf16, 2k contexts: the kernels against oneDNN and torch ops")
        for col in ("batch", "kernels ms/step", "matmul kernel only", "neither (oneDNN)", "fused glue", "both"):
            t.add_column(col, justify="right")
        for s in run_step_bench(args.model):
            t.add_row(str(s.batch), f"{s.kernel_ms:.1f}", f"{s.torch_glue_ms:.1f}", f"{s.onednn_ms:.1f}",
                      f"{s.glue_speedup:.2f}x", f"{s.speedup:.2f}x")
        Console().print(t)
    return 0


def _agent(args: argparse.Namespace) -> int:
    import asyncio

    from agentserve.bench.agent_bench import run_agent_bench, write_json

    workload = Path(args.workload)
    if not workload.is_file():
        raise SystemExit(f"agentserve bench agent: workload {workload} not found; pass --workload "
                         "PATH to agent-4x6.json (in ../shared/bench/ beside the checkout)")
    results, records = asyncio.run(run_agent_bench(args.target, workload, args.think_time, model=args.model))
    t = Table(title=f"agent-4x6 against {args.target}")
    for col in ("set", "wall s", "TTFT 2-6 p50 / p90 s", "TTFT turn 1 p50 s", "cached 2-6",
                "cached turn 1", "generated tok/s"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(r.set_name, f"{r.wall_s:.1f}", f"{r.ttft_later_p50_s:.2f} / {r.ttft_later_p90_s:.2f}",
                  f"{r.ttft_turn1_p50_s:.2f}", f"{r.cached_later:.1%}", f"{r.cached_turn1:.1%}",
                  f"{r.generated_tok_s:.1f}")
    Console().print(t)
    if args.json:
        write_json(Path(args.json), results, records)
    return 0


def _overload(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from agentserve.bench.overload import run_overload

    r = run_overload(args.model, args.max_queued_requests, args.factor, args.large_bytes,
                     args.max_request_body_bytes, args.max_tokens, args.serve_arg or [])
    t = Table(title=f"overload: a burst of {r.sent} requests ({args.factor}x the queue bound "
                    f"{args.max_queued_requests}) against {args.model}")
    for col in ("completed", "shed 429", "413", "other 4xx", "lost", "wall s", "RSS idle / peak MiB",
                "alive", "used blocks after"):
        t.add_column(col, justify="right")
    t.add_row(str(r.completed), str(r.shed), str(r.too_large), str(r.rejected), str(r.lost),
              f"{r.wall_s:.1f}", f"{r.idle_rss_mib:.0f} / {r.peak_rss_mib:.0f}", str(r.alive_after),
              str(r.used_blocks_after))
    Console().print(t)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(r), indent=2))
    return 0 if r.lost == 0 and r.alive_after and r.used_blocks_after == 0 else 1


def _fuzz(args: argparse.Namespace) -> int:
    import logging

    from agentserve.bench.fuzz import FuzzConfig, render, run_fuzz, summary

    try:
        import schemathesis  # noqa: F401
    except ImportError:
        raise SystemExit("agentserve bench fuzz needs the dev extras: pip install -e '.[dev]'") from None
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = FuzzConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                        max_tokens=args.max_tokens, max_examples=args.examples, seed=args.seed,
                        max_time_s=args.max_time)
    report = run_fuzz(config)
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(summary(report), indent=2))
    return 0 if report.ok() and not report.check_failures else 1


def _grammar(args: argparse.Namespace) -> int:
    import asyncio

    from agentserve.bench.grammar_bench import GrammarBenchConfig, result_dicts, run_grammar_bench

    modes = tuple(m.strip() for m in args.modes.split(","))
    try:
        cfg = GrammarBenchConfig(model=args.model, dtype=args.dtype, device=args.device, streams=args.streams,
                                 rounds=args.rounds, port=args.port, modes=modes,
                                 baseline_src=Path(args.baseline_src) if args.baseline_src else None)
    except ValueError as exc:
        raise SystemExit(f"agentserve bench grammar: {exc}") from None
    results = asyncio.run(run_grammar_bench(cfg))
    t = Table(title=f"grammar bench: {args.model}, {args.streams} streams, {args.rounds} rounds of a new 40-tool "
                    f"forced call, its tool_choice=auto control and a request with no tools, {platform.processor() or platform.machine()}")
    for col in ("mode", "ITL p50 / p99 / stall ms: before", "control", "new grammar", "no tools", "p99 new/before",
                "p99 new/control", "p99 no-tools/before", "stall new/before", "door ms control / new", "ok", "cached"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(r.mode, *(f"{x.p50_ms:.0f} / {x.p99_ms:.0f} / {x.stall_ms:.0f} ({x.num_gaps})"
                            for x in (r.before, r.control, r.new, r.plain)),
                  f"{r.p99_vs_before:.2f}x", f"{r.p99_vs_control:.2f}x", f"{r.plain_vs_before:.2f}x",
                  f"{r.stall_vs_before:.2f}x",
                  f"{r.door_control_p50_ms:.0f} / {r.door_new_p50_ms:.0f}", f"{r.num_ok}/{3 * args.rounds}",
                  f"{r.cached_fraction:.0%}")
    Console(width=200).print(t)
    for r in results:
        for e in r.errors:
            Console().print(f"[red]{r.mode}: {e}")
    if args.gil:
        _gil(args.model)
    if args.json:
        Path(args.json).write_text(json.dumps(result_dicts(results), indent=2, default=str))
    return 0


def _residency(args: argparse.Namespace) -> int:
    from agentserve.bench.residency_bench import run

    return run(args)


def _kv_copy(args: argparse.Namespace) -> int:
    from agentserve.bench.kv_copy import run

    return run(args)


def _restart(args: argparse.Namespace) -> int:
    from agentserve.bench.restart_bench import run

    return run(args)


def _tier_grid(args: argparse.Namespace) -> int:
    from agentserve.sim.tier_grid import run

    return run(args)


def _prediction(args: argparse.Namespace) -> int:
    from agentserve.sim.prediction import run

    return run(args)


def _gil(model: str) -> None:
    from agentserve.bench.gil_probe import probe
    from agentserve.bench.tool_schemas import agent_tools
    from agentserve.model.loader import load_model_config, load_tokenizer, resolve_model_dir
    from agentserve.server.chat import _guide
    from agentserve.server.protocol import ChatCompletionRequest

    def guide(salt: str):
        return _guide(ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                            "tools": agent_tools(salt), "tool_choice": "required"}))

    model_dir = resolve_model_dir(model, Path.home() / ".cache" / "agentserve")
    t = Table(title="llguidance and the GIL: a Python thread spinning beside its work")
    for col in ("work", "ms alone", "ms beside", "spinner rate vs alone", "longest spinner stall ms"):
        t.add_column(col, justify="right")
    for p in probe(load_tokenizer(model_dir), load_model_config(model_dir).vocab_size, guide):
        t.add_row(p.what, f"{p.alone_ms:.0f}", f"{p.beside_ms:.0f}", f"{p.rate_vs_solo:.0%}",
                  f"{p.longest_stall_ms:.1f}")
    Console().print(t)


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
    pr = sub.add_parser("precision", help="a bf16 model in fp32 arithmetic vs bf16 arithmetic vs fp32 weights")
    pr.add_argument("--model", default="qwen2.5-coder-0.5b")
    pr.add_argument("--modes", default=None, help="comma-separated, of: " + ", ".join(
        ["bf16 weights, fp32 arithmetic", "bf16 arithmetic", "fp32 weights"]) + " (default: all)")
    pr.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    pr.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    pr.add_argument("--decode-tokens", type=int, default=32)
    pr.add_argument("--repeats", type=int, default=2)
    pr.add_argument("--threads", type=int, default=None)
    pr.add_argument("--json", default=None, help="also write the rows to this JSON file")
    pr.set_defaults(func=_precision)
    at = sub.add_parser("attention", help="the C++ prefill attention vs torch's SDPA, chunk by chunk")
    at.add_argument("--budget", type=float, default=2.0, help="seconds of repeats per side and row")
    at.add_argument("--threads", type=int, default=None)
    at.set_defaults(func=_attention)
    dc = sub.add_parser("decode", help="the C++ decode kernels (few-row linears, bf16 attention) vs what they replace")
    dc.add_argument("--budget", type=float, default=1.0, help="seconds of repeats per side and row")
    dc.add_argument("--threads", type=int, default=None)
    dc.add_argument("--steps", action="store_true", help="also time the bundled model's decode steps")
    dc.add_argument("--model", default="qwen2.5-coder-0.5b")
    dc.set_defaults(func=_decode)
    a = sub.add_parser("agent", help="the agent-4x6 workload against an OpenAI-compatible server")
    a.add_argument("--target", default="http://127.0.0.1:8000")
    a.add_argument("--workload", default=str(Path(__file__).resolve().parents[3].parent / "shared" / "bench" / "agent-4x6.json"))
    a.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    a.add_argument("--think-time", type=float, default=2.0)
    a.add_argument("--json", default=None)
    a.set_defaults(func=_agent)
    o = sub.add_parser("overload", help="a burst of 10x the queue bound against a server it starts")
    o.add_argument("--model", default="qwen2.5-coder-0.5b")
    o.add_argument("--max-queued-requests", type=int, default=32)
    o.add_argument("--factor", type=int, default=10, help="the burst is this many times the bound")
    o.add_argument("--large-bytes", type=int, default=1 << 20, help="size of every 10th request's content")
    o.add_argument("--max-request-body-bytes", type=int, default=4 << 20)
    o.add_argument("--max-tokens", type=int, default=16)
    o.add_argument("--serve-arg", action="append", help="an extra argument for `agentserve serve`")
    o.add_argument("--json", default=None)
    o.set_defaults(func=_overload)
    f = sub.add_parser("fuzz", help="schemathesis against the server's OpenAPI document, on the small model")
    f.add_argument("--examples", type=int, default=200, help="per operation, phase and mode (positive/negative)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--model", default="smollm2-135m")
    f.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    f.add_argument("--max-model-len", type=int, default=256)
    f.add_argument("--max-tokens", type=int, default=8, help="generation cap per request")
    f.add_argument("--max-time", type=int, default=None, help="stop after this many seconds")
    f.add_argument("--json", default=None, help="also write the figures and findings to this file")
    f.set_defaults(func=_fuzz)
    g = sub.add_parser("grammar", help="inter-token latency of running streams while a new 40-tool grammar compiles")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--device", default=None)
    g.add_argument("--streams", type=int, default=4)
    g.add_argument("--rounds", type=int, default=16,
                   help="each: a forced call with a grammar never seen before, and its control")
    g.add_argument("--port", type=int, default=8731)
    g.add_argument("--modes", default="worker,inline",
                   help="comma-separated: worker, inline (--grammar-inline), baseline (needs --baseline-src)")
    g.add_argument("--baseline-src", default=None, help="another checkout's src/ for mode 'baseline' (e.g. main's)")
    g.add_argument("--gil", action="store_true", help="also measure whether llguidance holds the GIL")
    g.add_argument("--json", default=None)
    g.set_defaults(func=_grammar)
    from agentserve.bench.residency_bench import add_args

    r = sub.add_parser("residency", help="agent sessions with real gaps against --residency off|shadow|on")
    add_args(r)
    r.set_defaults(func=_residency)
    from agentserve.bench.kv_copy import add_args as kv_copy_args

    k = sub.add_parser("kv-copy", help="pool <-> host <-> disk KV moves against a plain memcpy")
    kv_copy_args(k)
    k.set_defaults(func=_kv_copy)
    from agentserve.bench.restart_bench import add_args as restart_args

    rs = sub.add_parser("restart", help="a session's next turn after a server restart, against a cold server")
    restart_args(rs)
    rs.set_defaults(func=_restart)
    from agentserve.bench.peers.cli import add_args as peers_args
    from agentserve.bench.peers.cli import run as peers_run

    pe = sub.add_parser("peers", help="agentserve vs vLLM for CPU vs llama.cpp's server, interleaved (docs/peers.md)")
    peers_args(pe)
    pe.set_defaults(func=peers_run)
    from agentserve.sim.tier_grid import add_args as tier_grid_args

    tg = sub.add_parser("tier-grid", help="the Claude Code grid with KV tiers in the simulator (B, D, E, G)")
    tier_grid_args(tg)
    tg.set_defaults(func=_tier_grid)
    q = sub.add_parser("prediction", help="return-time prediction quality of the residency policy, in the simulator")
    q.add_argument("trace", nargs="+", help="trace files or directories")
    q.add_argument("--sessions", type=int, default=100)
    q.add_argument("--capacity", default="1M", help="KV pool, tokens")
    q.add_argument("--rate", type=float, default=1 / 300, help="sessions per second (Poisson)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--events", default="none", choices=["none", "terminal"])
    q.add_argument("--admission", default="auto", choices=list(ADMISSIONS),
                   help="as sim's (auto: protective; tables before 2026-12-04: eager)")
    q.add_argument("--cost-model", default="h200-llama3-8b")
    q.add_argument("--json", default=None)
    q.set_defaults(func=_prediction)
