"""`agentserve bench peers`: agentserve, vLLM for CPU and llama.cpp's server on the same
workloads, one at a time, interleaved (docs/peers.md)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from agentserve.bench.peers import catalog
from agentserve.bench.peers.engines import command
from agentserve.bench.peers.install import Installed, install
from agentserve.bench.peers.report import plots, table
from agentserve.bench.peers.runner import Cell, Context, estimate_s, missing, plan, read_rows, run_cell
from agentserve.bench.peers.settings import DEFAULT_SETTINGS, ENGINES, KNOWN_ENGINES, Group, Settings, load_settings

REPO = Path(__file__).resolve().parents[4]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench-peers-out", help="results, logs, table and plots go here")
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "agentserve" / "peers"),
                   help="where the peers are installed (outside the repository)")
    p.add_argument("--shared", default=str(REPO.parent / "shared"), help="the shared/ folder (bench, traces)")
    p.add_argument("--settings", default=str(DEFAULT_SETTINGS))
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, in the interleaving order; also agentserve-events (agentserve "
                   "with trajectory ids and last-turn hints from the client: an extra row)")
    p.add_argument("--only", default=None, help="comma-separated workloads (default: all)")
    p.add_argument("--repeats", type=int, default=None, help="default: settings.yaml (3)")
    p.add_argument("--quick", action="store_true", help="smaller workloads, one repeat: a smoke run")
    p.add_argument("--resume", action="store_true", help="keep the rows already in --out and run the rest")
    p.add_argument("--install-only", action="store_true")
    p.add_argument("--report-only", action="store_true", help="redraw the table and plots from --out")
    p.add_argument("--calibrate", nargs="?", const="roomy", default=None, choices=["roomy", "pressured"],
                   help="run the settings sweep on the calibration workload (roomy: the agent-like set in a "
                        "large pool; pressured: Claude Code sessions from the odd files in a pool holding "
                        "about half their KV)")
    p.add_argument("--lock", default="/tmp/agentserve-cpu.lock",
                   help="flock(1)-compatible lock held for each server run; 'none' when the caller holds it")


def _installs(engines: list[str], cache: Path, model_dir: Path) -> dict[str, Installed]:
    out = {}
    for e in engines:
        print(f"install {e} ...", flush=True)
        inst = install(e, cache, model_dir)
        out[e] = inst
        print(f"  {'ok' if inst.ok else 'FAILED'} {inst.version} ({inst.seconds:.0f} s)"
              + (f"\n  {inst.error}\n{inst.log_tail}" if not inst.ok else ""), flush=True)
    return out


def _model_dir(settings: Settings) -> Path:
    from agentserve.model.loader import resolve_model_dir

    return resolve_model_dir(settings.model, Path.home() / ".cache" / "agentserve")


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _calibration_part(s: Settings, which: str) -> tuple[str, dict[str, object]]:
    """(workload name, settings) of one half of the sweep: `roomy` or `pressured`."""
    if which == "pressured":
        part = s.calibration.get("pressured")
        if not part:
            raise SystemExit("the settings file has no calibration.pressured section")
        return "calibration-pressured", dict(part)  # type: ignore[call-overload]
    return "calibration", s.calibration


def _calibration_settings(s: Settings, engine: str, variant: dict[str, object], which: str = "roomy") -> Settings:
    name, c = _calibration_part(s, which)
    group = Group(name, int(c["kv_tokens"]), int(c["max_model_len"]), (name,))  # type: ignore[call-overload]
    engines = dict(s.engines) | {engine: s.engines[engine].with_variant(variant)}
    return dataclasses.replace(s, groups=(group,), engines=engines)


def _meta(args: argparse.Namespace, s: Settings, installed: dict[str, Installed], engines: list[str],
          workloads: dict[str, object]) -> str:
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    lines = [f"- command: `agentserve bench peers {' '.join(shlex.quote(a) for a in sys.argv[3:])}`",
             f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; agentserve at {rev}"]
    for e in engines:
        i = installed[e]
        lines.append(f"- {e}: {i.version or 'not installed'}")
        for g in s.groups:
            if i.ok:
                lines.append(f"  - group {g.name}: `{command(s.engines[e], i, s, g, 0).shell()}`")
    lines += [f"- workload {name}: digest {w.digest()}, {w.num_requests} requests, {w.note}"  # type: ignore[attr-defined]
              for name, w in workloads.items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    s = load_settings(Path(args.settings))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in KNOWN_ENGINES]
    if unknown:
        raise SystemExit(f"unknown engines {unknown}; known: {', '.join(KNOWN_ENGINES)}")
    inputs = catalog.Inputs.under(Path(args.shared))
    results = out / (f"{_calibration_part(s, args.calibrate)[0]}.jsonl" if args.calibrate else "results.jsonl")
    if args.report_only:
        return _report(args, s, engines, catalog.names(s), {}, results, out, None)
    installed = _installs(engines, Path(args.cache), _model_dir(s))
    if args.install_only:
        return 0 if all(i.ok for i in installed.values()) else 1
    if args.calibrate:
        return _calibrate(args, s, engines, installed, inputs, out, results)
    names = args.only.split(",") if args.only else catalog.names(s)
    repeats = args.repeats or (1 if args.quick else s.repeats)
    workloads = {n: catalog.build(n, s, inputs, args.quick) for n in names}
    for n, w in workloads.items():
        print(f"workload {n}: {w.num_requests} requests, {w.num_fixed_tokens} fixed tokens, digest {w.digest()}")
    cells = plan(s, engines, names, repeats)
    if not args.resume and results.exists():
        results.rename(results.with_suffix(f".{datetime.datetime.now():%Y%m%d-%H%M%S}.jsonl"))
    done = {r.key for r in read_rows(results) if r.status == "ok"}
    todo = [c for c in cells if any((w, c.engine, c.repeat) not in done for w in c.workloads)]
    print(f"{len(todo)} server runs of {len(cells)} to go; estimated {estimate_s(s, todo, args.quick) / 60:.0f} min",
          flush=True)
    return _execute(args, s, engines, installed, workloads, cells, todo, results, out)


def _execute(args: argparse.Namespace, s: Settings, engines: list[str], installed: dict[str, Installed],
             workloads: dict, cells: list[Cell], todo: list[Cell], results: Path, out: Path) -> int:
    ctx = Context(s, installed, workloads, results, out / "logs", None if args.lock == "none" else Path(args.lock))
    old = signal.signal(signal.SIGTERM, _terminate)
    interrupted = False
    try:
        for cell in todo:
            run_cell(cell, ctx)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: servers stopped; rows measured so far are kept", flush=True)
    finally:
        signal.signal(signal.SIGTERM, old)
    return _report(args, s, engines, list(workloads), installed, results, out, cells) or (130 if interrupted else 0)


def _report(args: argparse.Namespace, s: Settings, engines: list[str], names: list[str],
            installed: dict[str, Installed], results: Path, out: Path, cells: list[Cell] | None) -> int:
    rows = read_rows(results)
    names = [n for n in names if any(r.workload == n for r in rows)]
    text = table(rows, names, engines)
    text += "".join(f"- {n}\n" for n in s.notes)
    for g in s.groups:
        text += (f"- group {g.name} ({', '.join(g.workloads)}): KV budget {g.kv_tokens} tokens = "
                 f"{s.kv_bytes(g.kv_tokens) / (1 << 20):.0f} MiB for every engine\n")
    if installed:
        workloads = {n: catalog.build(n, s, catalog.Inputs.under(Path(args.shared)), args.quick) for n in names}
        text += "\n" + _meta(args, s, installed, engines, workloads) + "\n"
    if cells is not None:
        gone = missing(cells, rows)
        text += f"\n- missing rows: {len(gone)}" + "".join(f"\n  - {w}, {e}, repeat {r}" for w, e, r in gone) + "\n"
    (out / "peers.md").write_text(text)
    pngs = plots(rows, names, engines, out)
    print(text)
    print(f"table: {out / 'peers.md'}; plots: {', '.join(str(p) for p in pngs)}")
    return 0


def _calibrate(args: argparse.Namespace, s: Settings, engines: list[str], installed: dict[str, Installed],
               inputs: catalog.Inputs, out: Path, results: Path) -> int:
    wname, part = _calibration_part(s, args.calibrate)
    w = catalog.build(wname, s, inputs, args.quick)
    sweep = dict(part["sweep"])  # type: ignore[call-overload]
    repeats = args.repeats or 1
    lock = None if args.lock == "none" else Path(args.lock)
    for e in engines:
        for name, variant in dict(sweep.get(e) or {}).items():
            cs = _calibration_settings(s, e, variant or {}, args.calibrate)
            ctx = Context(cs, installed, {wname: w}, results, out / "logs", lock)
            for r in range(repeats):
                run_cell(Cell(wname, r, e, (wname,), name), ctx)
    rows = read_rows(results)
    print("| engine | variant | turns/min | TTFT p50 s | TTFT p99 s | JCT p50 s | JCT p99 s | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        f = row.figures
        print(f"| {row.engine} | {row.variant} | " + " | ".join(
            f"{f.get(k, float('nan')):.2f}" for k in ("turns_per_min", "ttft_p50_s", "ttft_p99_s", "jct_p50_s",
                                                    "jct_p99_s", "errors")) + " |")
    (out / f"{wname}.json").write_text(json.dumps([dataclasses.asdict(r) | {"records": []} for r in rows], indent=1))
    return 0
