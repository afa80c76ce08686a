"""Pick a reader by format: Claude Code session files, Mooncake JSONL, or the generator."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from agentserve.workload.claude_code import read_claude_code
from agentserve.workload.model import TraceError, Workload
from agentserve.workload.mooncake import read_mooncake
from agentserve.workload.synthetic import SyntheticConfig, synthetic_workload

FORMATS = ("auto", "claude-code", "mooncake", "synthetic")


def detect_format(paths: Sequence[str | Path]) -> str:
    for p in map(Path, paths):
        if p.suffix == ".jsonl" or (p.is_dir() and any(p.glob("*.jsonl"))):
            return "mooncake"
    return "claude-code"


def load_workload(paths: Sequence[str | Path], fmt: str = "auto", synthetic_sessions: int = 100,
                  seed: int = 0) -> Workload:
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    if fmt == "synthetic":
        return synthetic_workload(SyntheticConfig(num_sessions=synthetic_sessions), seed)
    if not paths:
        raise TraceError("no trace given")
    fmt = detect_format(paths) if fmt == "auto" else fmt
    name = ",".join(Path(p).name for p in paths)
    return read_mooncake(paths, name) if fmt == "mooncake" else read_claude_code(paths, name)


def take_sessions(w: Workload, n: int | None) -> Workload:
    """The first n top-level sessions (all when n is None)."""
    if n is None or n >= len(w.sessions):
        return w
    return Workload(w.name + f"[:{n}]", w.block_size, w.sessions[:n], w.sources, w.skipped)
