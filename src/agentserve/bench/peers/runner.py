"""Run the matrix: cells interleaved engine by engine, one server at a time, rows appended as
they complete.

A cell is one server start: (group, repeat, engine) and the group's workloads, run in order on
it. Order: for each group, for each repeat, every engine in turn (A B C A B C ...), so slow drift
of the machine spreads over all engines. Before each start the machine must be idle (CPU busy
fraction over one second below a threshold, waited for; the figure is kept in the row). A row is
one (workload, engine, repeat); it is written to the JSONL file as soon as it is measured, so an
interrupted run keeps what it measured, and `missing()` names what it did not.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from agentserve.bench.peers.client import Dialect, run_workload, warm_up
from agentserve.bench.peers.engines import EngineFailed, command, serve
from agentserve.bench.served import free_port
from agentserve.bench.peers.install import Installed
from agentserve.bench.peers.settings import Settings
from agentserve.bench.peers.stats import run_figures
from agentserve.bench.peers.workloads import Workload


@dataclass(frozen=True, slots=True)
class Cell:
    group: str
    repeat: int  # 0-based
    engine: str
    workloads: tuple[str, ...]
    variant: str = ""  # a calibration variant's name


@dataclass(frozen=True, slots=True)
class Row:
    workload: str
    engine: str
    repeat: int
    status: str  # ok (measured, perhaps with request errors) | failed (the server did not run it)
    figures: dict[str, float] = field(default_factory=dict)
    idle_busy: float | None = None  # CPU busy fraction measured before the server started
    start_s: float | None = None  # server start to healthy
    digest: str = ""  # of the workload's fixed token ids
    error: str = ""
    log_tail: str = ""
    records: list[dict[str, object]] = field(default_factory=list)
    variant: str = ""

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.workload, self.engine, self.repeat)


def repeats_of(settings: Settings, workload: str, repeats: int) -> int:
    return min(repeats, int(dict(settings.workloads.get("repeats_of") or {}).get(workload, repeats)))  # type: ignore[call-overload]


def plan(settings: Settings, engines: Sequence[str], workloads: Sequence[str], repeats: int) -> list[Cell]:
    cells = []
    for g in settings.groups:
        for r in range(repeats):
            wl = tuple(w for w in (*g.workloads, *g.extra) if w in workloads and r < repeats_of(settings, w, repeats))
            if wl:
                cells.extend(Cell(g.name, r, e, wl) for e in engines)
    return cells


def planned_keys(cells: Sequence[Cell]) -> list[tuple[str, str, int]]:
    return [(w, c.engine, c.repeat) for c in cells for w in c.workloads]


def read_rows(path: Path) -> list[Row]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            with contextlib.suppress(ValueError, TypeError):
                rows.append(Row(**json.loads(line)))
    return rows


def missing(cells: Sequence[Cell], rows: Sequence[Row]) -> list[tuple[str, str, int]]:
    have = {r.key for r in rows if r.status == "ok"}
    return [k for k in planned_keys(cells) if k not in have]


def cpu_busy(sample_s: float = 1.0, stat: Path = Path("/proc/stat")) -> float:
    """Fraction of all cores busy over sample_s. Time of niced processes (`nice -n 19` builds)
    counts as idle: they yield the CPU to the servers, which run at nice 0."""
    def read() -> tuple[int, int]:
        f = [int(x) for x in stat.read_text().splitlines()[0].split()[1:]]
        idle = f[1] + f[3] + (f[4] if len(f) > 4 else 0)  # nice, idle, iowait
        return sum(f[:8]), idle  # guest time is already inside user
    t1, i1 = read()
    time.sleep(sample_s)
    t2, i2 = read()
    return 1.0 - (i2 - i1) / max(1, t2 - t1)


def wait_idle(below: float, wait_s: float, sample: Callable[[], float] = cpu_busy,
              clock: Callable[[], float] = time.monotonic) -> float:
    """The last busy fraction measured: below the threshold, or the last try after wait_s."""
    start = clock()
    busy = sample()
    while busy >= below and clock() - start < wait_s:
        busy = sample()
    return busy


@contextlib.contextmanager
def cpu_lock(path: Path | None) -> Iterator[None]:
    """Held for one cell: the machine's CPUs are shared with other measurements (flock(1) compatible)."""
    if path is None:
        yield
        return
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass(frozen=True, slots=True)
class Context:
    settings: Settings
    installed: dict[str, Installed]
    workloads: dict[str, Workload]
    results: Path  # the JSONL file
    logs: Path  # server logs, one file per cell
    lock: Path | None = None
    request_timeout_s: float = 900


def append(path: Path, row: Row) -> None:
    with path.open("a") as f:
        f.write(json.dumps(asdict(row)) + "\n")


def _say(message: str) -> None:
    print(message, flush=True)


def run_cell(cell: Cell, ctx: Context, say: Callable[[str], None] = _say) -> list[Row]:
    inst = ctx.installed[cell.engine]
    if not inst.ok:
        rows = [Row(w, cell.engine, cell.repeat, "failed", error=f"not installed: {inst.error}",
                    log_tail=inst.log_tail, digest=ctx.workloads[w].digest(), variant=cell.variant)
                for w in cell.workloads]
        for r in rows:
            append(ctx.results, r)
        return rows
    s = ctx.settings
    group = next(g for g in s.groups if g.name == cell.group)
    launch = command(s.engines[cell.engine], inst, s, group, free_port())
    log = ctx.logs / f"{cell.group}-r{cell.repeat}-{cell.engine}{'-' + cell.variant if cell.variant else ''}.log"
    rows: list[Row] = []
    with cpu_lock(ctx.lock):
        busy = wait_idle(s.idle_busy_below, s.idle_wait_s)
        say(f"[{cell.group} r{cell.repeat}] {cell.engine}{' ' + cell.variant if cell.variant else ''}: CPU busy {busy:.0%} before start; starting")
        try:
            with serve(launch, log, s.start_timeout_s) as running:
                say(f"  healthy after {running.start_s:.1f} s")
                rows = asyncio.run(_workloads(cell, ctx, Dialect(launch.dialect, s.model), launch.url,
                                              busy, running.start_s, say))
        except EngineFailed as e:
            done = {r.workload for r in rows}
            for w in cell.workloads:
                if w not in done:
                    row = Row(w, cell.engine, cell.repeat, "failed", idle_busy=busy, error=str(e),
                              log_tail=e.log_tail, digest=ctx.workloads[w].digest(), variant=cell.variant)
                    append(ctx.results, row)
                    rows.append(row)
            say(f"  FAILED: {e}")
    return rows


async def _workloads(cell: Cell, ctx: Context, dialect: Dialect, url: str, busy: float, start_s: float,
                     say: Callable[[str], None]) -> list[Row]:
    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=ctx.request_timeout_s) as client:
        await warm_up(client, dialect, time.perf_counter)
        for name in cell.workloads:
            w = ctx.workloads[name]
            wall, recs = await run_workload(client, dialect, w, time.perf_counter)
            figs = run_figures(w.kind, wall, recs)
            errors = [r.error for r in recs if r.error]
            # a row whose requests failed is still measured: its errors are a figure of the row
            row = Row(name, cell.engine, cell.repeat, "ok", figs, busy, start_s,
                      w.digest(), "; ".join(errors[:3]), records=[asdict(r) for r in recs], variant=cell.variant)
            append(ctx.results, row)
            rows.append(row)
            say(f"  {name}: wall {wall:.1f} s, {figs['turns_per_min']:.1f} turns/min, TTFT p50 "
                f"{figs['ttft_p50_s']:.2f} s, JCT p50 {figs['jct_p50_s']:.2f} s, reused {figs['reused_tokens']:.0f} "
                f"fresh {figs['fresh_tokens']:.0f}, errors {figs['errors']:.0f}"
                + (f", prefill {figs['prefill_tok_s']:.0f} tok/s, rerun {figs['rerun_s']:.2f} s"
                   if "prefill_tok_s" in figs else ""))
    return rows


def estimate_s(settings: Settings, cells: Sequence[Cell], quick: bool) -> float:
    """From settings.yaml `estimate_s` (measured here): server starts plus each workload's run."""
    est = dict(settings.workloads.get("estimate_s") or {})  # type: ignore[call-overload]
    scale = 0.2 if quick else 1.0

    def of(key: str, engine: str, default: float) -> float:
        v = est.get(key, default)  # a number, or one per engine
        return float(v.get(engine, default) if isinstance(v, dict) else v)

    return sum(of("start", c.engine, 30) + scale * sum(of(w, c.engine, 60) for w in c.workloads) for c in cells)
