"""The ledger reader: good lines become rows, each bad line is one problem naming its file, line
and field while the other lines are still read; rotated files oldest first; no ledger at all is
a LedgerError that says how to get one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentserve.ledger.reader import LedgerError, ledger_files, parse, read_ledger
from agentserve.ledger.rows import Decision, Miss, Outcome, Row


def attempt(request_id: str = "r1", **over: Any) -> dict[str, Any]:
    """A complete attempt record as the writer emits it (format version 1)."""
    d: dict[str, Any] = {
        "v": 1, "kind": "attempt", "request_id": request_id, "trajectory_id": "traj",
        "session_id": "sess", "parent_trajectory_id": None, "tenant": "", "turn": 1,
        "attempt": 1, "route": "chat", "arrival_s": 1_700_000_000.0, "queue_s": 0.01,
        "prefill_s": 0.2, "decode_s": 0.5, "ttft_s": 0.21, "e2e_s": 0.71, "busy_s": 0.6,
        "prompt_tokens": 100, "reused_device": 32, "reused_host": 16, "reused_disk": 0,
        "generated_tokens": 7, "recomputed_tokens": 0, "preemptions": 0, "eligible_tokens": 64,
        "finish_reason": "stop",
    }
    d.update(over)
    return d


def outcome(trajectory_id: str = "traj", success: bool = True) -> dict[str, Any]:
    return {"v": 1, "kind": "outcome", "trajectory_id": trajectory_id, "tenant": "",
            "success": success, "at_s": 1_700_000_010.0}


def write(path: Path, *lines: str, newline_at_end: bool = True) -> Path:
    path.write_text("\n".join(lines) + ("\n" if newline_at_end else ""), encoding="utf-8")
    return path


def js(obj: Any) -> str:
    return json.dumps(obj)


def test_good_lines_become_rows_and_outcomes(tmp_path: Path) -> None:
    p = write(tmp_path / "ledger.jsonl",
              js(attempt("r1")), "", js(outcome()), js(attempt("r2", turn=2)))
    got = read_ledger([p])
    assert [r.request_id for r in got.rows] == ["r1", "r2"]
    assert got.outcomes == [Outcome("traj", "", True, 1_700_000_010.0)]
    assert got.problems == []  # a blank line is not a problem
    r = got.rows[0]
    assert (r.prompt_tokens, r.reused_tokens, r.fresh_tokens) == (100, 48, 52)
    assert (r.turn, r.attempt, r.session_id, r.finish_reason) == (1, 1, "sess", "stop")


def test_malformed_json_line_reported_others_read(tmp_path: Path) -> None:
    p = write(tmp_path / "l.jsonl",
              js(attempt("r1")), '{"v": 1, "request_id": oops}', js(attempt("r3")))
    got = read_ledger([p])
    assert [r.request_id for r in got.rows] == ["r1", "r3"]
    assert len(got.problems) == 1
    assert got.problems[0].startswith(f"{p}:2: not JSON")


def test_truncated_last_line_reported_others_read(tmp_path: Path) -> None:
    full = js(attempt("r2"))
    p = write(tmp_path / "l.jsonl", js(attempt("r1")), full[: len(full) // 2], newline_at_end=False)
    got = read_ledger([p])
    assert [r.request_id for r in got.rows] == ["r1"]
    assert got.problems == [f"{p}:2: truncated line (the writer stopped mid-row); skipped"]


def test_complete_last_line_without_newline_is_read(tmp_path: Path) -> None:
    p = write(tmp_path / "l.jsonl", js(attempt("r1")), js(attempt("r2")), newline_at_end=False)
    got = read_ledger([p])
    assert [r.request_id for r in got.rows] == ["r1", "r2"]
    assert got.problems == []


@pytest.mark.parametrize(("over", "field"), [
    ({"v": 2}, "'v'"),
    ({"v": None}, "'v'"),
    ({"kind": "bogus"}, "'kind'"),
    ({"reused_host": -1}, "'reused_host'"),
    ({"generated_tokens": 3.5}, "'generated_tokens'"),
    ({"prompt_tokens": "100"}, "'prompt_tokens'"),
    ({"turn": True}, "'turn'"),
    ({"arrival_s": "noon"}, "'arrival_s'"),
    ({"e2e_s": None}, "'e2e_s'"),
    ({"miss": {"reason": "cold", "block": 0, "token": 0, "colour": "red"}}, "'miss'"),
    ({"decision": "retain"}, "'decision'"),
])
def test_bad_field_reported_with_file_line_and_field(tmp_path: Path, over: dict[str, Any],
                                                     field: str) -> None:
    p = write(tmp_path / "l.jsonl", js(attempt("r1")), js(attempt("bad", **over)), js(attempt("r3")))
    got = read_ledger([p])
    assert [r.request_id for r in got.rows] == ["r1", "r3"]
    assert len(got.problems) == 1
    assert got.problems[0].startswith(f"{p}:2: ")
    assert field in got.problems[0]
    assert got.problems[0].endswith("skipped")


@pytest.mark.parametrize("missing", ["prompt_tokens", "request_id", "e2e_s", "finish_reason",
                                     "session_id", "eligible_tokens"])
def test_missing_field_reported(tmp_path: Path, missing: str) -> None:
    bad = attempt("bad")
    del bad[missing]
    p = write(tmp_path / "l.jsonl", js(bad), js(attempt("r2")))
    got = read_ledger([p])
    assert [r.request_id for r in got.rows] == ["r2"]
    assert got.problems == [f"{p}:1: field {missing!r} is missing; skipped"]


def test_optional_fields_may_be_absent(tmp_path: Path) -> None:
    p = write(tmp_path / "l.jsonl", js(attempt("r1")))
    r = read_ledger([p]).rows[0]
    assert (r.error, r.decision, r.miss, r.kv_token_s) == (None, None, None, {})


@pytest.mark.parametrize(("over", "field"), [
    ({"arrival_s": float("nan")}, "'arrival_s'"),
    ({"e2e_s": float("inf")}, "'e2e_s'"),
    ({"e2e_s": -1.0}, "'e2e_s'"),
    ({"busy_s": -0.5}, "'busy_s'"),
    ({"ttft_s": "fast"}, "'ttft_s'"),
    ({"queue_s": -0.1}, "'queue_s'"),
    ({"trajectory_id": ["a", "b"]}, "'trajectory_id'"),
    ({"tenant": None}, "'tenant'"),
    ({"request_id": 7}, "'request_id'"),
    ({"kv_token_s": [1, 2]}, "'kv_token_s'"),
    ({"kv_token_s": {"device": "lots"}}, "'kv_token_s'"),
])
def test_times_and_ids_of_the_wrong_kind_are_reported(tmp_path: Path, over: dict[str, Any],
                                                      field: str) -> None:
    # json.dumps writes NaN/Infinity, which json.loads reads back as floats
    p = write(tmp_path / "l.jsonl", js({**attempt("bad"), **over}), js(attempt("r2")))
    got = read_ledger([p])
    assert [r.request_id for r in got.rows] == ["r2"]
    assert len(got.problems) == 1 and got.problems[0].startswith(f"{p}:1: ")
    assert field in got.problems[0]


def test_outcome_fields_checked(tmp_path: Path) -> None:
    bad = outcome()
    bad["success"] = "yes"
    p = write(tmp_path / "l.jsonl", js(bad), js(outcome("t2", success=False)))
    got = read_ledger([p])
    assert got.outcomes == [Outcome("t2", "", False, 1_700_000_010.0)]
    assert len(got.problems) == 1 and got.problems[0].startswith(f"{p}:1: field 'success'")


def test_non_object_line_reported(tmp_path: Path) -> None:
    p = write(tmp_path / "l.jsonl", "[1, 2]", js(attempt("r2")))
    got = read_ledger([p])
    assert got.problems == [f"{p}:1: expected a JSON object, got list; skipped"]


def test_nested_records_round_trip() -> None:
    row = parse(attempt(
        "r1", miss={"reason": "evicted", "block": 3, "token": 48, "cause": "capacity", "policy": "lru"},
        decision={"action": "offload", "p_return": 0.8, "pause_class": "tool", "reason": "short pause",
                  "policy_version": "v1"},
        kv_token_s={"device": 12.5}))
    assert isinstance(row, Row)
    assert row.miss == Miss("evicted", 3, 48, cause="capacity", policy="lru")
    assert row.decision == Decision("offload", 0.8, "tool", "short pause", "v1")
    assert parse(json.loads(json.dumps(row.as_dict()))) == row  # the writer's form reads back


def test_rotated_files_read_oldest_first(tmp_path: Path) -> None:
    p = tmp_path / "ledger.jsonl"
    write(tmp_path / "ledger.jsonl.10", js(attempt("oldest")))
    write(tmp_path / "ledger.jsonl.2", js(attempt("older")))
    write(tmp_path / "ledger.jsonl.1", "not json", js(attempt("newer")))
    write(p, js(attempt("newest")))
    write(tmp_path / "ledger.jsonl.bak", js(attempt("ignored")))  # not a rotation
    assert ledger_files(p) == [tmp_path / f"ledger.jsonl.{n}" for n in (10, 2, 1)] + [p]
    got = read_ledger([p])
    assert [r.request_id for r in got.rows] == ["oldest", "older", "newer", "newest"]
    assert got.problems[0].startswith(f"{tmp_path / 'ledger.jsonl.1'}:1: not JSON")
    assert [r.request_id for r in read_ledger([p], rotated=False).rows] == ["newest"]


def test_only_rotated_files_left(tmp_path: Path) -> None:
    write(tmp_path / "ledger.jsonl.1", js(attempt("r1")))
    assert [r.request_id for r in read_ledger([tmp_path / "ledger.jsonl"]).rows] == ["r1"]


def test_several_paths_read_in_order(tmp_path: Path) -> None:
    a = write(tmp_path / "a.jsonl", js(attempt("a1")))
    b = write(tmp_path / "b.jsonl", js(attempt("b1")))
    assert [r.request_id for r in read_ledger([b, a]).rows] == ["b1", "a1"]


def test_directory_is_an_error_with_a_fix(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="is a directory; pass the ledger file"):
        read_ledger([tmp_path])


def test_missing_path_is_an_error_with_a_fix(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match=r"no ledger at .*start the server with --ledger"):
        read_ledger([tmp_path / "nope.jsonl"])


def test_no_valid_line_is_an_error_naming_the_first_problem(tmp_path: Path) -> None:
    p = write(tmp_path / "l.jsonl", "garbage", js(attempt("r", v=9)))
    with pytest.raises(LedgerError, match=rf"no valid ledger rows in .*{p.name}: {p}:1: not JSON"):
        read_ledger([p])
    empty = write(tmp_path / "empty.jsonl", newline_at_end=False)
    with pytest.raises(LedgerError, match="no valid ledger rows"):
        read_ledger([empty])
