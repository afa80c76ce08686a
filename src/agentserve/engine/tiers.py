"""Lower KV tiers seen from the engine: offload at pause, restore at admission, disk loads.

Data flow, all on the step thread except the disk I/O:

- **Offload (write-through when a request finishes).** A finished request's published blocks are
  what its trajectory's next turn will match. Those not yet below are gathered from the pool in
  one batched copy (`KvMover.read_blocks`), put in the host store, and queued for the disk on the
  I/O worker. A later eviction from the pool then only drops a copy that exists below.
- **Restore from host (in the step).** The scheduler matches a prompt's prefix on the device,
  then continues in the host store (`match`); it allocates blocks for the host run and lists them
  in `Batch.restores`; the engine copies them in (`restore`) before the forward. On CPU host and
  device are the same DRAM: a restore is a memcpy, not I/O.
- **Load from disk (at admission).** When the scheduler would admit a request whose prefix
  continues on disk after its device and host runs, it admits it `LOADING`: blocks are allocated
  for the disk run, the worker reads it, and the request holds them without running while the
  others keep running. The next step after the read copies the verified blocks in (`apply_loads`),
  publishes them, and the request runs; a failed or partial read leaves the rest to be recomputed,
  and a read whose request was preempted or ended meanwhile is kept in host instead. Reads start
  only for requests that would run now, so a request waits for one read, not for a queue.

The host store and every index the scheduler reads are touched only here, on the step thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


from agentserve.engine.scheduler import Restore, Scheduler
from agentserve.kv.block_pool import BlockId, BlockPool
from agentserve.kv.disk_store import DiskStats
from agentserve.kv.hashing import BlockHash, ExtraKeys
from agentserve.kv.host_store import HostStore
from agentserve.kv.identity import CacheIdentity
from agentserve.kv.tier_worker import DeleteJob, ReadDone, ReadJob, TierWorker, WriteDone, WriteJob
from agentserve.trajectory.tier_advice import TierRates

WRITE_BLOCKS = 8  # blocks per write-through job
PREFETCH = "prefetch:"  # the key prefix of a prefetch's disk read (request ids never start so)

log = logging.getLogger("agentserve.kv.tiers")


class KvMover(Protocol):
    """The runner's side: whole blocks in and out of the pool, batched (model/runner.py)."""

    block_nbytes: int

    def read_blocks(self, block_ids: Sequence[BlockId]) -> list[bytes]: ...
    def write_blocks(self, block_ids: Sequence[BlockId], payloads: Sequence[bytes]) -> None: ...


class DiskIndex(Protocol):
    """The disk store as the step thread sees it (kv/disk_store.py): its index, thread-safe."""

    capacity_bytes: int

    def contains(self, identity: CacheIdentity, block_hash: int) -> bool: ...
    def stats(self) -> DiskStats: ...


@dataclass(slots=True)
class TierCounters:
    num_offloaded_blocks: int = 0  # gathered from the pool into the host store
    num_restored_blocks: int = 0  # copied from host into the pool
    num_loaded_blocks: int = 0  # read from disk into a LOADING request's blocks
    num_disk_written_blocks: int = 0
    num_disk_write_failures: int = 0
    num_disk_read_misses: int = 0  # blocks a load expected but did not get (recomputed)
    num_jobs_refused: int = 0  # the worker's queue was full: that copy was skipped
    num_prefetched_blocks: int = 0  # brought into the pool ahead of their request
    num_prefetch_used: int = 0  # ... and then hit by a request
    num_prefetch_wasted: int = 0  # ... and evicted before any request hit them
    num_prefetch_displaced: int = 0  # cached blocks evicted to make room for prefetched ones
    num_released_blocks: int = 0  # deleted from the lower tiers (trajectory released or ended)
    num_restore_waits: int = 0  # requests that waited for a disk read (LOADING at admission)
    restore_wait_s: float = 0.0  # ... their total wait, admission to read done
    bytes_gathered: int = 0
    gather_s: float = 0.0
    bytes_scattered: int = 0
    scatter_s: float = 0.0
    bytes_read_disk: int = 0
    read_disk_s: float = 0.0
    bytes_written_disk: int = 0
    write_disk_s: float = 0.0


class KvTiers:
    def __init__(self, host: HostStore, mover: KvMover, identity: CacheIdentity, pool: BlockPool,
                 worker: TierWorker | None = None, disk: DiskIndex | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        assert (worker is None) == (disk is None), "a disk tier needs its worker"
        self.host = host
        self.mover = mover
        self.identity = identity
        self.pool = pool
        self.worker = worker
        self.disk = disk
        self.clock = clock
        self.counters = TierCounters()
        self._ids: dict[str | None, CacheIdentity] = {}
        self._pending_disk: set[BlockHash] = set()  # queued for the disk, not yet written
        self.loading: dict[str, tuple[BlockHash, ...]] = {}  # read key -> hashes being read
        self._loaded_at: dict[str, float] = {}  # load key -> when it was queued
        self._cancelled: set[str] = set()  # prefetch reads whose trajectory ended meanwhile
        # prefetched into the pool, not yet hit: hash -> None (oldest first, bounded)
        self.prefetched: OrderedDict[BlockHash, None] = OrderedDict()
        self.max_prefetch_blocks = max(1, pool.num_blocks // 4)  # per call
        self.max_prefetched = 4 * pool.num_blocks
        self.prefill_tokens_per_s: float | None = None  # measured by the engine
        self.probe: TierRates | None = None  # start-up measurement, until live figures exist
        self._prefetch_ids = itertools.count()
        self._steps = 0

    def _identity(self, keys: ExtraKeys) -> CacheIdentity:
        ident = self._ids.get(keys.cache_salt)
        if ident is None:
            ident = self._ids[keys.cache_salt] = self.identity.for_tenant(keys.cache_salt)
        return ident

    def held(self, hashes: Sequence[BlockHash], cache_salt: str | None) -> tuple[int, int]:
        """How many of hashes the host store and the disk hold (index lookups, no I/O)."""
        host = sum(map(self.host.__contains__, hashes))
        if self.disk is None:
            return host, 0
        ident = self.identity.for_tenant(cache_salt)
        return host, sum(self.disk.contains(ident, h) for h in hashes)

    # ── scheduler side ───────────────────────────────────────────────────────────────────
    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many of hashes, from the first, the host store can restore."""
        return self.host.match(hashes)

    # ── disk loads, at admission ─────────────────────────────────────────────────────────
    def disk_run(self, hashes: Sequence[BlockHash], keys: ExtraKeys) -> int:
        """How many of hashes, from the first, are on disk (0 without a disk tier)."""
        if self.disk is None:
            return 0
        ident = self._identity(keys)
        for i, h in enumerate(hashes):
            if not self.disk.contains(ident, h):
                return i
        return len(hashes)

    def load(self, key: str, hashes: Sequence[BlockHash], keys: ExtraKeys) -> bool:
        """Queue a read of these blocks for the LOADING request `key` names (the scheduler
        has allocated their blocks); False (counted) if the worker's queue is full."""
        assert self.worker is not None
        if not self.worker.submit(ReadJob(key, self._identity(keys), tuple(hashes))):
            self.counters.num_jobs_refused += 1
            return False
        self.loading[key] = tuple(hashes)
        self._loaded_at[key] = self.clock()
        return True

    def on_started(self, hashes: Sequence[BlockHash]) -> None:
        """A request was admitted with these cached blocks: prefetched ones among them are used."""
        if not self.prefetched:
            return
        pop = self.prefetched.pop
        self.counters.num_prefetch_used += sum(pop(h, 0) is None for h in hashes)

    def poll(self) -> list[ReadDone]:
        """Apply finished I/O; the disk reads of LOADING requests that ended (their keys, the
        prefix of their hashes read and verified, its payloads), to be copied in by the caller."""
        if self.worker is None:
            return []
        out = []
        c = self.counters
        for done in self.worker.poll():
            if isinstance(done, WriteDone):
                self._pending_disk.difference_update(done.hashes, done.failed)
                c.num_disk_written_blocks += len(done.hashes)
                c.num_disk_write_failures += len(done.failed)
                c.bytes_written_disk += done.nbytes
                c.write_disk_s += done.seconds
                continue
            assert isinstance(done, ReadDone)
            wanted = self.loading.pop(done.key, done.hashes)
            c.bytes_read_disk += sum(map(len, done.payloads))
            c.read_disk_s += done.seconds
            if done.key.startswith(PREFETCH):
                if done.key in self._cancelled:  # its trajectory ended while the read ran
                    self._cancelled.discard(done.key)
                    continue
                # tail first: if the host store overflows, it drops the run's tail, not its head
                for h, p in zip(reversed(done.hashes), reversed(done.payloads), strict=True):
                    self.host.put(h, p)
                self._to_device(done.hashes)
                continue
            c.num_restore_waits += 1
            c.restore_wait_s += self.clock() - self._loaded_at.pop(done.key, self.clock())
            c.num_loaded_blocks += len(done.hashes)
            c.num_disk_read_misses += len(wanted) - len(done.hashes)
            if len(wanted) > len(done.hashes) and self.pool.tombstones is not None:
                # a missing, corrupt or unauthenticated file: the ledger's miss says so
                self.pool.tombstones.record(wanted[len(done.hashes) :], "lower_tier_unreadable", "disk")
            out.append(done)
        return out

    def loaded(self, block_ids: Sequence[BlockId], payloads: Sequence[bytes]) -> None:
        """Copy payloads into the blocks the scheduler allocated for them (a finished load, or
        host restores), timed."""
        t0 = self.clock()
        self.mover.write_blocks(block_ids, payloads)
        self.counters.scatter_s += self.clock() - t0
        self.counters.bytes_scattered += sum(map(len, payloads))

    def apply_loads(self, scheduler: Scheduler) -> None:
        """A step's first act: apply finished I/O, and copy each finished load into its
        request's blocks, which then runs (a stale one's blocks are kept in host)."""
        for done in self.poll():
            request = scheduler.loading_request(done.key)
            if request is None:
                self.stale(done)
                continue
            block_ids, _ = scheduler.loaded(request, len(done.hashes))
            self.loaded(block_ids, done.payloads)

    def stale(self, done: ReadDone) -> None:
        """A load whose request was preempted or ended meanwhile: its blocks are kept in host."""
        for h, p in zip(reversed(done.hashes), reversed(done.payloads), strict=True):
            self.host.put(h, p)

    # ── restore, before the forward ──────────────────────────────────────────────────────
    def restore(self, restores: Sequence[Restore]) -> None:
        block_ids: list[BlockId] = []
        payloads: list[bytes] = []
        for r in restores:
            for b, h in zip(r.block_ids, r.hashes, strict=True):
                p = self.host.get(h)
                assert p is not None, "a host block the scheduler matched left before its restore"
                block_ids.append(b)
                payloads.append(p)
        self.loaded(block_ids, payloads)
        self.counters.num_restored_blocks += len(block_ids)

    # ── offload, when a request finishes ─────────────────────────────────────────────────
    def offload(self, hashes: Sequence[BlockHash], keys: ExtraKeys) -> None:
        """Copy below the blocks of a finished sequence that are still in the pool and not yet
        in every lower tier."""
        blocks = self.pool.match_prefix(hashes)
        hashes = hashes[: len(blocks)]
        ident = self._identity(keys) if self.disk is not None else self.identity
        need_host = [h not in self.host for h in hashes]
        need_disk = [self.disk is not None and h not in self._pending_disk
                     and not self.disk.contains(ident, h) for h in hashes]
        picked = [i for i in range(len(hashes)) if need_host[i] or need_disk[i]]
        if not picked:
            return
        t0 = self.clock()
        payloads = self.mover.read_blocks([blocks[i] for i in picked])
        c = self.counters
        c.gather_s += self.clock() - t0
        c.bytes_gathered += sum(map(len, payloads))
        to_disk_h, to_disk_p = [], []
        # tail first into host: if the sequence overflows the store, its head stays (a prefix)
        for i, p in zip(reversed(picked), reversed(payloads), strict=True):
            if need_host[i] and self.host.put(hashes[i], p):
                c.num_offloaded_blocks += 1
        for i, p in zip(picked, payloads, strict=True):
            if need_disk[i]:
                to_disk_h.append(hashes[i])
                to_disk_p.append(p)
        assert self.worker is not None or not to_disk_h
        for i in range(0, len(to_disk_h), WRITE_BLOCKS):  # small jobs: a read waits for one at most
            hs, ps = tuple(to_disk_h[i : i + WRITE_BLOCKS]), tuple(to_disk_p[i : i + WRITE_BLOCKS])
            if self.worker.submit(WriteJob(ident, hs, ps)):  # type: ignore[union-attr]
                self._pending_disk.update(hs)
            else:
                c.num_jobs_refused += 1

    def timed_step(self, num_tokens: int, seconds: float) -> None:
        """The engine's forward rate, smoothed; steps of 16 tokens or more once one was seen
        (decode-only steps say little about prefill)."""
        self._steps += 1
        if self._steps % 64 == 0:
            self.sweep_prefetched()
        if seconds <= 0 or num_tokens == 0 or (num_tokens < 16 and self.prefill_tokens_per_s is not None):
            return
        rate = num_tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else 0.8 * old + 0.2 * rate

    # ── prefetch and release (trajectory/residency.py's advice, on the engine thread) ──────
    def _tenant_keys(self, tenant: str) -> CacheIdentity:
        return self.identity.for_tenant(tenant or None)

    def prefetch(self, hashes: Sequence[BlockHash], tenant: str) -> int:
        """Bring a paused trajectory's blocks back into the pool before its request: those in
        host now (a copy into free blocks), those only on disk through a read on the worker.
        Bounded per call; blocks not matched as a prefix are not fetched. The count queued."""
        hashes = list(hashes)
        start = len(self.pool.match_prefix(hashes))
        run = self.host.match(hashes[start:])
        n = self._to_device(hashes[start : start + run])
        rest = hashes[start + run :][: self.max_prefetch_blocks]
        if n < run or not rest or self.disk is None or self.worker is None:
            return n
        ident = self._tenant_keys(tenant)
        on_disk = []
        for h in rest:
            if not self.disk.contains(ident, h):
                break
            on_disk.append(h)
        key = f"{PREFETCH}{next(self._prefetch_ids)}"
        if on_disk and self.worker.submit(ReadJob(key, ident, tuple(on_disk))):
            self.loading[key] = tuple(on_disk)
            return n + len(on_disk)
        return n

    def _to_device(self, hashes: Sequence[BlockHash]) -> int:
        """Copy host blocks into free pool blocks and publish them (cached, free: the next
        request locks them). Takes at most a quarter of the pool per call and only free blocks."""
        pool = self.pool
        hashes = [h for h in hashes[: self.max_prefetch_blocks] if h not in pool.index and h in self.host]
        n = min(len(hashes), pool.num_free_blocks)
        if n == 0:
            return 0
        hashes = hashes[:n]
        evicted = pool.num_evictions
        block_ids = pool.allocate(n)
        self.counters.num_prefetch_displaced += pool.num_evictions - evicted
        payloads = [self.host.get(h) for h in hashes]
        self.mover.write_blocks(block_ids, payloads)  # type: ignore[arg-type]
        pool.insert_many(block_ids, hashes)
        pool.free(reversed(block_ids))  # a shared head is evicted last, as a finished request's
        for h in hashes:
            self.prefetched[h] = None
        while len(self.prefetched) > self.max_prefetched:
            self.prefetched.popitem(last=False)
        self.counters.num_prefetched_blocks += n
        return n

    def sweep_prefetched(self) -> None:
        """Prefetched blocks evicted before any request used them are wasted."""
        index = self.pool.index
        gone = [h for h in self.prefetched if h not in index]
        for h in gone:
            del self.prefetched[h]
        self.counters.num_prefetch_wasted += len(gone)

    def release(self, hashes: Sequence[BlockHash], tenant: str) -> int:
        """Delete these blocks from host and disk (a released or ended trajectory's own), and
        cancel prefetch reads of them still in flight."""
        gone = set(hashes)
        for key, wanted in self.loading.items():
            if key.startswith(PREFETCH) and gone.intersection(wanted):
                self._cancelled.add(key)
        n = 0
        for h in hashes:
            if h in self.host:
                self.host.delete(h)
                n += 1
        if self.disk is not None and self.worker is not None and hashes:
            ident = self._tenant_keys(tenant)
            on_disk = tuple(h for h in hashes if self.disk.contains(ident, h))
            if on_disk and self.worker.submit(DeleteJob(ident, on_disk)):
                n += len(on_disk)
        self.counters.num_released_blocks += n
        return n

    def rates(self) -> TierRates:
        """Measured costs: live figures once there is traffic, the start-up probe before."""
        c, probe = self.counters, self.probe
        if self.disk is not None:
            bw = c.bytes_read_disk / c.read_disk_s if c.read_disk_s > 0.01 else None
        else:
            bw = c.bytes_scattered / c.scatter_s if c.scatter_s > 0.01 else None
        if bw is None and probe is not None:
            bw = probe.reload_bytes_per_s
        # A pause follows a response, which follows a prefill the engine timed.
        prefill = self.prefill_tokens_per_s
        assert bw is not None and prefill is not None, "rates() before any step or probe"
        return TierRates(self.mover.block_nbytes, self.pool.block_size, prefill, bw)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

