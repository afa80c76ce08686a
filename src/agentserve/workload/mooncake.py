"""Reader for the Mooncake (Kimi) JSONL traces: one request a line, no session ids.

Fields: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (512-token prefix
blocks, one namespace per file; the last id covers the partial block and is dropped here, as
only full blocks are cached). Sessions are inferred: a request whose full-block hashes start
with all of an earlier request's (at least `min_parent_blocks` of them), and whose chain has no
later turn yet, is that chain's next turn; anything else starts a new chain. Turns keep their
trace arrival times (`Timing.TRACE`); think_s is the gap between arrivals in the chain (it
includes the previous response's service time: the trace has no other).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agentserve.workload.common import existing, need_hashes, need_int, need_number, source_file
from agentserve.workload.model import AgentSession, Skipped, Timing, TraceError, Turn, Workload

BLOCK_SIZE = 512


@dataclass(slots=True)
class _Chain:
    start_s: float
    hashes: list[int]
    turns: list[Turn] = field(default_factory=list)
    last_s: float = 0.0


def read_mooncake(paths: Sequence[str | Path], name: str = "mooncake", min_parent_blocks: int = 2) -> Workload:
    """Read JSONL files; a bad line is skipped and listed in `Workload.skipped`."""
    files = existing(paths, ["*.jsonl"])
    sessions: list[AgentSession] = []
    skipped: list[Skipped] = []
    for ns, path in enumerate(files, start=1):
        chains = _chains(path, skipped, min_parent_blocks)
        sessions.extend(
            AgentSession(f"{path.stem}/{i}", ns, tuple(c.turns), Timing.TRACE, c.start_s)
            for i, c in enumerate(chains))
    sessions.sort(key=lambda s: (s.start_s, s.session_id))
    return Workload(name, BLOCK_SIZE, tuple(sessions), tuple(source_file(f) for f in files), tuple(skipped))


def _parse(line: str) -> tuple[float, int, int, list[int]]:
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise TraceError(f"not JSON ({e})") from None
    if not isinstance(rec, dict):
        raise TraceError("not a JSON object")
    ts = need_number(rec, "timestamp") / 1000
    n_in = need_int(rec, "input_length", 1)
    n_out = need_int(rec, "output_length", 0)
    return ts, n_in, n_out, need_hashes(rec)[: n_in // BLOCK_SIZE]


def _chains(path: Path, skipped: list[Skipped], min_parent_blocks: int) -> list[_Chain]:
    chains: list[_Chain] = []
    open_end: dict[tuple[int, int], int] = {}  # (num blocks, last hash) -> chain whose latest turn ends so
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                ts, n_in, n_out, hashes = _parse(line)
            except TraceError as e:
                skipped.append(Skipped(str(path), f"line {lineno}", str(e)))
                continue
            ci = _parent(hashes, open_end, min_parent_blocks)
            if ci is None:
                chains.append(_Chain(ts, []))
                ci = len(chains) - 1
                chain, shared = chains[ci], 0
            else:
                chain = chains[ci]
                shared = len(chain.hashes)
                del open_end[(shared, chain.hashes[-1])]
            chain.turns.append(Turn(
                offset_s=ts - chain.start_s, think_s=max(0.0, ts - chain.last_s) if chain.turns else 0.0,
                prompt_tokens=n_in, output_tokens=max(n_out, 1), shared_blocks=shared,
                new_hashes=tuple(hashes[shared:])))
            chain.hashes, chain.last_s = hashes, ts
            if len(hashes) >= min_parent_blocks:
                open_end.setdefault((len(hashes), hashes[-1]), ci)
    return chains


def _parent(hashes: list[int], open_end: dict[tuple[int, int], int], min_blocks: int) -> int | None:
    """The chain whose latest turn's hashes are the longest prefix of `hashes`."""
    for k in range(len(hashes), min_blocks - 1, -1):
        ci = open_end.get((k, hashes[k - 1]))
        if ci is not None:
            return ci
    return None
