"""The disk tier: sealed block files under one directory, bounded in bytes, LRU per process.

Layout: `directory/<identity.digest()>/` per identity (tenant included) holds `identity.json`,
`.lock` and one `<hash:016x>.kv` file per block, so any prefix of a sequence is reusable alone.
Each file is `seal(keys, header, payload)` (kv/sealing.py) with a JSON header naming the identity,
the hash and the payload length; a file failing any check is deleted and counted, never served.

Writes go to `.tmp-<pid>-<hex>` in the namespace and are renamed into place, so a block's name
never holds a half-written file. Several processes may share the directory: each keeps its own
index (another's new files are seen at the next start), renames and deletes hold an exclusive
flock on the namespace's `.lock`, and a file gone under us is a plain miss. Namespaces of other
identities (another model, dtype, layout, format) are never read, written or deleted.

No OSError escapes put/get/delete: a cache that cannot write is a cache that misses.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from agentserve.kv.identity import CacheIdentity
from agentserve.kv.sealing import SealError, SealKeys, seal, unseal

log = logging.getLogger("agentserve.kv.disk")

IDENTITY_FILE = "identity.json"
LOCK_FILE = ".lock"
TMP_PREFIX = ".tmp-"
_BLOCK_NAME = re.compile(r"[0-9a-f]{16}\.kv")  # exactly what _name writes
STALE_TMP_S = 60.0  # a temp file older than this belongs to a writer that died

_Key = tuple[str, int]  # (namespace digest, block hash)


@dataclass(slots=True)
class DiskStats:
    num_files: int = 0
    used_bytes: int = 0  # sum of indexed file sizes, plus any write in flight
    num_writes: int = 0
    num_reads: int = 0  # files read from disk
    num_hits: int = 0  # reads that verified and were returned
    num_verify_failures: int = 0  # corrupt/truncated/unauthenticated/wrong header: deleted
    num_write_errors: int = 0  # OSError writing (disk full, unwritable dir): put returned False
    num_evicted: int = 0  # files deleted to stay within capacity
    num_deleted: int = 0  # indexed files removed by delete()
    bytes_written: int = 0
    bytes_read: int = 0
    num_foreign_namespaces: int = 0  # another identity's namespaces found at start: untouched


def _name(block_hash: int) -> str:
    return f"{block_hash:016x}.kv"


@contextmanager
def _flocked(ns: Path) -> Iterator[None]:
    fd = os.open(ns / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _header(identity: CacheIdentity, block_hash: int, payload_bytes: int) -> bytes:
    meta = {"identity": asdict(identity), "block_hash": block_hash, "payload_bytes": payload_bytes}
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


class DiskStore:
    """Block files for every tenant of one base identity; see the module docstring."""

    def __init__(
        self, directory: Path, capacity_bytes: int, base: CacheIdentity, keys: SealKeys,
        page_cache: bool = True,
    ) -> None:
        """page_cache False: every file written is synced and dropped from the OS page cache,
        and every file read is dropped after it, so reads come from the device and the page
        cache holds no KV outside the tiers' bounds (benchmarks at equal memory)."""
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self._dir = Path(directory)
        self._capacity = capacity_bytes
        self._base = base
        self._keys = keys
        self._page_cache = page_cache
        # Guards _index, _stats and _logged_errnos; never held across file I/O.
        self._lock = threading.Lock()
        self._index: OrderedDict[_Key, int] = OrderedDict()  # -> file size; oldest use first
        self._stats = DiskStats()
        self._logged_errnos: set[int] = set()
        self._ready: set[str] = set()  # namespaces whose identity.json is known to match
        self._foreign: set[str] = set()  # directories found at start that are not ours
        self._open()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def put(self, identity: CacheIdentity, block_hash: int, payload: bytes | memoryview) -> bool:
        key = self._key(identity, block_hash)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
        blob = seal(self._keys, _header(identity, block_hash, memoryview(payload).nbytes), payload)
        size = len(blob)
        if size > self._capacity:
            return False
        try:
            ns = self._ensure_namespace(identity)
        except OSError as e:
            self._os_error("creating a namespace", e, write=True)
            return False
        if ns is None:
            return False
        for victim in self._reserve(size):
            self._unlink(victim)
        try:
            self._write_atomic(ns, _name(block_hash), blob)
        except OSError as e:
            with self._lock:
                self._stats.used_bytes -= size  # the reservation
            self._os_error("writing a block", e, write=True)
            return False
        self._commit(key, size)
        return True

    def get(self, identity: CacheIdentity, block_hash: int) -> bytes | None:
        key = self._key(identity, block_hash)
        with self._lock:
            if key not in self._index:
                return None
        path = self._dir / key[0] / _name(block_hash)
        try:
            blob = self._read(path)
        except FileNotFoundError:  # deleted by another process sharing the directory
            with self._lock:
                self._drop_locked(key)
            return None
        except OSError as e:
            self._os_error("reading a block", e)
            return None
        with self._lock:
            self._stats.num_reads += 1
            self._stats.bytes_read += len(blob)
        payload, reason = self._verify(identity, block_hash, blob)
        if payload is None:
            self._discard(key, path, reason)
            return None
        with self._lock:
            self._stats.num_hits += 1
            if key in self._index:
                self._index.move_to_end(key)
        with suppress(OSError):
            os.utime(path)  # the next start orders LRU by mtime: keep it following use
        return payload

    def contains(self, identity: CacheIdentity, block_hash: int) -> bool:
        key = self._key(identity, block_hash)
        with self._lock:
            return key in self._index

    def delete(self, identity: CacheIdentity, block_hash: int) -> None:
        key = self._key(identity, block_hash)
        with self._lock:
            if self._drop_locked(key):
                self._stats.num_deleted += 1
        if key[0] not in self._foreign:
            self._unlink(key)

    def stats(self) -> DiskStats:
        with self._lock:
            return replace(self._stats, num_files=len(self._index))

    def _open(self) -> None:
        try:
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            with os.scandir(self._dir) as it:
                dirs = [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
        except OSError as e:
            self._os_error(f"opening {self._dir}", e, write=True)
            return
        found: list[tuple[int, _Key, int]] = []
        for ns in sorted(dirs):
            found.extend(self._scan_namespace(ns))
        found.sort()  # by mtime: the oldest file is the least recently used
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._stats.used_bytes += size
            victims = self._evict_locked(0)
        for victim in victims:
            self._unlink(victim)

    def _scan_namespace(self, ns: Path) -> list[tuple[int, _Key, int]]:
        """(mtime, key, size) of a namespace's blocks; none if it is absent or not ours."""
        try:
            identity = CacheIdentity.from_json((ns / IDENTITY_FILE).read_text())
            ours = identity.digest() == ns.name and identity.same_except_tenant(self._base)
        except (OSError, ValueError, TypeError):
            ours = False  # absent or unparsable: not provably ours, so never touched
        if not ours:
            self._foreign.add(ns.name)
            self._stats.num_foreign_namespaces += 1
            return []
        self._ready.add(ns.name)
        found: list[tuple[int, _Key, int]] = []
        now = time.time()
        try:
            with os.scandir(ns) as it:
                for entry in it:
                    st = entry.stat(follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    if entry.name.startswith(TMP_PREFIX):
                        if now - st.st_mtime > STALE_TMP_S:
                            with suppress(OSError):
                                os.unlink(entry.path)
                    elif _BLOCK_NAME.fullmatch(entry.name):
                        key = (ns.name, int(entry.name[:16], 16))
                        found.append((st.st_mtime_ns, key, st.st_size))
        except OSError as e:
            self._os_error(f"scanning {ns}", e)
        return found

    def _ensure_namespace(self, identity: CacheIdentity) -> Path | None:
        """The namespace directory, created with its identity.json; None if it holds another's."""
        digest = identity.digest()
        ns = self._dir / digest
        if digest in self._ready:
            return ns
        if digest in self._foreign:
            return None
        ns.mkdir(mode=0o700, exist_ok=True)
        text, path = identity.to_json(), ns / IDENTITY_FILE
        if not path.exists():  # two racing writers rename the same bytes into place
            self._write_atomic(ns, IDENTITY_FILE, text.encode())
        elif path.read_text() != text:
            self._foreign.add(digest)
            log.warning("disk KV namespace %s holds another identity: not used", ns)
            return None
        self._ready.add(digest)
        return ns

    def _read(self, path: Path) -> bytes:
        if self._page_cache:
            return path.read_bytes()
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                blob = f.read()
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return blob
        finally:
            os.close(fd)

    def _write_atomic(self, ns: Path, name: str, data: bytes) -> None:
        # No fsync: a file torn by a power loss fails its HMAC and is deleted when read, and a
        # cache gains nothing from durability that would pay for the latency.
        tmp = ns / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if not self._page_cache:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            with _flocked(ns):
                os.replace(tmp, ns / name)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise

    def _reserve(self, size: int) -> list[_Key]:
        """Counts `size` as used and returns the files to evict so that it fits."""
        with self._lock:
            victims = self._evict_locked(size)
            self._stats.used_bytes += size
            return victims

    def _commit(self, key: _Key, size: int) -> None:
        with self._lock:
            self._drop_locked(key)  # a concurrent put of the same block: counted once
            self._index[key] = size
            self._stats.num_writes += 1
            self._stats.bytes_written += size

    def _evict_locked(self, incoming: int) -> list[_Key]:
        victims = []
        while self._index and self._stats.used_bytes + incoming > self._capacity:
            key, size = self._index.popitem(last=False)
            self._stats.used_bytes -= size
            self._stats.num_evicted += 1
            victims.append(key)
        return victims

    def _drop_locked(self, key: _Key) -> bool:
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._stats.used_bytes -= size
        return True

    def _unlink(self, key: _Key) -> None:
        ns = self._dir / key[0]
        try:
            with _flocked(ns):
                os.unlink(ns / _name(key[1]))
        except FileNotFoundError:  # already gone (another process), or no namespace at all
            pass
        except OSError as e:
            self._os_error("deleting a block", e)

    def _verify(self, identity: CacheIdentity, h: int, blob: bytes) -> tuple[bytes | None, str]:
        try:
            header, payload = unseal(self._keys, blob)
        except SealError as e:
            return None, str(e)
        try:
            meta = json.loads(header)
            ok = CacheIdentity(**meta["identity"]) == identity and meta["block_hash"] == h
            ok = ok and meta["payload_bytes"] == len(payload)
        except (ValueError, TypeError, KeyError):
            ok = False
        return (payload, "") if ok else (None, "header names another identity, hash or length")

    def _discard(self, key: _Key, path: Path, reason: str) -> None:
        with self._lock:
            self._drop_locked(key)
            self._stats.num_verify_failures += 1
        log.warning("disk KV file %s failed verification (%s): deleted", path, reason)
        self._unlink(key)

    def _os_error(self, what: str, e: OSError, write: bool = False) -> None:
        """Warns once per distinct errno (a full disk would otherwise log every block)."""
        code = e.errno if e.errno is not None else -1
        with self._lock:
            self._stats.num_write_errors += write
            first = code not in self._logged_errnos
            self._logged_errnos.add(code)
        (log.warning if first else log.debug)("disk KV tier: %s failed: %s", what, e)

    def _key(self, identity: CacheIdentity, block_hash: int) -> _Key:
        assert identity.same_except_tenant(self._base), "identity of another model or layout"
        assert 0 <= block_hash < 1 << 64, "block hashes are 64-bit"
        return identity.digest(), block_hash
