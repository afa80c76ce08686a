"""The report's PNG plots, drawn with matplotlib's Agg canvas (no pyplot, so no global figure
state and no GUI backend): prompt tokens by source per run, the same over time, miss reasons,
and one waterfall per trajectory asked for (the page draws every other one itself).

Strings from the ledger (run labels, trajectory ids, causes) go through `_plain` before they
reach matplotlib: a `$` would otherwise start mathtext, and an unbalanced one fails the draw.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from agentserve.ledger.rows import Miss, Row

if TYPE_CHECKING:  # report.py imports this module; the type is only named here
    from agentserve.ledger.report import Run

# Segment of an attempt's bar -> colour; the page draws its waterfalls with the same colours.
COLORS: dict[str, str] = {"device": "#1b7837", "host": "#5aae61", "disk": "#a6dba0",
                          "fresh": "#f1a340", "recomputed": "#d73027", "generated": "#4575b4"}
PROMPT_SOURCES = ("device", "host", "disk", "fresh")
MAX_BARS = 200  # attempts drawn in one waterfall PNG; the title says when there were more
DPI = 90
_TIME_BINS = 60


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


def _plain(text: str, limit: int = 60) -> str:
    text = text if len(text) <= limit else text[: limit - 1] + "\u2026"
    return text.replace("$", r"\$")  # every `$` escaped: no mathtext, shown as typed


def _sources(row: Row) -> tuple[int, int, int, int]:
    return row.reused_device, row.reused_host, row.reused_disk, row.fresh_tokens


def reuse_by_run(runs: Sequence[Run]) -> Figure:
    """One horizontal bar per run: its prompt tokens P split by where they came from."""
    fig = Figure(figsize=(8, 0.9 + 0.45 * len(runs)), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    labels = [_plain(r.label) for r in runs]
    left = np.zeros(len(runs))
    for name in PROMPT_SOURCES:
        values = np.array([_part(r, name) for r in runs], dtype=float)
        ax.barh(labels, values, left=left, color=COLORS[name], label=name)
        left += values
    ax.invert_yaxis()
    ax.set_xlabel("share of prompt tokens P")
    ax.set_xlim(0, 1)
    fig.legend(ncols=4, fontsize=8, loc="outside upper center")
    return fig


def _part(run: Run, name: str) -> float:
    t = run.summary.totals
    if not t.prompt:
        return 0.0
    return (t.fresh if name == "fresh" else t.reused[name]) / t.prompt


def reuse_over_time(runs: Sequence[Run]) -> Figure:
    """Per run, prompt tokens per second by source, stacked, over time since its first arrival
    (a live run and a simulated one each on their own clock)."""
    fig = Figure(figsize=(8, 0.4 + 2.2 * len(runs)), dpi=DPI, layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, run in zip(axes, runs, strict=True):
        ax.set_title(_plain(run.label), fontsize=9, loc="left")
        rows = run.ledger.rows
        if not rows:
            ax.text(0.5, 0.5, "no attempts", ha="center", transform=ax.transAxes)
            continue
        t = np.array([r.arrival_s for r in rows])
        t -= t.min()
        span = float(t.max()) or 1.0
        edges = np.linspace(0.0, span, _TIME_BINS + 1)
        parts = np.array([_sources(r) for r in rows], dtype=float)  # [rows, 4]
        stacked = [np.histogram(t, edges, weights=parts[:, k])[0] / (edges[1] - edges[0])
                   for k in range(len(PROMPT_SOURCES))]
        centers = (edges[:-1] + edges[1:]) / 2
        ax.stackplot(centers, stacked, labels=PROMPT_SOURCES,
                     colors=[COLORS[n] for n in PROMPT_SOURCES], step="mid")
        ax.set_ylabel("tokens / s", fontsize=8)
        ax.tick_params(labelsize=8)
    fig.legend(*axes[0].get_legend_handles_labels(), ncols=4, fontsize=8,
               loc="outside upper center")
    axes[-1].set_xlabel("seconds since the run's first arrival")
    return fig


def miss_reasons(runs: Sequence[Run]) -> Figure:
    """Attempts per miss reason (evictions by cause), one bar per run in each group."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k, _ in run.summary.misses.most_common() if k not in keys]
    fig = Figure(figsize=(8, 0.8 + 0.3 * max(1, len(keys)) * max(1, len(runs))), dpi=DPI,
                 layout="constrained")
    ax = fig.add_subplot()
    if not keys:
        ax.text(0.5, 0.5, "no misses", ha="center", transform=ax.transAxes)
        return fig
    height = 0.8 / len(runs)
    y = np.arange(len(keys))
    for n, run in enumerate(runs):
        counts = [run.summary.misses.get(k, 0) for k in keys]
        ax.barh(y + n * height, counts, height, label=_plain(run.label))
    ax.set_yticks(y + height * (len(runs) - 1) / 2, [_plain(k) for k in keys], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("attempts")
    if len(runs) > 1:
        ax.legend(fontsize=8)
    return fig


def miss_label(m: Miss) -> str:
    if m.reason == "evicted":
        return f"evicted ({m.cause or 'unknown'})"
    if m.reason == "diverged":
        at = f"diverged at token {m.token}" + ("" if m.exact else " (inexact)")
        return at + ("" if m.message_index is None else f", message {m.message_index}")
    return f"{m.reason} at block {m.block}"


def waterfall(title: str, rows: Sequence[Row]) -> Figure:
    """One bar per attempt, top to bottom in arrival order: the prompt by source, then the
    recomputed and generated tokens; a marker at the first missed token, labelled. Bars are one
    collection per segment (not a patch per bar: 10x faster to draw), margins are fixed (no
    layout engine measuring every label)."""
    shown = list(rows[:MAX_BARS])
    more = f" (first {len(shown)} of {len(rows)} attempts)" if len(rows) > len(shown) else ""
    height_in = 1.0 + 0.2 * len(shown)
    fig = Figure(figsize=(9, height_in), dpi=DPI)
    fig.subplots_adjust(left=0.07, right=0.98, top=1 - 0.45 / height_in,
                        bottom=0.5 / height_in)
    ax = fig.add_subplot()
    left = np.zeros(len(shown))
    for name in (*PROMPT_SOURCES, "recomputed", "generated"):
        values = np.array([_segment(r, name) for r in shown], dtype=float)
        verts = [[(x, k - 0.35), (x + w, k - 0.35), (x + w, k + 0.35), (x, k + 0.35)]
                 for k, (x, w) in enumerate(zip(left, values, strict=True)) if w > 0]
        ax.add_collection(PolyCollection(verts, facecolors=COLORS[name], label=name))
        left += values
    for k, r in enumerate(shown):
        if r.miss is not None:
            ax.plot([min(r.miss.token, r.prompt_tokens)], [k - 0.4], marker="v", color="black",
                    markersize=4)
            ax.text(left[k], k, "  " + _plain(miss_label(r.miss)), va="center", fontsize=7,
                    color="#b3261e")
    ax.set_yticks(np.arange(len(shown)), [f"t{r.turn}.{r.attempt}" for r in shown], fontsize=7)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    ax.set_xlim(0, max(1.0, float(left.max(initial=0.0))) * 1.35)  # room for the labels
    ax.set_xlabel("tokens", fontsize=8)
    ax.set_title(_plain(title, 90) + more, fontsize=9, loc="left")
    ax.legend(ncols=6, fontsize=7, loc="lower right")
    return fig


def _segment(row: Row, name: str) -> int:
    if name == "recomputed":
        return row.recomputed_tokens
    if name == "generated":
        return row.generated_tokens
    return _sources(row)[PROMPT_SOURCES.index(name)]
