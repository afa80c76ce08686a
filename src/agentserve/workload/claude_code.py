"""Reader for the Claude Code session traces (weka-claude-code: one gzipped JSON per session).

Per request: `t` (s from session start), `in`/`out` tokens, `hash_ids` (chained 64-token block
ids, local to the file), `input_types`, `stop`, `think_time` (gap before it), `api_time`.
A record of type "subagent" nests a sub-agent session: `t` is when it ended (or, for
`async_launched`, started) on the parent's clock, `duration_ms` how long it ran. A completed
sub-agent started when the parent's previous response ended, and the parent's next request
waited for it; an async one ran beside the parent.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agentserve.workload.common import common_prefix, existing, need_hashes, need_int, need_number, source_file
from agentserve.workload.model import (
    AgentSession,
    InputType,
    Skipped,
    StopReason,
    SubAgent,
    Timing,
    TraceError,
    Turn,
    Workload,
)

BLOCK_SIZE = 64


def read_claude_code(paths: Sequence[str | Path], name: str = "claude-code") -> Workload:
    """Read session files (or directories of them). A file that cannot be parsed, and a request
    with bad fields, is skipped and listed in `Workload.skipped`; a missing path raises."""
    files = existing(paths, ["*.json.gz", "*.json"])
    sessions: list[AgentSession] = []
    skipped: list[Skipped] = []
    for i, path in enumerate(files):
        try:
            doc = _load(path)
        except (OSError, EOFError, ValueError) as e:
            skipped.append(Skipped(str(path), "", f"not readable JSON ({e})"))
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
            skipped.append(Skipped(str(path), "", "no 'requests' list"))
            continue
        bs = doc.get("block_size", BLOCK_SIZE)
        if bs != BLOCK_SIZE:
            skipped.append(Skipped(str(path), "", f"block_size {bs}, expected {BLOCK_SIZE}"))
            continue
        b = _Builder(str(path), i + 1, skipped)
        session = b.session(str(doc.get("id", path.name)), doc["requests"], "requests", None)
        if session.turns:
            sessions.append(session)
    return Workload(name, BLOCK_SIZE, tuple(sessions), tuple(source_file(f) for f in files), tuple(skipped))


def _load(path: Path) -> object:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


@dataclass(slots=True)
class _Pending:
    """A parent turn being built: its fields, and the sub-agents that follow its response."""

    fields: dict[str, object]
    end_s: float  # when its response ended on the session clock
    subagents: list[SubAgent] = field(default_factory=list)
    awaited_end_s: float | None = None  # latest end of an awaited sub-agent


@dataclass(slots=True)
class _Builder:
    path: str
    namespace: int
    skipped: list[Skipped]

    def session(self, sid: str, records: list[object], where: str, agent_type: str | None) -> AgentSession:
        pending: list[_Pending] = []
        prev_hashes: list[int] = []
        for k, rec in enumerate(records):
            loc = f"{where}[{k}]"
            try:
                if not isinstance(rec, dict):
                    raise TraceError("not an object")
                if rec.get("type") == "subagent":
                    self._subagent(rec, loc, pending)
                    continue
                fields, hashes = self._request(rec, pending, prev_hashes)
            except TraceError as e:
                self.skipped.append(Skipped(self.path, loc, str(e)))
                continue
            prev_hashes = hashes
            end = fields["offset_s"] + (rec.get("api_time") or 0.0)  # type: ignore[operator]
            pending.append(_Pending(fields, float(end)))
        turns = tuple(Turn(**p.fields, subagents=tuple(p.subagents)) for p in pending)  # type: ignore[arg-type]
        return AgentSession(sid, self.namespace, turns, Timing.THINK, None, agent_type)

    def _request(self, rec: Mapping[str, object], pending: list[_Pending], prev: list[int]
                 ) -> tuple[dict[str, object], list[int]]:
        t = need_number(rec, "t")
        n_in = need_int(rec, "in", 1)
        n_out = need_int(rec, "out", 0)
        hashes = need_hashes(rec)[: n_in // BLOCK_SIZE]
        shared = common_prefix(prev, hashes)
        last = pending[-1] if pending else None
        tool_class = None
        if last is not None and last.awaited_end_s is not None:
            think = max(0.0, t - last.awaited_end_s)
            tool_class = "subagent"
        elif isinstance(rec.get("think_time"), int | float):
            think = float(rec["think_time"])  # type: ignore[arg-type]
        else:
            think = max(0.0, t - last.end_s) if last is not None else 0.0
        types = rec.get("input_types") or []
        itype = InputType.TOOL_RESULT if "tool_result" in types else InputType.TEXT if "text" in types else InputType.UNKNOWN
        stop = rec.get("stop")
        fields: dict[str, object] = dict(
            offset_s=t, think_s=think, prompt_tokens=n_in, output_tokens=max(n_out, 1),
            shared_blocks=shared, new_hashes=tuple(hashes[shared:]), input_type=itype,
            stop=StopReason(stop) if stop in ("tool_use", "end_turn", "") else StopReason.UNKNOWN,
            tool_class=tool_class)
        return fields, hashes

    def _subagent(self, rec: Mapping[str, object], loc: str, pending: list[_Pending]) -> None:
        if not pending:
            raise TraceError("sub-agent before any request of its parent")
        t = need_number(rec, "t")
        inner = rec.get("requests")
        if not isinstance(inner, list):
            raise TraceError("sub-agent without a 'requests' list")
        awaited = rec.get("status") != "async_launched" and isinstance(rec.get("duration_ms"), int | float)
        start = t - float(rec["duration_ms"]) / 1000 if awaited else t  # type: ignore[arg-type]
        parent = pending[-1]
        kind = str(rec.get("subagent_type") or "subagent")
        sub = self.session(f"{rec.get('agent_id', loc)}", inner, f"{loc}.requests", kind)
        if not sub.turns:
            return
        parent.subagents.append(SubAgent(max(0.0, start - parent.end_s), awaited, sub))
        if awaited:
            parent.awaited_end_s = max(parent.awaited_end_s or t, t)
