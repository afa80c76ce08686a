"""The ledger's JSON-lines file (`--ledger PATH`), written off the step loop.

The engine thread only puts finished rows on a bounded queue (`put` never blocks): when the
queue is full the row is dropped and counted (`num_dropped`), the in-memory ledger still has
it. A writer thread serializes rows, appends them with one write per batch, and rotates the
file before a row would take it past `max_bytes` (PATH -> PATH.1 -> ... -> PATH.backups; the
oldest is deleted), so no file exceeds max_bytes (unless one row alone does). Every row ends with a newline: a
line without one was cut short by a crash, and the reader says so.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Iterable
from pathlib import Path

from agentserve.ledger.rows import Outcome, Row

log = logging.getLogger(__name__)


class LedgerWriter:
    def __init__(self, path: Path, max_bytes: int = 64 << 20, backups: int = 5, queue_size: int = 65_536) -> None:
        if max_bytes < 4096:
            raise ValueError(f"ledger max size {max_bytes} bytes is too small: use at least 4 KiB")
        if backups < 0:
            raise ValueError(f"ledger backups must be >= 0, got {backups}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8"):  # fail now (a CLI error), not in the thread
            pass
        self.max_bytes = max_bytes
        self.backups = backups
        self._queue: queue.Queue[Row | Outcome | None] = queue.Queue(maxsize=queue_size)
        self.num_written = 0
        self.num_dropped = 0  # the queue was full (the disk could not keep up): not in the file
        self.num_write_errors = 0
        self._thread = threading.Thread(target=self._run, name="agentserve-ledger", daemon=True)
        self._thread.start()

    def put(self, record: Row | Outcome) -> None:
        """From the engine thread: never blocks."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.num_dropped += 1

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then stop."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if self.num_dropped:
            log.warning("ledger %s: %d rows dropped (the writer could not keep up)", self.path, self.num_dropped)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < 1024:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            lines = [json.dumps(r.as_dict(), separators=(",", ":"), ensure_ascii=False) + "\n"
                     for r in batch if r is not None]
            if lines:
                self._write(lines)
            if stop:
                return

    def _write(self, lines: list[str]) -> None:
        """Append lines, rotating between two lines whenever the next would pass max_bytes."""
        done = 0
        try:
            size = self.path.stat().st_size if self.path.exists() else 0
            while done < len(lines):
                chunk, nbytes = [], 0
                for line in lines[done:]:
                    n = len(line.encode())
                    if chunk and size + nbytes + n > self.max_bytes:
                        break
                    chunk.append(line)
                    nbytes += n
                if size and size + nbytes > self.max_bytes:
                    self._rotate()
                    size = 0
                    continue
                with self.path.open("a", encoding="utf-8") as f:
                    f.write("".join(chunk))
                size += nbytes
                done += len(chunk)
                self.num_written += len(chunk)
        except OSError as exc:
            n = len(lines) - done
            self.num_write_errors += 1
            self.num_dropped += n
            if self.num_write_errors == 1 or self.num_write_errors % 1000 == 0:
                log.error("ledger %s: write failed (%s); %d rows dropped so far", self.path, exc, self.num_dropped)

    def _rotate(self) -> None:
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
            return
        oldest = self.path.with_name(f"{self.path.name}.{self.backups}")
        oldest.unlink(missing_ok=True)
        for i in range(self.backups - 1, 0, -1):
            p = self.path.with_name(f"{self.path.name}.{i}")
            if p.exists():
                p.rename(self.path.with_name(f"{self.path.name}.{i + 1}"))
        self.path.rename(self.path.with_name(f"{self.path.name}.1"))


def write_rows(path: Path, records: Iterable[Row | Outcome]) -> int:
    """Write records as ledger JSON lines at once (the simulator's rows, tests); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.as_dict(), separators=(",", ":"), ensure_ascii=False) + "\n")
            n += 1
    return n
