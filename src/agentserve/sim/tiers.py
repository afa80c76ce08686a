"""The lower KV tiers in virtual time: the server's own KvTiers, HostStore and TierIndex, with
metadata for payloads and a disk whose reads and writes take the time of a shared link.

What differs from the server is only what moves bytes: `SimMover` returns placeholders of a
block's size instead of gathering tensors, `SimDisk` is a TierIndex instead of files, and
`SimWorker` completes jobs at virtual times instead of on a thread. Jobs share one disk link in
submission order (a job starts when the previous one ends: restores queue behind each other and
behind write-through), at `read_bw` / `write_bw` bytes per second plus a per-job latency. Host <->
device copies are charged to the step that does them (the cost model's link_bw).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agentserve.config import TierConfig
from agentserve.engine.tiers import KvTiers
from agentserve.kv.block_pool import BlockPool
from agentserve.kv.disk_store import DiskStats
from agentserve.kv.hashing import BlockHash
from agentserve.kv.host_store import HostStore, TierIndex
from agentserve.kv.identity import CacheIdentity
from agentserve.kv.tier_worker import DeleteJob, Done, Job, ReadDone, ReadJob, WorkerStats, WriteDone, WriteJob
from agentserve.sim.cost import CostModel
from agentserve.trajectory.tier_advice import TierRates

DEFAULT_HOST_BLOCKS = TierConfig().default_host_blocks  # the server's host store with a disk tier only


class Placeholder(bytes):
    """A block's payload in the simulator: empty bytes that report the block's size."""

    nbytes: int

    def __new__(cls, nbytes: int) -> Placeholder:
        obj = super().__new__(cls)
        obj.nbytes = nbytes
        return obj

    def __len__(self) -> int:
        return self.nbytes


class SimMover:
    def __init__(self, block_nbytes: int) -> None:
        self.block_nbytes = block_nbytes
        self._block = Placeholder(block_nbytes)

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        return [self._block] * len(block_ids)

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        assert all(len(p) == self.block_nbytes for p in payloads)


class SimDisk:
    """The disk tier's bookkeeping: one TierIndex (tenants share it: hashes carry the salt)."""

    def __init__(self, capacity_bytes: int, block_nbytes: int) -> None:
        self.index = TierIndex("disk", capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self._block = Placeholder(block_nbytes)

    def put(self, identity: CacheIdentity, block_hash: int, payload: bytes | memoryview) -> bool:
        return self.index.add(BlockHash(block_hash), len(payload)) is not None

    def get(self, identity: CacheIdentity, block_hash: int) -> bytes | None:
        if block_hash not in self.index:
            return None
        self.index.touch(BlockHash(block_hash))
        return self._block

    def contains(self, identity: CacheIdentity, block_hash: int) -> bool:
        return block_hash in self.index

    def delete(self, identity: CacheIdentity, block_hash: int) -> None:
        self.index.remove(BlockHash(block_hash))

    def stats(self) -> DiskStats:
        st = self.index.stats
        return DiskStats(num_files=len(self.index), used_bytes=st.used_bytes, num_writes=st.num_puts,
                         num_hits=st.num_hits, num_evicted=st.num_evicted, num_deleted=st.num_deleted,
                         bytes_written=st.bytes_in, bytes_read=st.bytes_out)


class _NoWait:
    """The worker's wake event, which a simulated step never waits on."""

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def set(self) -> None: ...
    def clear(self) -> None: ...


class SimWorker:
    """TierWorker's interface in virtual time; `on_done_at(t)` asks the fleet for an event at t."""

    def __init__(self, disk: SimDisk, clock: Callable[[], float], read_bw: float, write_bw: float,
                 latency_s: float = 1e-4, max_queued: int = 256,
                 on_done_at: Callable[[float], None] | None = None) -> None:
        self.store = disk
        self.clock = clock
        self.read_bw, self.write_bw, self.latency_s = read_bw, write_bw, latency_s
        self.max_queued = max_queued
        self.on_done_at = on_done_at
        self.stats = WorkerStats()
        self.wake = _NoWait()
        # [start, end, job, duration] in service order; the first has started once start <= now
        self._queue: list[list] = []

    def submit(self, job: Job) -> bool:
        """Queue a job on the link: reads go ahead of queued writes and deletes (TierWorker's
        order); the jobs a read passes end later, and the fleet is told their new ends."""
        if len(self._queue) >= self.max_queued:
            self.stats.num_refused += 1
            return False
        now = self.clock()
        entry = [now, now, job, self._duration(job)]
        at = len(self._queue)
        if isinstance(job, ReadJob):
            at = 0
            while at < len(self._queue) and (self._queue[at][0] <= now or isinstance(self._queue[at][2], ReadJob)):
                at += 1  # behind the job in service and the reads queued before it
        self._queue.insert(at, entry)
        self._retime(at, now)
        return True

    def _retime(self, first: int, now: float) -> None:
        """Start and end of every queued job from `first` on, back to back on the link."""
        t = self._queue[first - 1][1] if first else now
        for entry in list(self._queue)[first:]:
            start, end = max(t, now), max(t, now) + entry[3]
            moved = end != entry[1] or entry is self._queue[first]
            entry[0], entry[1] = start, end
            if moved and self.on_done_at is not None:
                self.on_done_at(end)
            t = end

    def _duration(self, job: Job) -> float:
        block = self.store._block.nbytes
        if isinstance(job, WriteJob):
            return self.latency_s + sum(map(len, job.payloads)) / self.write_bw
        if isinstance(job, ReadJob):
            n = sum(self.store.contains(job.identity, h) for h in job.hashes)
            return self.latency_s + n * block / self.read_bw
        return self.latency_s

    def poll(self) -> list[Done]:
        now, out = self.clock(), []
        while self._queue and self._queue[0][1] <= now:
            start, end, job, _ = self._queue.pop(0)
            done = self._apply(job, end - start)
            if done is not None:
                out.append(done)
        return out

    def _apply(self, job: Job, seconds: float) -> Done | None:
        disk = self.store
        if isinstance(job, WriteJob):
            ok = [h for h in job.hashes if disk.put(job.identity, h, disk._block)]
            failed = tuple(h for h in job.hashes if h not in set(ok))
            return WriteDone(tuple(ok), failed, sum(map(len, job.payloads)), seconds)
        if isinstance(job, ReadJob):
            got = []
            for h in job.hashes:
                p = disk.get(job.identity, h)
                if p is None:
                    break
                got.append(p)
            return ReadDone(job.key, job.hashes[: len(got)], tuple(got), seconds)
        assert isinstance(job, DeleteJob)
        for h in job.hashes:
            disk.delete(job.identity, h)
        return None

    def idle(self) -> bool:
        return not self._queue

    def drain(self, timeout_s: float = 0.0) -> bool:
        return self.idle()

    def close(self) -> None: ...


def sim_tiers(host_tokens: int, disk_tokens: int, block_size: int, cost: CostModel, pool: BlockPool,
              clock: Callable[[], float], on_done_at: Callable[[float], None]) -> KvTiers:
    """A replica's KvTiers, as build_kv_tiers makes them, over simulated stores; its start-up
    rates are the cost model's (the simulator's "machine")."""
    block = cost.kv_bytes_per_token * block_size
    host = HostStore(host_tokens * cost.kv_bytes_per_token or DEFAULT_HOST_BLOCKS * block)
    identity = CacheIdentity("sim", "bfloat16", block_size, "sim", cost.name)
    mover = SimMover(block)
    if not disk_tokens:
        tiers = KvTiers(host, mover, identity, pool, clock=clock)
    else:
        disk = SimDisk(disk_tokens * cost.kv_bytes_per_token, block)
        worker = SimWorker(disk, clock, cost.disk_read_bw, cost.disk_write_bw, cost.disk_latency_s,
                           max_queued=TierConfig().max_queued_jobs, on_done_at=on_done_at)
        tiers = KvTiers(host, mover, identity, pool, worker=worker, disk=disk, clock=clock)  # type: ignore[arg-type]
    reload_bw = cost.disk_read_bw if disk_tokens else cost.link_bw
    tiers.probe = TierRates(block, block_size, prefill_tokens_per_s=0.0, reload_bytes_per_s=reload_bw)
    return tiers
