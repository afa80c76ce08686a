"""Building the lower KV tiers from a TierConfig: the host store, the disk store with its key
and I/O worker, and the start-up probe of what moving KV costs on this machine."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from agentserve.config import TierConfig
from agentserve.engine.tiers import KvMover, KvTiers
from agentserve.kv.block_pool import BlockId, BlockPool
from agentserve.kv.host_store import HostStore
from agentserve.kv.identity import CacheIdentity
from agentserve.kv.tier_worker import TierWorker
from agentserve.trajectory.tier_advice import TierRates

log = logging.getLogger("agentserve.kv.tiers")


def build_kv_tiers(config: TierConfig, mover: KvMover, pool: BlockPool, identity: CacheIdentity
                   ) -> KvTiers | None:
    """The host store, and the disk store with its key and I/O worker, from the config."""
    if not config.enabled:
        return None
    host_bytes = config.host_bytes or config.default_host_blocks * mover.block_nbytes
    host = HostStore(host_bytes)
    if config.disk_dir is None:
        tiers = KvTiers(host, mover, identity, pool)
        tiers.probe = probe_rates(mover, pool, None)
        return tiers
    from agentserve.kv.disk_store import DiskStore
    from agentserve.kv.sealing import derive_keys, load_or_create_key

    directory = Path(config.disk_dir)
    master = config.key
    if master is None:
        key_path = config.key_path or Path.home() / ".config" / "agentserve" / "kv.key"
        master = load_or_create_key(key_path, directory)
    disk = DiskStore(directory, config.disk_bytes, identity, derive_keys(master, config.encrypt),
                     page_cache=config.disk_page_cache)
    worker = TierWorker(disk, max_queued=config.max_queued_jobs)
    tiers = KvTiers(host, mover, identity, pool, worker=worker, disk=disk)
    tiers.probe = probe_rates(mover, pool, directory)
    return tiers


def probe_rates(mover: KvMover, pool: BlockPool, disk_dir: Path | None) -> TierRates:
    """Start-up figures for the advice until live traffic measures them: a gather and scatter
    of a few free pool blocks, and a file of the same bytes written, synced, dropped from the
    page cache and read back in the disk tier's directory."""
    n = min(8, pool.num_blocks)
    ids = [BlockId(i) for i in range(n)]  # all free and empty at start-up
    t0 = time.perf_counter()
    payloads = mover.read_blocks(ids)
    mover.write_blocks(ids, payloads)
    nbytes = sum(map(len, payloads))
    bw = 2 * nbytes / max(time.perf_counter() - t0, 1e-6)
    if disk_dir is not None:
        bw = _probe_disk(disk_dir, b"".join(payloads)) or bw
    return TierRates(mover.block_nbytes, pool.block_size, prefill_tokens_per_s=0.0, reload_bytes_per_s=bw)


def _probe_disk(directory: Path, data: bytes) -> float | None:
    path = directory / f".probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            f.read()
        return len(data) / max(time.perf_counter() - t0, 1e-6)
    except OSError as exc:
        log.warning("disk tier probe in %s failed (%s): using the host figure", directory, exc)
        return None
    finally:
        with contextlib.suppress(OSError):  # a directory that cannot be written: the store says so
            path.unlink()


