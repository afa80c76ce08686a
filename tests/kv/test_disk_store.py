"""The disk tier: sealed files served across restarts, anything damaged or foreign refused and
counted, other identities' namespaces untouched, bounded in bytes (LRU), and every OSError a
False or a miss rather than an exception."""

from __future__ import annotations

import errno
import logging
import os
import random
import stat
import time
from pathlib import Path

import pytest

from agentserve.kv.disk_store import DiskStore
from agentserve.kv.identity import CacheIdentity
from agentserve.kv.sealing import derive_keys

BASE = CacheIdentity("tiny@0123", "float32", 16, "block-major[layers=2,kv=2,tokens=16]", "")
KEYS = derive_keys(bytes(range(32)), encrypt=False)
H = [0x1000 + i for i in range(64)]  # hashes of equal width: equal file sizes


def payload(i: int, n: int = 1000) -> bytes:
    return random.Random(i).randbytes(n)


def ns_dir(root: Path, identity: CacheIdentity = BASE) -> Path:
    return root / identity.digest()


def block_file(root: Path, h: int, identity: CacheIdentity = BASE) -> Path:
    return ns_dir(root, identity) / f"{h:016x}.kv"


def kv_bytes(ns: Path) -> int:
    return sum(os.stat(p).st_size for p in ns.glob("*.kv"))


def blob_size(tmp_path: Path) -> int:
    store = DiskStore(tmp_path / "probe", 10**9, BASE, KEYS)
    assert store.put(BASE, H[0], payload(0))
    return store.stats().used_bytes


@pytest.mark.parametrize("encrypt", [False, True])
def test_put_get_round_trip(tmp_path, encrypt):
    keys = derive_keys(bytes(range(32)), encrypt)
    root = tmp_path / "kv"
    store = DiskStore(root, 10**7, BASE, keys)
    assert not store.contains(BASE, H[0]) and store.get(BASE, H[0]) is None
    assert store.put(BASE, H[0], memoryview(payload(0)))
    assert store.contains(BASE, H[0])
    assert store.get(BASE, H[0]) == payload(0)
    path = block_file(root, H[0])
    assert (payload(0)[:100] in path.read_bytes()) is not encrypt
    assert stat.S_IMODE(root.stat().st_mode) == stat.S_IMODE(ns_dir(root).stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert (ns_dir(root) / "identity.json").read_text() == BASE.to_json()
    before = path.stat()
    assert store.put(BASE, H[0], payload(99))  # already present: not rewritten
    assert path.stat().st_ino == before.st_ino and store.get(BASE, H[0]) == payload(0)
    s = store.stats()
    assert (s.num_files, s.num_writes, s.num_reads, s.num_hits) == (1, 1, 2, 2)
    assert s.used_bytes == s.bytes_written == path.stat().st_size and s.bytes_read == 2 * s.used_bytes
    store.delete(BASE, H[0])
    assert not path.exists() and not store.contains(BASE, H[0])
    assert store.stats().num_deleted == 1 and store.stats().used_bytes == 0


def test_a_restart_serves_the_files(tmp_path):
    first = DiskStore(tmp_path, 10**7, BASE, KEYS)
    for i in range(3):
        assert first.put(BASE, H[i], payload(i))
    again = DiskStore(tmp_path, 10**7, BASE, KEYS)
    assert again.stats().num_files == 3 and again.stats().used_bytes == first.stats().used_bytes
    assert [again.get(BASE, H[i]) for i in range(3)] == [payload(i) for i in range(3)]
    assert again.stats().num_verify_failures == 0


def test_a_restart_under_another_key_deletes_and_counts_every_file(tmp_path):
    assert DiskStore(tmp_path, 10**7, BASE, KEYS).put(BASE, H[0], payload(0))
    other = DiskStore(tmp_path, 10**7, BASE, derive_keys(bytes(32), False))
    assert other.contains(BASE, H[0])  # indexed from the scan: verified only when read
    assert other.get(BASE, H[0]) is None
    assert not block_file(tmp_path, H[0]).exists() and not other.contains(BASE, H[0])
    assert other.stats().num_verify_failures == 1 and other.stats().used_bytes == 0


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


@pytest.mark.parametrize("damage", [_corrupt, _truncate], ids=["corrupted", "truncated"])
def test_a_damaged_file_is_deleted_counted_and_never_served(tmp_path, damage):
    store = DiskStore(tmp_path, 10**7, BASE, KEYS)
    assert store.put(BASE, H[0], payload(0)) and store.put(BASE, H[1], payload(1))
    damage(block_file(tmp_path, H[0]))
    again = DiskStore(tmp_path, 10**7, BASE, KEYS)
    assert again.get(BASE, H[0]) is None
    assert not block_file(tmp_path, H[0]).exists()
    assert again.stats().num_verify_failures == 1
    assert again.get(BASE, H[1]) == payload(1)  # its neighbour is intact


def test_a_damaged_file_in_a_live_store_is_deleted_and_counted(tmp_path):
    store = DiskStore(tmp_path, 10**7, BASE, KEYS)
    assert store.put(BASE, H[0], payload(0))
    _corrupt(block_file(tmp_path, H[0]))
    assert store.get(BASE, H[0]) is None and not block_file(tmp_path, H[0]).exists()
    assert store.stats().num_verify_failures == 1 and not store.contains(BASE, H[0])
    assert store.put(BASE, H[0], payload(0)) and store.get(BASE, H[0]) == payload(0)


def test_a_file_renamed_to_another_hash_is_refused(tmp_path):
    store = DiskStore(tmp_path, 10**7, BASE, KEYS)
    assert store.put(BASE, H[0], payload(0)) and store.put(BASE, H[1], payload(1))
    os.replace(block_file(tmp_path, H[0]), block_file(tmp_path, H[1]))
    assert store.get(BASE, H[1]) is None  # a valid seal, but of another block
    assert not block_file(tmp_path, H[1]).exists() and store.stats().num_verify_failures == 1
    assert store.get(BASE, H[0]) is None  # its file is gone: a clean miss
    assert store.stats().num_verify_failures == 1 and store.stats().num_files == 0


def test_another_models_namespace_is_ignored_and_left_intact(tmp_path):
    root = tmp_path / "kv"
    assert DiskStore(root, 10**7, BASE, KEYS).put(BASE, H[0], payload(0))
    theirs = block_file(root, H[0])
    snapshot = theirs.read_bytes()
    junk = root / "not-a-namespace"
    junk.mkdir()
    (junk / f"{H[1]:016x}.kv").write_bytes(b"junk")
    other_model = CacheIdentity("other@9999", "float32", 16, BASE.layout, "")
    size = blob_size(tmp_path)
    store = DiskStore(root, 2 * size + 10, other_model, KEYS)  # room for two of its own
    assert store.stats().num_foreign_namespaces == 2 and store.stats().num_files == 0
    assert store.get(other_model, H[0]) is None
    for i in range(6):  # evicts its own files, never the other model's
        assert store.put(other_model, H[i], payload(i))
    assert store.stats().num_evicted == 4
    assert theirs.read_bytes() == snapshot and (junk / f"{H[1]:016x}.kv").read_bytes() == b"junk"
    assert sorted(p.name for p in junk.iterdir()) == [f"{H[1]:016x}.kv"]
    assert DiskStore(root, 10**7, BASE, KEYS).get(BASE, H[0]) == payload(0)


def test_another_tenant_misses_without_reading_the_other_tenants_file(tmp_path, monkeypatch):
    alice, bob = BASE.for_tenant("alice"), BASE.for_tenant("bob")
    store = DiskStore(tmp_path, 10**7, BASE, KEYS)
    assert store.put(alice, H[0], payload(0))
    read: list[Path] = []
    real_read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: read.append(p) or real_read(p))
    assert store.get(bob, H[0]) is None and not store.contains(bob, H[0])
    assert store.get(BASE, H[0]) is None  # no tenant is a tenant of its own
    assert read == []
    assert store.put(bob, H[0], payload(1))
    assert store.get(bob, H[0]) == payload(1) and store.get(alice, H[0]) == payload(0)
    assert ns_dir(tmp_path, alice) != ns_dir(tmp_path, bob)
    assert {p.parent.name for p in read} == {alice.digest(), bob.digest()}
    again = DiskStore(tmp_path, 10**7, BASE, KEYS)  # tenants' namespaces are ours: served
    assert again.stats().num_foreign_namespaces == 0
    assert again.get(alice, H[0]) == payload(0) and again.get(bob, H[0]) == payload(1)


def test_capacity_bounds_the_index_and_the_disk(tmp_path):
    size = blob_size(tmp_path)
    capacity = 5 * size + size // 2
    store = DiskStore(tmp_path / "kv", capacity, BASE, KEYS)
    for i in range(50):
        assert store.put(BASE, H[i], payload(i))
        assert store.stats().used_bytes <= capacity
        assert kv_bytes(ns_dir(tmp_path / "kv")) <= capacity
    s = store.stats()
    assert (s.num_files, s.num_evicted, s.num_writes) == (5, 45, 50)
    assert kv_bytes(ns_dir(tmp_path / "kv")) == s.used_bytes
    assert [store.contains(BASE, H[i]) for i in range(44, 50)] == [False] + [True] * 5
    assert not store.put(BASE, H[60], payload(60, n=capacity))  # larger than the whole store
    assert store.stats().num_files == 5 and not block_file(tmp_path / "kv", H[60]).exists()


def test_lru_evicts_the_least_recently_used(tmp_path):
    size = blob_size(tmp_path)
    store = DiskStore(tmp_path / "kv", 3 * size + size // 2, BASE, KEYS)
    for i in range(3):
        assert store.put(BASE, H[i], payload(i))
    assert store.get(BASE, H[0]) == payload(0)  # 0 is now the most recent; 1 the least
    assert store.put(BASE, H[3], payload(3))
    assert [store.contains(BASE, H[i]) for i in range(4)] == [True, False, True, True]
    assert not block_file(tmp_path / "kv", H[1]).exists()
    assert store.put(BASE, H[0], payload(0))  # present: refreshed, so 2 goes next
    assert store.put(BASE, H[4], payload(4))
    assert [store.contains(BASE, H[i]) for i in range(5)] == [True, False, False, True, True]


def test_a_restart_orders_lru_by_mtime_and_trims_to_capacity(tmp_path):
    size = blob_size(tmp_path)
    store = DiskStore(tmp_path / "kv", 10**7, BASE, KEYS)
    now = time.time()
    for i, age in enumerate([30, 10, 40, 20]):
        assert store.put(BASE, H[i], payload(i))
        os.utime(block_file(tmp_path / "kv", H[i]), (now - age, now - age))
    small = DiskStore(tmp_path / "kv", 2 * size + size // 2, BASE, KEYS)
    assert [small.contains(BASE, H[i]) for i in range(4)] == [False, True, False, True]
    assert [block_file(tmp_path / "kv", H[i]).exists() for i in range(4)] == [False, True, False, True]
    assert small.stats().num_evicted == 2 and small.stats().used_bytes == 2 * size


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a 0o500 directory")
def test_an_unwritable_namespace_fails_puts_but_serves_reads(tmp_path):
    store = DiskStore(tmp_path, 10**7, BASE, KEYS)
    assert store.put(BASE, H[0], payload(0))
    ns_dir(tmp_path).chmod(0o500)
    try:
        assert not store.put(BASE, H[1], payload(1))
        assert store.stats().num_write_errors == 1 and not store.contains(BASE, H[1])
        assert store.get(BASE, H[0]) == payload(0)
    finally:
        ns_dir(tmp_path).chmod(0o700)


def _failing(monkeypatch, name: str, code: int, when=lambda *a: True) -> None:
    real = getattr(os, name)

    def fake(*args, **kwargs):
        if when(*args):
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, fake)


def test_a_permission_error_on_the_temp_file_fails_the_put_cleanly(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 10**7, BASE, KEYS)
    assert store.put(BASE, H[0], payload(0))
    with monkeypatch.context() as m:
        _failing(m, "open", errno.EACCES, when=lambda path, *a: Path(path).name.startswith(".tmp-"))
        assert not store.put(BASE, H[1], payload(1))
    assert store.stats().num_write_errors == 1 and not store.contains(BASE, H[1])
    assert store.get(BASE, H[0]) == payload(0)


def test_a_full_disk_fails_puts_leaves_no_temp_file_and_warns_once(tmp_path, monkeypatch, caplog):
    store = DiskStore(tmp_path, 10**7, BASE, KEYS)
    assert store.put(BASE, H[0], payload(0))
    used = store.stats().used_bytes
    caplog.set_level(logging.DEBUG, logger="agentserve.kv.disk")
    with monkeypatch.context() as m:
        _failing(m, "write", errno.ENOSPC)
        assert not store.put(BASE, H[1], payload(1))
        assert not store.put(BASE, H[2], payload(2))
    s = store.stats()
    assert s.num_write_errors == 2 and s.used_bytes == used and s.num_files == 1
    assert sorted(p.name for p in ns_dir(tmp_path).iterdir()) == [
        ".lock", f"{H[0]:016x}.kv", "identity.json"
    ]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space" in warnings[0].getMessage()
    assert store.put(BASE, H[1], payload(1)) and store.get(BASE, H[1]) == payload(1)


def test_a_store_over_a_file_is_empty_and_refuses_puts(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    for directory in (blocker, blocker / "sub"):
        store = DiskStore(directory, 10**7, BASE, KEYS)
        assert store.stats().num_write_errors == 1 and store.stats().num_files == 0
        assert not store.put(BASE, H[0], payload(0))
        assert store.get(BASE, H[0]) is None and not store.contains(BASE, H[0])
        store.delete(BASE, H[0])  # no OSError escapes
        assert store.stats().num_write_errors == 2  # the constructor's and the put's
    assert blocker.read_bytes() == b"x"


def test_two_stores_share_a_directory(tmp_path):
    a = DiskStore(tmp_path, 10**7, BASE, KEYS)
    b = DiskStore(tmp_path, 10**7, BASE, KEYS)
    assert a.put(BASE, H[0], payload(0)) and b.put(BASE, H[1], payload(1))
    assert a.get(BASE, H[1]) is None  # each keeps its own index until it rescans
    a2, b2 = DiskStore(tmp_path, 10**7, BASE, KEYS), DiskStore(tmp_path, 10**7, BASE, KEYS)
    assert a2.get(BASE, H[1]) == payload(1) and b2.get(BASE, H[0]) == payload(0)
    a2.delete(BASE, H[0])
    assert b2.get(BASE, H[0]) is None and not b2.contains(BASE, H[0])  # a clean miss
    assert b2.stats().num_verify_failures == 0 and b2.stats().num_files == 1
    assert b2.put(BASE, H[0], payload(0)) and a2.get(BASE, H[1]) == payload(1)


def test_temp_files_are_never_served_and_stale_ones_are_cleaned_at_start(tmp_path):
    store = DiskStore(tmp_path, 10**7, BASE, KEYS)
    assert store.put(BASE, H[0], payload(0)) and store.put(BASE, H[1], payload(1))
    ns = ns_dir(tmp_path)
    stale, fresh = ns / ".tmp-4242-00aa", ns / ".tmp-4242-00bb"
    os.replace(block_file(tmp_path, H[0]), stale)  # complete, validly sealed blobs
    os.replace(block_file(tmp_path, H[1]), fresh)
    old = time.time() - 120
    os.utime(stale, (old, old))
    again = DiskStore(tmp_path, 10**7, BASE, KEYS)
    assert not stale.exists() and fresh.exists()  # a young one may be another writer's
    assert again.stats().num_files == 0
    assert again.get(BASE, H[0]) is None and again.get(BASE, H[1]) is None


def test_without_the_page_cache_files_round_trip(tmp_path):
    from agentserve.kv.disk_store import DiskStore
    from agentserve.kv.identity import CacheIdentity
    from agentserve.kv.sealing import derive_keys

    ident = CacheIdentity("m@1", "bfloat16", 16, "block-major", "sdpa")
    store = DiskStore(tmp_path / "kv", 1 << 20, ident, derive_keys(bytes(32), False), page_cache=False)
    assert store.put(ident, 5, b"x" * 1000) and store.get(ident, 5) == b"x" * 1000


def test_the_io_worker_runs_reads_ahead_of_queued_writes(tmp_path):
    import threading

    from agentserve.kv.tier_worker import ReadJob, TierWorker, WriteJob

    order, gate = [], threading.Event()

    class Store:
        def put(self, identity, h, payload):
            gate.wait(5)  # the first write holds the worker while the others queue
            order.append(("w", h))
            return True

        def get(self, identity, h):
            order.append(("r", h))
            return b"x"

        def delete(self, identity, h): ...

    worker = TierWorker(Store())
    worker.submit(WriteJob(None, (1,), (b"a",)))
    while worker._jobs.qsize():  # the worker took the first write
        pass
    worker.submit(WriteJob(None, (2,), (b"b",)))
    worker.submit(ReadJob("k", None, (3,)))
    gate.set()
    assert worker.drain(5)
    worker.close()
    assert order == [("w", 1), ("r", 3), ("w", 2)]
