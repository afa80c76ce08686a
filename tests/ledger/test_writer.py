"""The ledger's JSONL writer: every row written once, in order, rotation bounded, a full queue
drops (and counts) instead of blocking, a failing disk is counted, and the reader reads the
rotated set back whole."""

from __future__ import annotations

import threading
import time

import pytest

from agentserve.ledger.reader import read_ledger
from agentserve.ledger.rows import Outcome, Row
from agentserve.ledger.writer import LedgerWriter, write_rows


def row(i: int) -> Row:
    return Row(request_id=f"r{i}", trajectory_id=f"t{i % 7}", session_id=None, parent_trajectory_id=None,
               tenant="", turn=1, attempt=1, route="chat", arrival_s=1_700_000_000.0 + i, queue_s=0.01,
               prefill_s=0.1, decode_s=0.2, ttft_s=0.11, e2e_s=0.31, busy_s=0.05, prompt_tokens=100 + i,
               reused_device=64, reused_host=0, reused_disk=0, generated_tokens=8, recomputed_tokens=0,
               preemptions=0, eligible_tokens=64, finish_reason="stop")


def test_rows_written_in_order_and_rotated_within_the_bound(tmp_path):
    path = tmp_path / "ledger.jsonl"
    w = LedgerWriter(path, max_bytes=8192, backups=3)
    for i in range(200):
        w.put(row(i))
    w.put(Outcome("t1", "", True, 1.0))
    w.close()
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["ledger.jsonl", "ledger.jsonl.1", "ledger.jsonl.2", "ledger.jsonl.3"]
    assert all(f.stat().st_size <= 8192 for f in files)
    book = read_ledger([path])
    assert not book.problems and book.outcomes == [Outcome("t1", "", True, 1.0)]
    ids = [int(r.request_id[1:]) for r in book.rows]
    assert ids == list(range(ids[0], 200))  # the oldest rotated away, the rest whole and in order
    assert w.num_written == 201 and w.num_dropped == 0


def test_a_full_queue_drops_and_counts_and_never_blocks(tmp_path, monkeypatch):
    path = tmp_path / "ledger.jsonl"
    w = LedgerWriter(path, queue_size=4)
    gate = threading.Event()
    real = w._write
    monkeypatch.setattr(w, "_write", lambda lines: (gate.wait(10), real(lines)))  # a stalled disk
    t0 = time.monotonic()
    for i in range(100):
        w.put(row(i))
    assert time.monotonic() - t0 < 0.5  # the step loop's side never waits
    assert w.num_dropped >= 90
    gate.set()
    w.close()
    assert w.num_written + w.num_dropped == 100
    assert len(read_ledger([path]).rows) == w.num_written


def test_a_failing_disk_is_counted_and_the_writer_goes_on(tmp_path, monkeypatch):
    path = tmp_path / "ledger.jsonl"
    w = LedgerWriter(path)
    fail = {"on": True}
    real_open = type(path).open

    def flaky(self, *a, **k):
        if fail["on"] and self == path:
            raise OSError(28, "No space left on device")
        return real_open(self, *a, **k)

    monkeypatch.setattr(type(path), "open", flaky)
    w.put(row(0))
    for _ in range(100):
        if w.num_write_errors:
            break
        time.sleep(0.01)
    fail["on"] = False
    w.put(row(1))
    w.close()
    assert w.num_write_errors == 1 and w.num_dropped == 1 and w.num_written == 1
    assert [r.request_id for r in read_ledger([path]).rows] == ["r1"]


def test_bad_settings_and_an_unwritable_path_fail_at_start(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        LedgerWriter(tmp_path / "l.jsonl", max_bytes=10)
    with pytest.raises(ValueError, match="backups"):
        LedgerWriter(tmp_path / "l.jsonl", backups=-1)
    (tmp_path / "dir").mkdir()
    with pytest.raises(OSError):
        LedgerWriter(tmp_path / "dir")


def test_a_row_cut_short_by_a_crash_is_named_and_the_rest_read(tmp_path):
    path = tmp_path / "l.jsonl"
    write_rows(path, [row(i) for i in range(3)])
    with path.open("a") as f:
        f.write('{"v": 1, "request_id": "r9", "trajec')  # the process died mid-row
    book = read_ledger([path])
    assert [r.request_id for r in book.rows] == ["r0", "r1", "r2"]
    assert len(book.problems) == 1 and ":4:" in book.problems[0] and "truncated" in book.problems[0]
