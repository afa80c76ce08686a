"""The report page: its data as compact column arrays, and one self-contained HTML file around it.

The page has no server and no network: the script (`report.js`) and style are inlined, the data
is one JSON document in a `<script type="application/json">` element, the fleet plots are data:
URIs. Its Content-Security-Policy allows nothing else (no fetch, no eval, no remote
image). Everything the browser draws comes from that JSON, so the numbers on the page are exactly
the numbers here.

Layout of the data (one entry per column, so 49,000 rows parse in well under a second):
- `traj`: one column per `TRAJ_COLUMNS`, one entry per trajectory of every run; a trajectory's
  attempts are the contiguous rows `row0 .. row0 + rows - 1` (its own, in arrival order).
- `rows`: one column per `ROW_COLUMNS`; `cost` is the attempt's `row_cost(...).total` under
  its run's price table (one number per row); text that repeats (finish reason, miss reason,
  cause, ...) is an index into `strings`; rare free text (errors, diverged text windows) sits
  in `text`, keyed by row index.

Injection: strings from the ledger reach the page only inside that JSON, where `<`, `>`, `&`
and every non-ASCII character are written as \\u escapes, so no value can close the script
element; the script puts them in the page with textContent only.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from html import escape
from importlib import resources
from typing import TYPE_CHECKING

from agentserve.ledger.cost import TrajectorySummary, row_cost
from agentserve.ledger.prices import PriceTable
from agentserve.ledger.rows import Row

if TYPE_CHECKING:  # report.py imports this module; the type is only named here
    from agentserve.ledger.report import Run

TRAJ_COLUMNS = ("run", "id", "tenant", "parent", "sessions", "turns", "rows", "row0", "prompt",
                "device", "host", "disk", "fresh", "generated", "recomputed", "rebuilt",
                "prefilled", "cost", "all_tokens", "all_cost", "jct_s", "outcome", "fanout")
ROW_COLUMNS = ("request_id", "turn", "attempt", "t", "e2e", "ttft", "prompt", "device", "host",
               "disk", "generated", "recomputed", "eligible", "preemptions", "cost", "finish",
               "route", "miss", "cause", "policy", "block", "token", "message", "role", "exact",
               "decision", "p_return")
_FLOAT_COLUMNS = frozenset(("cost", "all_cost", "jct_s", "fanout", "t", "e2e", "ttft", "p_return"))
MAX_PROBLEMS_SHOWN = 1000  # per run; the page says how many more there were
_TEMPLATE = re.compile(r"\{\{(TITLE|DATA|SCRIPT)\}\}")
_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"}


@dataclass(slots=True)
class _Strings:
    """Interns repeated text: each distinct string is stored once, columns hold its index."""

    index: dict[str, int] = field(default_factory=dict)

    def __call__(self, s: str | None) -> int | None:
        return None if s is None else self.index.setdefault(s, len(self.index))


def quantile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def finite(obj: object) -> object:
    """The same structure with NaN and infinities as None: JSON has no spelling for them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def _finite_columns(cols: dict[str, list[object]]) -> dict[str, list[object]]:
    """`finite` for column arrays, looking only into the columns that hold floats (the reader
    checks that token counts are integers; times and costs may be NaN or infinite)."""
    return {k: [x if x is None or math.isfinite(x) else None for x in v]  # type: ignore[arg-type]
            if k in _FLOAT_COLUMNS else v for k, v in cols.items()}


def run_summary(run: Run) -> dict[str, object]:
    """A run's fleet summary: `summarize()`'s own dict, plus what the page adds to it (JCT
    percentiles over tasks, i.e. top-level trajectories with their sub-agents; fan-out max)."""
    roots = run.summary.roots
    jcts = [t.jct_s for t in roots]
    amps = [t.fanout_amplification for t in roots if t.children]
    return finite({
        "label": run.label, "path": str(run.path), "summary": run.summary.as_dict(),
        "rows": len(run.ledger.rows), "outcomes": len(run.ledger.outcomes),
        "jct_p50_s": quantile(jcts, 0.50), "jct_p99_s": quantile(jcts, 0.99),
        "fanout_max": max(amps) if amps else None,
        "num_problems": len(run.ledger.problems),
        "problems": run.ledger.problems[:MAX_PROBLEMS_SHOWN],
    })  # type: ignore[return-value]


def page_data(title: str, runs: list[Run], prices: PriceTable, images: dict[str, str],
              waterfalls: list[tuple[int, str]], colors: dict[str, str]) -> dict[str, object]:
    """Everything the page shows. `images`: name -> data: URI; `waterfalls`: (trajectory
    index in `traj`, PNG file name next to the page)."""
    strings = _Strings()
    traj: dict[str, list[object]] = {c: [] for c in TRAJ_COLUMNS}
    # every run's rows, trajectory by trajectory, with the run's start and price table
    ordered: list[tuple[Row, float, PriceTable]] = []
    for n, run in enumerate(runs):
        t0 = min((r.arrival_s for r in run.ledger.rows), default=0.0)
        run_prices = run.summary.prices  # what its trajectories' costs were summed under
        index = {ref: i for i, ref in enumerate(run.summary.trajectories, len(traj["id"]))}
        for t in run.summary.trajectories.values():
            _add_trajectory(traj, n, t, index, len(ordered))
            ordered += ((row, t0, run_prices) for row in t.rows)
    rows = _row_columns(ordered, strings)
    assert list(rows) == list(ROW_COLUMNS)
    return {"title": title, "prices": prices.as_dict(), "currency": prices.currency,
            "runs": [run_summary(r) for r in runs], "strings": list(strings.index),
            "traj": _finite_columns(traj), "rows": _finite_columns(rows),
            "text": _row_text(ordered),
            "images": images, "waterfalls": [{"traj": i, "file": f} for i, f in waterfalls],
            "colors": colors}


def _add_trajectory(cols: dict[str, list[object]], run: int, t: TrajectorySummary,
                    index: dict[tuple[str, str], int], row0: int) -> None:
    own, every = t.own, t.with_children
    values: dict[str, object] = {
        "run": run, "id": t.id, "tenant": t.ref[0],
        "parent": None if t.parent is None else index.get(t.parent),
        "sessions": ", ".join(sorted(t.sessions)), "turns": t.turns, "rows": len(t.rows),
        "row0": row0, "prompt": own.prompt, "device": own.reused["device"],
        "host": own.reused["host"], "disk": own.reused["disk"], "fresh": own.fresh,
        "generated": own.generated, "recomputed": own.recomputed, "rebuilt": own.rebuilt,
        "prefilled": own.prefilled, "cost": round(own.cost, 9),
        "all_tokens": every.prompt + every.generated, "all_cost": round(every.cost, 9),
        "jct_s": round(t.jct_s, 3), "outcome": t.outcome,
        "fanout": round(t.fanout_amplification, 4)}
    for k, v in values.items():
        cols[k].append(v)


def _row_columns(ordered: list[tuple[Row, float, PriceTable]], s: _Strings
                 ) -> dict[str, list[object]]:
    """One list per column, built a column at a time (3x faster than a dict per row)."""
    rows = [r for r, _, _ in ordered]
    misses = [r.miss for r in rows]
    decisions = [r.decision for r in rows]
    return {
        "request_id": [r.request_id for r in rows], "turn": [r.turn for r in rows],
        "attempt": [r.attempt for r in rows],
        "t": [round(r.arrival_s - t0, 3) for r, t0, _ in ordered],
        "e2e": [round(r.e2e_s, 3) for r in rows],
        "ttft": [None if r.ttft_s is None else round(r.ttft_s, 3) for r in rows],
        "prompt": [r.prompt_tokens for r in rows], "device": [r.reused_device for r in rows],
        "host": [r.reused_host for r in rows], "disk": [r.reused_disk for r in rows],
        "generated": [r.generated_tokens for r in rows],
        "recomputed": [r.recomputed_tokens for r in rows],
        "eligible": [r.eligible_tokens for r in rows],
        "preemptions": [r.preemptions for r in rows],
        "cost": [round(row_cost(r, p).total, 9) for r, _, p in ordered],
        "finish": [s(r.finish_reason) for r in rows], "route": [s(r.route) for r in rows],
        "miss": [None if m is None else s(m.reason) for m in misses],
        "cause": [None if m is None else s(m.cause) for m in misses],
        "policy": [None if m is None else s(m.policy) for m in misses],
        "block": [None if m is None else m.block for m in misses],
        "token": [None if m is None else m.token for m in misses],
        "message": [None if m is None else m.message_index for m in misses],
        "role": [None if m is None else s(m.role) for m in misses],
        "exact": [None if m is None or m.reason != "diverged" else int(m.exact) for m in misses],
        "decision": [None if d is None else s(d.action) for d in decisions],
        "p_return": [None if d is None else round(d.p_return, 4) for d in decisions]}


def _row_text(ordered: list[tuple[Row, float, PriceTable]]) -> dict[str, dict[str, str]]:
    """Free text, rare enough to key by row index: errors, diverged windows, decision reasons."""
    text: dict[str, dict[str, str]] = {}
    for j, (r, _, _) in enumerate(ordered):
        m, d = r.miss, r.decision
        extra = {k: v for k, v in (("error", r.error), ("old", m and m.old), ("new", m and m.new),
                                   ("decision_reason", d and d.reason)) if v}
        if extra:
            text[str(j)] = extra
    return text


def embed_json(obj: object) -> str:
    """JSON that is safe between <script> tags: no `<` (so no `</script>` or `<!--`), no `>`
    or `&`, nothing but ASCII (so no U+2028/2029, and a lone surrogate from a `\\ud800` in the
    ledger stays an escape); JSON.parse reads the escapes back as the same characters."""
    text = json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return re.sub("[<>&]", lambda c: _JSON_ESCAPES[c[0]], text)


def render_page(data: dict[str, object]) -> str:
    package = resources.files("agentserve.ledger")
    template = package.joinpath("report.html").read_text(encoding="utf-8")
    script = package.joinpath("report.js").read_text(encoding="utf-8")
    assert "</script" not in script.lower(), "report.js must not close its own element"
    values = {"TITLE": escape(str(data["title"])), "DATA": embed_json(data), "SCRIPT": script}
    # one pass: a title that spells {{DATA}} stays text, it is not replaced again
    return _TEMPLATE.sub(lambda m: values[m[1]], template)
