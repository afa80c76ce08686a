"""Helpers shared by the trace readers: file hashes, prefix lengths, field checks."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path

from agentserve.workload.model import SourceFile, TraceError


def source_file(path: Path) -> SourceFile:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return SourceFile(str(path), h.hexdigest())


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (binary search over C-speed slice compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo] and a[:hi+1] != b[:hi+1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def need_number(rec: Mapping[str, object], key: str, minimum: float = 0) -> float:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or v < minimum:
        raise TraceError(f"field {key!r} must be a number >= {minimum}, got {v!r}")
    return float(v)


def need_int(rec: Mapping[str, object], key: str, minimum: int = 0) -> int:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceError(f"field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def need_hashes(rec: Mapping[str, object], key: str = "hash_ids") -> list[int]:
    v = rec.get(key)
    try:
        if not isinstance(v, list):
            raise TypeError
        array("q", v)  # C-speed check that every element is a 64-bit integer
    except (TypeError, OverflowError):
        raise TraceError(f"field {key!r} must be a list of 64-bit integers") from None
    return v


def existing(paths: Sequence[str | Path], patterns: Sequence[str]) -> list[Path]:
    """Files named, or found in named directories by pattern; a missing path is an error."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for pat in patterns for f in p.glob(pat))
            if not found:
                raise TraceError(f"{p}: no trace files ({', '.join(patterns)}) in this directory")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise TraceError(f"{p}: no such file or directory")
    return out
