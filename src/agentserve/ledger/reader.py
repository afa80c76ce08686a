"""Read ledger JSON lines (a live server's `--ledger` files or a simulator run's) back into rows.

A line that is not JSON, is cut short, or lacks a field is reported with its file and line
number and skipped; the other lines are read as usual. Rotated files (`PATH.1`, `PATH.2`, ...)
are read oldest first when asked for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from agentserve.ledger.rows import FORMAT, Decision, Miss, Outcome, Row

_ROW_FIELDS = {f.name: f for f in fields(Row)}
_REQUIRED = [f.name for f in fields(Row) if f.name not in ("error", "decision", "miss", "kv_token_s", "kind")]
_INT = ("turn", "attempt", "prompt_tokens", "reused_device", "reused_host", "reused_disk",
        "generated_tokens", "recomputed_tokens", "preemptions", "eligible_tokens")
_STR = ("request_id", "tenant", "route", "finish_reason")
_OPT_STR = ("trajectory_id", "session_id", "parent_trajectory_id", "error")
_SECONDS = ("e2e_s", "busy_s")  # durations: finite, >= 0
_OPT_SECONDS = ("queue_s", "prefill_s", "decode_s", "ttft_s")


class LedgerError(ValueError):
    """A ledger that cannot be used at all (no file, no valid line)."""


@dataclass(slots=True)
class LedgerFile:
    rows: list[Row] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # "file:line: what is wrong", one per bad line


def ledger_files(path: Path) -> list[Path]:
    """PATH and its rotated files, oldest first (PATH.N ... PATH.1, PATH)."""
    if path.is_dir():
        raise LedgerError(f"{path} is a directory; pass the ledger file (--ledger PATH)")
    rotated = sorted((p for p in path.parent.glob(path.name + ".*") if p.suffix[1:].isdigit()),
                     key=lambda p: -int(p.suffix[1:]))
    files = [*rotated, *([path] if path.exists() else [])]
    if not files:
        raise LedgerError(f"no ledger at {path}: start the server with --ledger {path}, or run "
                          f"`agentserve sim ... --ledger {path}`")
    return files


def read_ledger(paths: Iterable[Path], rotated: bool = True) -> LedgerFile:
    out = LedgerFile()
    for path in paths:
        for p in ledger_files(Path(path)) if rotated else [Path(path)]:
            with p.open("r", encoding="utf-8", errors="replace") as f:
                _read_lines(p, f, out)
    if not out.rows and not out.outcomes:
        detail = f": {out.problems[0]}" if out.problems else ""
        raise LedgerError(f"no valid ledger rows in {', '.join(map(str, paths))}{detail}")
    return out


def _read_lines(path: Path, lines: Iterator[str], out: LedgerFile) -> None:
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        if not line.endswith("\n"):
            # the writer ends every row with a newline: a last line without one was cut short
            try:
                json.loads(line)
            except ValueError:
                out.problems.append(f"{where}: truncated line (the writer stopped mid-row); skipped")
                continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            out.problems.append(f"{where}: not JSON ({exc}); skipped")
            continue
        try:
            parsed = parse(obj)
        except ValueError as exc:
            out.problems.append(f"{where}: {exc}; skipped")
            continue
        (out.outcomes if isinstance(parsed, Outcome) else out.rows).append(parsed)


def parse(obj: Any) -> Row | Outcome:
    """One ledger record from its JSON object; ValueError naming the field that is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    v = obj.get("v")
    if v != FORMAT:
        raise ValueError(f"field 'v': format version {v!r} is not {FORMAT} (written by another agentserve)")
    kind = obj.get("kind", "attempt")
    if kind == "outcome":
        for name, typ in (("trajectory_id", str), ("tenant", str), ("success", bool), ("at_s", (int, float))):
            if not isinstance(obj.get(name), typ) or (typ is not bool and isinstance(obj.get(name), bool)):
                raise ValueError(f"field {name!r}: missing or not a {getattr(typ, '__name__', 'number')}")
        return Outcome(obj["trajectory_id"], obj["tenant"], obj["success"], float(obj["at_s"]))
    if kind != "attempt":
        raise ValueError(f"field 'kind': {kind!r} is not attempt or outcome")
    for name in _REQUIRED:
        if name not in obj:
            raise ValueError(f"field {name!r} is missing")
    for name in _INT:
        value = obj[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"field {name!r}: {value!r} is not a non-negative integer")
    for name in ("arrival_s", *_SECONDS, *_OPT_SECONDS):
        value = obj.get(name)
        if value is None and name in _OPT_SECONDS:
            continue
        if not _is_number(value) or (name != "arrival_s" and value < 0):
            raise ValueError(f"field {name!r}: {value!r} is not a finite"
                             f"{'' if name == 'arrival_s' else ' non-negative'} number")
    for name in (*_STR, *_OPT_STR):  # ids key dicts downstream: a list or number here would crash
        if not isinstance(obj.get(name), str) and not (name in _OPT_STR and obj.get(name) is None):
            raise ValueError(f"field {name!r}: {obj.get(name)!r} is not a string")
    kv = obj.get("kv_token_s", {})
    if not isinstance(kv, dict) or not all(_is_number(v) and v >= 0 for v in kv.values()):
        raise ValueError(f"field 'kv_token_s': {kv!r} is not a mapping of tier to token-seconds")
    kwargs = {k: obj[k] for k in _ROW_FIELDS if k in obj}
    try:
        if obj.get("miss") is not None:
            kwargs["miss"] = Miss(**obj["miss"])
        if obj.get("decision") is not None:
            kwargs["decision"] = Decision(**obj["decision"])
    except TypeError as exc:
        raise ValueError(f"field 'miss' or 'decision': {exc}") from None
    return Row(**kwargs)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
