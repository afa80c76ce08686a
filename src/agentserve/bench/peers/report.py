"""The results table (markdown) and plots (PNG) from the rows of a run.

A cell of the table is `mean ± half-width` (95%, Student t over the repeats); a bold figure is
the row's winner for that metric: the best mean whose paired ratio to every other engine has an
interval that excludes 1. A peer that failed shows as failed, with its error and log tail below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from agentserve.bench.peers.runner import Row
from agentserve.bench.peers.stats import METRICS, interval, winner

COLUMNS = ("turns_per_min", "ttft_p50_s", "ttft_p99_s", "jct_p50_s", "jct_p99_s")
LONG_COLUMNS = ("prefill_tok_s", "rerun_s")
TOKENS = ("reused_tokens", "fresh_tokens", "errors")
LABEL = {"turns_per_min": "turns/min", "ttft_p50_s": "TTFT p50 s", "ttft_p99_s": "TTFT p99 s",
         "jct_p50_s": "JCT p50 s", "jct_p99_s": "JCT p99 s", "prefill_tok_s": "prefill tok/s",
         "rerun_s": "cached rerun s", "reused_tokens": "reused tok", "fresh_tokens": "fresh tok",
         "errors": "errors"}


def _fmt(values: Sequence[float]) -> str:
    i = interval(values)
    if not i.n:
        return "–"
    digits = 0 if abs(i.mean) >= 100 or all(float(v).is_integer() for v in values) else 2
    return f"{i.mean:.{digits}f} ± {i.half:.{digits}f}" if i.n > 1 else f"{i.mean:.{digits}f}"


def by_cell(rows: Sequence[Row]) -> dict[tuple[str, str], list[Row]]:
    latest = {r.key: r for r in rows}  # a row run again (--resume after a failure) replaces the old one
    out: dict[tuple[str, str], list[Row]] = {}
    for r in latest.values():
        out.setdefault((r.workload, r.engine), []).append(r)
    for v in out.values():
        v.sort(key=lambda r: r.repeat)
    return out


def _values(rows: Sequence[Row], metric: str) -> list[float]:
    return [r.figures.get(metric, math.nan) for r in rows if r.status == "ok"]


def _paired(cells: dict[tuple[str, str], list[Row]], workload: str, engines: Sequence[str], metric: str
            ) -> dict[str, list[float]]:
    """Each engine's values over the repeats that every engine completed (pairs for the ratios)."""
    ok = {e: {r.repeat: r.figures.get(metric, math.nan) for r in cells.get((workload, e), [])
              if r.status == "ok" and not r.figures.get("errors")}
          for e in engines}
    ok = {e: v for e, v in ok.items() if v}  # a failed peer, or one whose requests failed, neither wins nor blocks a win
    common = sorted(set.intersection(*(set(v) for v in ok.values()))) if ok else []
    return {e: [ok[e][k] for k in common] for e in ok}


def table(rows: Sequence[Row], workloads: Sequence[str], engines: Sequence[str],
          notes: dict[str, str] | None = None) -> str:
    cells = by_cell(rows)
    lines = []
    for group, cols in (("agent, fan-out and Claude Code workloads", COLUMNS), ("long prompts", LONG_COLUMNS)):
        wl = [w for w in workloads if (w.startswith("long-")) == (cols is LONG_COLUMNS)]
        if not wl:
            continue
        head = ["workload", "engine", *(LABEL[c] for c in cols), *(LABEL[c] for c in TOKENS), "repeats"]
        lines += [f"**{group}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for w in wl:
            wins = {c: winner(c, _paired(cells, w, [e for e in engines if (w, e) in cells], c)) for c in cols}
            for e in engines:
                rs = cells.get((w, e), [])
                ok = [r for r in rs if r.status == "ok"]
                if not ok:
                    why = rs[0].error[:80] if rs else "not run"
                    lines.append(f"| {w} | {e} | failed: {why} |" + " |" * (len(head) - 3))
                    continue
                figs = []
                for c in cols:
                    s = _fmt(_values(ok, c))
                    figs.append(f"**{s}**" if wins[c] == e else s)
                figs += [_fmt(_values(ok, c)) for c in TOKENS]
                lines.append(f"| {w} | {e} | " + " | ".join(figs) + f" | {len(ok)}/{len(rs)} |")
        lines.append("")
    for (w, e), rs in cells.items():
        for r in rs:
            if r.status != "ok":
                lines += [f"- {w}, {e}, repeat {r.repeat}: {r.error}", "", "```", r.log_tail[-2500:], "```", ""]
    busy = [r.idle_busy for r in rows if r.idle_busy is not None]
    if busy:
        lines.append(f"- CPU busy over the second before each server start (niced work counts as idle): "
                     f"median {sorted(busy)[len(busy) // 2]:.0%}, at most {max(busy):.0%}")
    starts = {}
    for r in rows:
        if r.start_s is not None:
            starts.setdefault(r.engine, []).append(r.start_s)
    if starts:
        lines.append("- server start to healthy, s: " + ", ".join(f"{e} {min(v):.0f}–{max(v):.0f}" for e, v in starts.items()))
    for k, v in (notes or {}).items():
        lines.append(f"- {k}: {v}")
    return "\n".join(lines) + "\n"


def plots(rows: Sequence[Row], workloads: Sequence[str], engines: Sequence[str], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = by_cell(rows)
    made = []
    for metric, wl in (("jct_p50_s", [w for w in workloads if not w.startswith("long-")]),
                       ("ttft_p99_s", [w for w in workloads if not w.startswith("long-")]),
                       ("prefill_tok_s", [w for w in workloads if w.startswith("long-")])):
        if not wl:
            continue
        fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(wl), 3.6))
        width = 0.8 / max(1, len(engines))
        for k, e in enumerate(engines):
            ivs = [interval(_values(cells.get((w, e), []), metric)) for w in wl]
            xs = [i + k * width for i in range(len(wl))]
            ax.bar(xs, [i.mean for i in ivs], width, yerr=[i.half if i.n > 1 else 0 for i in ivs], label=e,
                   capsize=3)
        ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(wl))], wl, rotation=20)
        ax.set_ylabel(LABEL[metric] + (" (higher is better)" if METRICS[metric] else " (lower is better)"))
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"peers-{metric}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made
