"""The I/O worker: disk writes and reads off the engine's step thread.

The step thread submits jobs (never blocking: a full queue refuses the job, and the caller counts
it) and collects finished reads with `poll()` at the start of a step. The worker only moves bytes
between memory and the DiskStore; every index the scheduler reads stays on the step thread.

Bounds: at most `max_queued` jobs wait. Reads go ahead of queued writes and deletes (a request
waits on its read; write-through waits for nobody), in submission order among themselves. That
is safe because a read only asks for blocks the store already indexes: a block whose write is
still queued is not on disk yet for anyone.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from agentserve.kv.hashing import BlockHash
from agentserve.kv.identity import CacheIdentity

log = logging.getLogger("agentserve.kv.worker")


class BlockStore(Protocol):
    def put(self, identity: CacheIdentity, block_hash: int, payload: bytes | memoryview) -> bool: ...
    def get(self, identity: CacheIdentity, block_hash: int) -> bytes | None: ...
    def delete(self, identity: CacheIdentity, block_hash: int) -> None: ...


@dataclass(frozen=True, slots=True)
class WriteJob:
    identity: CacheIdentity
    hashes: tuple[BlockHash, ...]
    payloads: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class ReadJob:
    key: str  # the caller's name for it (a request id)
    identity: CacheIdentity
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class DeleteJob:
    identity: CacheIdentity
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class ReadDone:
    key: str
    hashes: tuple[BlockHash, ...]  # the prefix of the job's hashes that was read and verified
    payloads: tuple[bytes, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class WriteDone:
    hashes: tuple[BlockHash, ...]  # written (or already there)
    failed: tuple[BlockHash, ...]  # not written: the store refused (full disk, unwritable)
    nbytes: int
    seconds: float


Job = WriteJob | ReadJob | DeleteJob
Done = ReadDone | WriteDone


@dataclass(slots=True)
class WorkerStats:
    num_refused: int = 0  # jobs refused because the queue was full
    num_failed: int = 0  # jobs that raised (logged; a read then returns what it had)
    busy_s: float = 0.0


class TierWorker:
    def __init__(self, store: BlockStore, max_queued: int = 256,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.store = store
        self.clock = clock
        self.stats = WorkerStats()
        # (0 for reads, 1 for the rest; submission order; the job)
        self._jobs: queue.PriorityQueue[tuple[int, int, Job]] = queue.PriorityQueue(maxsize=max_queued)
        self._seq = itertools.count()
        self._done: deque[Done] = deque()
        self._stopping = threading.Event()
        self.wake = threading.Event()  # set when a job finishes (the step thread may wait on it)
        self._thread = threading.Thread(target=self._run, name="agentserve-kv-io", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> bool:
        """Queue a job; False (counted) if the queue is full. Never blocks."""
        try:
            self._jobs.put_nowait((0 if isinstance(job, ReadJob) else 1, next(self._seq), job))
            return True
        except queue.Full:
            self.stats.num_refused += 1
            return False

    def poll(self) -> list[Done]:
        """Finished jobs since the last poll, in completion order."""
        self.wake.clear()
        done = self._done
        return [done.popleft() for _ in range(len(done))]

    def idle(self) -> bool:
        return self._jobs.unfinished_tasks == 0

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued job has run (tests, shutdown); True if it did."""
        deadline = time.monotonic() + timeout_s
        while not self.idle():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                _, _, job = self._jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            t0 = self.clock()
            try:
                done = self._do(job, t0)
            except Exception:  # a store bug must not kill the worker; the caller falls back to recompute
                log.exception("KV tier job failed: %s", type(job).__name__)
                self.stats.num_failed += 1
                done = ReadDone(job.key, (), (), self.clock() - t0) if isinstance(job, ReadJob) else None
            self.stats.busy_s += self.clock() - t0
            if done is not None:
                self._done.append(done)
                self.wake.set()
            self._jobs.task_done()

    def _do(self, job: Job, t0: float) -> Done | None:
        if isinstance(job, WriteJob):
            ok, bad, nbytes = [], [], 0
            for h, p in zip(job.hashes, job.payloads, strict=True):
                (ok if self.store.put(job.identity, h, p) else bad).append(h)
                nbytes += len(p)
            return WriteDone(tuple(ok), tuple(bad), nbytes, self.clock() - t0)
        if isinstance(job, ReadJob):
            return self._read(job, t0)
        for h in job.hashes:
            self.store.delete(job.identity, h)
        return None

    def _read(self, job: ReadJob, t0: float) -> ReadDone:
        got: list[bytes] = []
        for h in job.hashes:
            payload = self.store.get(job.identity, h)
            if payload is None:
                break  # a prefix only: the blocks after a miss cannot be used
            got.append(payload)
        return ReadDone(job.key, job.hashes[: len(got)], tuple(got), self.clock() - t0)
