"""Trace readers on excerpts of the real traces, and bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from agentserve.workload.claude_code import read_claude_code
from agentserve.workload.load import load_workload
from agentserve.workload.model import InputType, StopReason, TraceError
from agentserve.workload.mooncake import read_mooncake
from agentserve.workload.stats import describe

FIXTURES = Path(__file__).parent.parent / "fixtures" / "traces"
CC = FIXTURES / "claude-code"
MC = FIXTURES / "mooncake" / "conversation_head150.jsonl"


def flat_requests(records):
    """Request records of a Claude Code file, parent then each sub-agent, as the reader orders them."""
    parent, subs = [], []
    for r in records:
        (subs.append(r["requests"]) if r.get("type") == "subagent" else parent.append(r))
    return [parent] + [s for sub in subs for s in flat_requests(sub)]


def test_claude_code_round_trip():
    w = read_claude_code([CC])
    assert not w.skipped and len(w.sources) == 5 and all(len(s.sha256) == 64 for s in w.sources)
    for session, path in zip(w.sessions, sorted(CC.glob("*.json.gz"))):
        doc = json.load(gzip.open(path))
        agents = list(session.walk())
        for agent, records in zip(agents, flat_requests(doc["requests"]), strict=True):
            assert [t.prompt_tokens for t in agent.turns] == [r["in"] for r in records]
            assert [t.output_tokens for t in agent.turns] == [max(1, r["out"]) for r in records]
            assert list(agent.block_hashes()) == [r["hash_ids"][: r["in"] // 64] for r in records]
            assert [t.offset_s for t in agent.turns] == [r["t"] for r in records]
    assert describe(w).requests == 148


def test_claude_code_sub_agents_and_timing():
    w = read_claude_code([CC / "trace_0291.json.gz"])
    (s,) = w.sessions
    spawning = [(j, t) for j, t in enumerate(s.turns) if t.subagents]
    assert spawning and all(a.awaited and a.session.agent_type == "Explore" for _, t in spawning for a in t.subagents)
    j, t = spawning[0]
    nxt = s.turns[j + 1]
    assert nxt.tool_class == "subagent"  # the gap waited on sub-agents
    assert nxt.think_s >= 0
    assert s.turns[0].input_type is InputType.TEXT and s.turns[1].input_type is InputType.TOOL_RESULT
    assert {t.stop for t in s.turns} <= set(StopReason)


def test_mooncake_round_trip_and_chains():
    w = read_mooncake([MC])
    lines = [json.loads(x) for x in MC.read_text().splitlines()]
    assert w.num_requests == len(lines) and w.block_size == 512
    by_time = sorted(((s.start_s or 0) + t.offset_s, t.prompt_tokens, h) for s in w.sessions
                     for t, h in zip(s.turns, s.block_hashes()))
    want = sorted((r["timestamp"] / 1000, r["input_length"], r["hash_ids"][: r["input_length"] // 512]) for r in lines)
    assert by_time == want
    chained = [s for s in w.sessions if len(s.turns) > 1]
    assert chained
    for s in chained:  # each later turn starts with all of the previous turn's blocks
        hashes = list(s.block_hashes())
        for a, b in zip(hashes, hashes[1:]):
            assert b[: len(a)] == a


def test_bad_lines_and_files_are_skipped_and_named(tmp_path):
    good = MC.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([good[0], '{"timestamp": 5, "input_length": 10', good[1],
                              '{"timestamp": 7, "input_length": -3, "output_length": 1, "hash_ids": []}', good[2]]))
    w = read_mooncake([bad])
    assert w.num_requests == 3
    assert [s.record for s in w.skipped] == ["line 2", "line 4"]
    assert "not JSON" in w.skipped[0].reason and "input_length" in w.skipped[1].reason
    assert str(w.skipped[0]).startswith(f"{bad}: line 2: ")

    trunc = tmp_path / "trunc.json.gz"
    trunc.write_bytes((CC / "trace_0504.json.gz").read_bytes()[:300])
    doc = json.load(gzip.open(CC / "trace_0538.json.gz"))
    doc["requests"][1]["hash_ids"] = "oops"
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(gzip.compress(json.dumps(doc).encode()))
    w = read_claude_code([tmp_path])
    assert {(Path(s.path).name, s.record) for s in w.skipped} == {("trunc.json.gz", ""), ("broken.json.gz", "requests[1]")}
    assert w.num_requests == len(doc["requests"]) - 1


def test_missing_path_is_an_error_that_names_it(tmp_path):
    with pytest.raises(TraceError, match="nope.jsonl: no such file"):
        load_workload([tmp_path / "nope.jsonl"])
    with pytest.raises(TraceError, match="no trace files"):
        read_claude_code([tmp_path])


def test_format_detection():
    assert load_workload([MC]).block_size == 512
    assert load_workload([CC]).block_size == 64
