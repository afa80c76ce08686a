"""`agentserve sim TRACE ...`: simulated replay of agent traces against the engine's own
scheduler and block pool, per cache policy and KV capacity (docs/sim.md)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

from agentserve.config import ADMISSIONS
from agentserve.ledger.writer import write_rows
from agentserve.sim.fleet import SimConfig, SimError
from agentserve.sim.plan import Arrival, compile_workload
from agentserve.sim.policies import POLICIES
from agentserve.sim.presets import load_cost_model, preset_names
from agentserve.sim.sweep import SweepSpec, auto_capacities, run_sweep
from agentserve.workload.load import FORMATS, load_workload, take_sessions
from agentserve.workload.model import TraceError
from agentserve.workload.stats import describe


def _ints(text: str) -> tuple[int, ...]:
    """'1M,2M,500k,4096' -> integers."""
    mult = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}
    out = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        factor = mult.get(part[-1], 1)
        out.append(int(float(part[:-1] if factor > 1 else part) * factor))
    return tuple(out)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim", help="simulate traces against the real scheduler and KV pool")
    p.add_argument("trace", nargs="*", help="trace files or directories (none with --format synthetic)")
    p.add_argument("--format", default="auto", choices=FORMATS)
    p.add_argument("--synthetic-sessions", type=int, default=100)
    p.add_argument("--max-sessions", type=int, default=None, help="only the first N sessions")
    p.add_argument("--policy", default="none,lru,belady", help=f"comma list of {[s.name for s in POLICIES]}")
    p.add_argument("--capacity-tokens", default=None, help="KV pool per replica, tokens (e.g. 2M)")
    p.add_argument("--sweep-capacity", action="store_true", help="run a list of capacities")
    p.add_argument("--capacities", default=None, help="with --sweep-capacity (default: doubling)")
    p.add_argument("--seeds", default="0", help="comma list: session arrivals (and synthetic workload)")
    p.add_argument("--cost-model", default="h200-llama3-8b", help=f"{preset_names()} or a bench JSON")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--router", default="session-hash", choices=["round-robin", "session-hash", "least-loaded"])
    p.add_argument("--arrival", default="trace", choices=[a.value for a in Arrival],
                   help="trace: sessions start at trace times (Poisson where the trace has none)")
    p.add_argument("--session-rate", type=float, default=1 / 300, help="sessions per second (Poisson)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies think times and trace times")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--no-output-reuse", action="store_true", help="generated blocks never shared")
    p.add_argument("--no-decode-runs", action="store_true", help="step decodes one by one (slow)")
    p.add_argument("--skip-oversized", action="store_true", help="skip requests larger than the pool")
    p.add_argument("--admission", default="auto", choices=list(ADMISSIONS),
                   help="as serve's: protective admits a waiting request other than the earliest only "
                        "into blocks whose taking evicts no protected prefix; auto = protective with "
                        "--policy agent (serve's default with --residency on), else eager")
    p.add_argument("--events", default="none", choices=["none", "terminal"],
                   help="policy agent: lifecycle events a harness sends (terminal: trajectory_finished)")
    p.add_argument("--host-tokens", default="0", help="host KV tier per replica, tokens (e.g. 4M; 0: none)")
    p.add_argument("--disk-tokens", default="0", help="disk KV tier per replica, tokens (0: none)")
    p.add_argument("--out", default=None, help="write results.json, summary.md, plots, manifest.json")
    p.add_argument("--ledger", default=None, metavar="PATH",
                   help="write the server's ledger rows (one per attempt, miss reasons) as JSON lines; "
                        "with several runs, one file per run (PATH-<policy>-<capacity>-s<seed>.jsonl); "
                        "`agentserve report` draws them beside a live server's")
    p.add_argument("--fit", action="store_true", help="print the synthetic config fitted to TRACE")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (TraceError, SimError, ValueError) as e:
        print(f"agentserve sim: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    seeds = _ints(args.seeds)
    t0 = time.perf_counter()
    workload = take_sessions(load_workload(args.trace, args.format, args.synthetic_sessions, seeds[0]),
                             args.max_sessions)
    for s in workload.skipped[:10]:
        console.print(f"[yellow]skipped[/] {s}")
    if len(workload.skipped) > 10:
        console.print(f"[yellow]... {len(workload.skipped) - 10} more skipped records")
    if args.fit:
        from agentserve.workload.fit import fit_synthetic

        print(fit_synthetic(workload))
        return 0
    if not workload.sessions:
        raise TraceError("the trace holds no usable requests")
    cost = load_cost_model(args.cost_model)
    plan = compile_workload(workload, not args.no_output_reuse, args.time_scale)
    load_s = time.perf_counter() - t0
    console.print(f"{workload.name}: {plan.num_requests:,} requests in {len(plan.sessions):,} sessions, "
                  f"{len(workload.skipped)} records skipped; loaded in {load_s:.1f} s")
    caps = _capacities(args, plan, cost)
    base = SimConfig(caps[0], "lru", args.replicas, args.router, args.max_num_batched_tokens,
                     args.max_num_seqs, not args.no_decode_runs, args.skip_oversized, args.events,
                     _ints(args.host_tokens)[0], _ints(args.disk_tokens)[0], ledger=args.ledger is not None,
                     admission=args.admission)
    spec = SweepSpec(tuple(args.policy.split(",")), caps, seeds, base, Arrival(args.arrival), args.session_rate)
    rows = []
    runs = len(spec.policies) * len(caps) * len(seeds)
    for row, result in run_sweep(plan, spec, cost, lambda m: console.print(f"[dim]{m}[/]")):
        rows.append(row)
        console.print(_line(row))
        if args.ledger is not None:
            path = _ledger_path(Path(args.ledger), row, runs)
            write_rows(path, result.ledger_rows)
            console.print(f"wrote {len(result.ledger_rows):,} ledger rows to {path}")
    if args.out:
        from agentserve.sim.report import write_outputs

        manifest = _manifest(args, workload, plan, cost, spec, load_s)
        for path in write_outputs(Path(args.out), rows, manifest, f"{workload.name}, {cost.name}"):
            console.print(f"wrote {path}")
    return 0


def _ledger_path(path: Path, row: dict[str, object], runs: int) -> Path:
    if runs == 1:
        return path
    stem = path.name.removesuffix(".jsonl")
    return path.with_name(f"{stem}-{row['policy']}-{row['capacity_tokens']}-s{row['seed']}.jsonl")


def _capacities(args: argparse.Namespace, plan, cost) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    if args.sweep_capacity:
        return _ints(args.capacities) if args.capacities else auto_capacities(plan)
    if args.capacity_tokens:
        return _ints(args.capacity_tokens)[:1]
    default = getattr(cost, "capacity_tokens", None)
    if default is None:
        raise SimError("give --capacity-tokens: this cost model has no device memory size")
    return (default(),)


def _line(row: dict[str, object]) -> str:
    return (f"{row['policy']:>7} {row['capacity_tokens']:>12,} tok seed {row['seed']}: "
            f"reuse {row['reuse_ratio']:.3f}  rebuild tax {row['rebuild_tax']:.3f}  "
            f"recomputed {row['recomputed_tokens']:,}  JCT p50 {row['jct_p50_s']:.0f} s "
            f"p99 {row['jct_p99_s']:.0f} s  ({row['wall_s']:.1f} s wall)")


def _manifest(args, workload, plan, cost, spec, load_s) -> dict[str, object]:  # type: ignore[no-untyped-def]
    return dict(
        command=["agentserve", "sim", *sys.argv[2:]] if sys.argv[1:2] == ["sim"] else sys.argv,
        workload=dict(name=workload.name, sources=[asdict(s) for s in workload.sources],
                      skipped=[str(s) for s in workload.skipped], stats=describe(workload).as_dict(),
                      block_size=plan.block_size, output_reuse=not args.no_output_reuse,
                      time_scale=args.time_scale),
        policies=[dict(name=p.name, description=p.description) for p in POLICIES if p.name in spec.policies],
        cost_model=cost.params(), sim=asdict(spec.base), arrival=spec.arrival.value,
        session_rate=spec.session_rate, seeds=list(spec.seeds), capacities=list(spec.capacities),
        load_s=load_s)
