"""`agentserve report LEDGER [LEDGER...] --out DIR`: what each attempt reused, computed and cost,
per trajectory and for the fleet, as one self-contained HTML page (DIR/index.html) plus PNG
plots and a JSON summary. Each LEDGER (a server's --ledger file or a simulator run's) is one
run; several runs are shown side by side, e.g. a live run against its simulation."""

from __future__ import annotations

import argparse
import base64
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from agentserve.ledger.cost import Summary, TrajectorySummary, summarize
from agentserve.ledger.prices import DEFAULT, PRESETS, PriceError, PriceTable, load_prices
from agentserve.ledger.reader import LedgerError, LedgerFile, read_ledger

EXIT_OK = 0  # written; lines the reader skipped are listed on stderr and in the page
EXIT_USAGE = 2  # nothing written: bad arguments, prices, or a ledger with no valid rows
MAX_PROBLEMS_PRINTED = 20  # on stderr; all of them go to DIR/problems.txt
_WATERFALL_PNG = re.compile(r"waterfall-\d+\.png")


class ReportError(ValueError):
    """Arguments that cannot make a report; the message says which and why."""


@dataclass(frozen=True, slots=True)
class ReportConfig:
    ledgers: tuple[Path, ...]
    labels: tuple[str, ...]  # one per ledger
    out: Path
    prices: PriceTable
    title: str
    num_waterfalls: int  # PNG waterfalls for the top trajectories by own tokens


@dataclass(frozen=True, slots=True)
class Run:
    """One ledger (with its rotated files) and its roll-up."""

    label: str
    path: Path
    ledger: LedgerFile
    summary: Summary


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "report", help="per-trajectory and fleet token/cost report from ledgers (HTML + PNG)",
        description=__doc__)
    parser.add_argument("ledgers", nargs="*", type=Path, metavar="LEDGER",
                        help="ledger JSONL files; each is a run (rotated PATH.N files included)")
    parser.add_argument("--out", type=Path, metavar="DIR", help="where index.html and plots go")
    parser.add_argument("--prices", metavar="SPEC",
                        help=f"a preset ({', '.join(PRESETS)}; default {DEFAULT}) "
                             "or a YAML price table")
    parser.add_argument("--title", help="the page's title (default: the runs' labels)")
    parser.add_argument("--label", action="append", default=[], metavar="NAME",
                        help="a run's label, once per LEDGER in order (default: its file name)")
    parser.add_argument("--waterfalls", type=int, default=5, metavar="N",
                        help="waterfall PNGs for the top N trajectories by tokens (default 5)")
    parser.add_argument("--prices-template", nargs="?", const=DEFAULT, metavar="PRESET",
                        help="print a preset price table as YAML (to copy and edit), and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.prices_template is not None:
        if args.prices_template not in PRESETS:
            return _fail(f"--prices-template: no preset {args.prices_template!r} "
                         f"(presets: {', '.join(PRESETS)})")
        print(PRESETS[args.prices_template].as_yaml(), end="")
        return EXIT_OK
    try:
        config = make_config(args)
        runs = load_runs(config)
    except (ReportError, PriceError, LedgerError) as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot read {exc.filename or 'a ledger'}: {exc.strerror or exc}")
    _print_problems(runs, config.out)
    try:
        index = write_report(config, runs)
    except OSError as exc:
        return _fail(f"cannot write {config.out}: {exc}")
    rows = sum(len(r.ledger.rows) for r in runs)
    trajs = sum(len(r.summary.trajectories) for r in runs)
    print(f"agentserve report: wrote {index} ({len(runs)} run(s), {rows} attempts, "
          f"{trajs} trajectories)")
    return EXIT_OK


def make_config(args: argparse.Namespace) -> ReportConfig:
    if not args.ledgers:
        raise ReportError("give at least one LEDGER file")
    if args.out is None:
        raise ReportError("--out DIR is required (index.html and the plots go there)")
    if args.out.exists() and not args.out.is_dir():
        raise ReportError(f"--out {args.out}: exists and is not a directory")
    if args.waterfalls < 0:
        raise ReportError(f"--waterfalls {args.waterfalls}: must be 0 or more")
    ledgers = tuple(args.ledgers)
    if args.label and len(args.label) != len(ledgers):
        raise ReportError(f"--label given {len(args.label)} time(s) for {len(ledgers)} "
                          "ledger(s): give one per LEDGER, in order, or none")
    try:
        prices = load_prices(args.prices)
    except PriceError as exc:
        raise PriceError(f"--prices: {exc}") from None
    labels = tuple(args.label) if args.label else default_labels(ledgers)
    title = args.title or "agentserve report: " + " vs ".join(labels)
    return ReportConfig(ledgers, labels, args.out, prices, title, args.waterfalls)


def default_labels(paths: tuple[Path, ...]) -> tuple[str, ...]:
    """File names; the paths as given where two names collide; a #n where paths do too."""
    names = [p.name for p in paths]
    if len(set(names)) < len(names):
        names = [str(p) for p in paths]
    return tuple(n if names.count(n) == 1 else f"{n}#{k}" for k, n in enumerate(names, 1))


def load_runs(config: ReportConfig) -> list[Run]:
    runs = []
    for path, label in zip(config.ledgers, config.labels, strict=True):
        ledger = read_ledger([path])
        runs.append(Run(label, path, ledger, summarize(ledger.rows, ledger.outcomes,
                                                       config.prices)))
    return runs


def _print_problems(runs: list[Run], out: Path) -> None:
    problems = [p for r in runs for p in r.ledger.problems]
    for p in problems[:MAX_PROBLEMS_PRINTED]:
        print(f"agentserve report: {p}", file=sys.stderr)
    if len(problems) > MAX_PROBLEMS_PRINTED:
        print(f"agentserve report: ... and {len(problems) - MAX_PROBLEMS_PRINTED} more skipped "
              f"line(s), all in {out / 'problems.txt'}", file=sys.stderr)


def write_report(config: ReportConfig, runs: list[Run]) -> Path:
    """Writes DIR/index.html, summary.json, the PNGs (and problems.txt when lines were
    skipped); returns the page's path. An earlier report's waterfall PNGs and problems.txt
    are removed, so the directory describes this report only."""
    from agentserve.ledger import html, plots  # matplotlib on use: `--help` stays fast

    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if _WATERFALL_PNG.fullmatch(old.name):
            old.unlink()
    images: dict[str, str] = {}
    for name, figure in (("reuse", plots.reuse_by_run), ("reuse_over_time", plots.reuse_over_time),
                         ("misses", plots.miss_reasons)):
        data = plots.png(figure(runs))
        (out / f"{name.replace('_', '-')}.png").write_bytes(data)
        images[name] = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    waterfalls = []
    for rank, (index, r, t) in enumerate(_top_trajectories(runs, config.num_waterfalls), 1):
        name = f"waterfall-{rank}.png"
        title = f"{r.label}: {t.id}" if len(runs) > 1 else t.id
        (out / name).write_bytes(plots.png(plots.waterfall(title, t.rows)))
        waterfalls.append((index, name))
    data = html.page_data(config.title, runs, config.prices, images, waterfalls, plots.COLORS)
    index_html = out / "index.html"
    index_html.write_text(html.render_page(data), encoding="utf-8")
    summary = {"title": config.title, "runs": [html.run_summary(r) for r in runs]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n",
                                      encoding="utf-8")
    problems = [p for r in runs for p in r.ledger.problems]
    if problems:
        (out / "problems.txt").write_text("\n".join(problems) + "\n", encoding="utf-8")
    else:
        (out / "problems.txt").unlink(missing_ok=True)  # an earlier report's
    return index_html


def _top_trajectories(runs: list[Run], n: int) -> list[tuple[int, Run, TrajectorySummary]]:
    """The n trajectories with the most own tokens (P + O), with their index in the page's
    trajectory table (runs' trajectories in order, as html.page_data lays them out)."""
    every = []
    index = 0
    for r in runs:
        for t in r.summary.trajectories.values():
            every.append((t.own.prompt + t.own.generated, index, r, t))
            index += 1
    every.sort(key=lambda e: (-e[0], e[1]))
    return [(i, r, t) for _, i, r, t in every[:n]]


def _fail(text: str) -> int:
    print(f"agentserve report: {text}", file=sys.stderr)
    return EXIT_USAGE
