"""Sweep output: results.json, summary.md, one PNG per metric, manifest.json."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from agentserve.sim.sweep import mean_ci

METRICS: tuple[tuple[str, str], ...] = (
    ("reuse_ratio", "reuse ratio (reused / eligible prefix tokens)"),
    ("rebuild_tax", "rebuild tax (recomputed prefix / all prefill)"),
    ("recomputed_tokens", "recomputed prefill tokens"),
    ("jct_p50_s", "session JCT p50 (s)"),
    ("jct_p99_s", "session JCT p99 (s)"),
    ("ttft_p50_s", "TTFT p50 (s)"),
    ("prompt_tok_per_s", "throughput (prompt tokens/s)"),
)
Row = Mapping[str, object]


def _groups(rows: Sequence[Row]) -> dict[tuple[str, int], list[Row]]:
    out: dict[tuple[str, int], list[Row]] = {}
    for r in rows:
        out.setdefault((str(r["policy"]), int(r["capacity_tokens"])), []).append(r)  # type: ignore[call-overload]
    return out


def markdown(rows: Sequence[Row], title: str) -> str:
    cols = ("reuse_ratio", "rebuild_tax", "recomputed_tokens", "jct_p50_s", "jct_p95_s", "jct_p99_s",
            "prompt_tok_per_s")
    seeds = sorted({int(r["seed"]) for r in rows})  # type: ignore[call-overload]
    lines = [f"# {title}", "", f"Mean over seeds {seeds} (± 95% CI where more than one).", "",
             "| capacity (tokens) | policy | requests | " + " | ".join(cols) + " |",
             "|---:|---|---:|" + "---:|" * len(cols)]
    for (policy, cap), group in sorted(_groups(rows).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = []
        for c in cols:
            m, h = mean_ci([float(r[c]) for r in group])  # type: ignore[arg-type]
            fmt = "{:.3f}" if c in ("reuse_ratio", "rebuild_tax") else "{:,.0f}" if c == "recomputed_tokens" else "{:,.1f}"
            cells.append(fmt.format(m) + (f" ± {fmt.format(h)}" if h else ""))
        lines.append(f"| {cap:,} | {policy} | {group[0]['requests']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], out: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(rows)
    policies = sorted({p for p, _ in groups})
    paths = []
    for key, label in METRICS:
        fig, ax = plt.subplots(figsize=(6, 4))
        for p in policies:
            caps = sorted(c for q, c in groups if q == p)
            stats = [mean_ci([float(r[key]) for r in groups[(p, c)]]) for c in caps]  # type: ignore[arg-type]
            ax.errorbar(caps, [m for m, _ in stats], yerr=[h for _, h in stats], marker="o", capsize=3, label=p)
        ax.set_xscale("log")
        ax.set_xlabel("KV capacity (tokens, per replica)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = out / f"{key}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def code_version() -> dict[str, object]:
    from agentserve import __version__

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).parent).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return dict(package=__version__, commit=git("rev-parse", "HEAD"),
                dirty=bool(git("status", "--porcelain", "--", "src")), python=sys.version.split()[0],
                platform=platform.platform())


def write_outputs(out: Path, rows: Sequence[Row], manifest: Mapping[str, object], title: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(list(rows), indent=1))
    (out / "summary.md").write_text(markdown(rows, title))
    (out / "manifest.json").write_text(json.dumps(dict(manifest, code=code_version()), indent=1, default=str))
    return [out / "results.json", out / "summary.md", out / "manifest.json", *plot(rows, out, title)]
