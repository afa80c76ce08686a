"""Faults around the host and disk KV tiers: a full disk, an unwritable directory, two servers on
one directory, another model's or tenant's files, a request aborted while its disk read is in
flight, a host tier filled while a staged request waits. Serving never raises, the greedy tokens
always equal transformers' own (`hf_greedy`, fp32 tiny models), and every test asserts where the
reused tokens came from and what the counters say, so a tier that silently served nothing, or
served the wrong bytes, could not pass."""

from __future__ import annotations

import errno
import json
import random
import types

import agentserve.kv.disk_store as disk_store
from agentserve.config import TierConfig
from agentserve.engine.request import FinishReason, RequestStatus
from tests.engine.test_tiers_exact import (
    BS,
    GREEDY,
    KEY,
    NUM_BLOCKS,
    first_turn_on_disk,
    restarted,
    run,
    turn_prompts,
)
from tests.model.hf_tiny import hf_greedy, tiny_engine

FIRST_TURN_BLOCKS = 60 // BS  # the whole first turn's prompt, at least, is written through


def tiers_on(directory, host_bytes: int = 0) -> TierConfig:
    return TierConfig(host_bytes=host_bytes, disk_dir=directory, disk_bytes=1 << 24, key=KEY)


def settle(engine) -> None:
    """Let the I/O worker finish every queued job and apply what it did."""
    assert engine.tiers.worker.drain()
    engine.tiers.poll()


def kv_files(directory):
    return sorted(directory.glob("*/*.kv"))


def tmp_files(directory):
    return sorted(directory.rglob(f"{disk_store.TMP_PREFIX}*"))


def indexed_bytes_match_files(engine, directory) -> None:
    """The store's byte count is that of the files it indexes (a failed write's reservation
    was given back), and each indexed file exists."""
    stats = engine.tiers.disk.stats()
    files = kv_files(directory)
    assert stats.num_files == len(files)
    assert stats.used_bytes == sum(p.stat().st_size for p in files)


_REAL_OS = disk_store.os


class _FullDiskOs(types.ModuleType):
    """The os module as disk_store sees it, on a disk that fills up: every file write gets at
    most 512 bytes through, then ENOSPC (a torn temp file is left for the store to clean)."""

    def __init__(self) -> None:
        super().__init__("os")
        self.num_enospc = 0
        self._written: dict[int, int] = {}

    def __getattr__(self, name):
        return getattr(_REAL_OS, name)

    def write(self, fd, data):
        done = self._written.get(fd, 0)
        if done >= 512:
            self._written.pop(fd, None)
            self.num_enospc += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        n = _REAL_OS.write(fd, memoryview(data)[: 512 - done])
        self._written[fd] = done + n
        return n


# ── 1. disk full ─────────────────────────────────────────────────────────────────────────────
def test_a_full_disk_fails_writes_cleanly_and_the_host_tier_still_serves(tmp_path, monkeypatch):
    directory = tmp_path / "kv"
    engine, hf = tiny_engine("qwen2", block_size=BS, num_blocks=NUM_BLOCKS,
                             tiers=tiers_on(directory, host_bytes=1 << 22))
    disk = engine.tiers.disk
    # Before the disk fills, a conversation is written through (its namespace now exists).
    first_a, _, _ = turn_prompts(20)
    run(engine, first_a)
    settle(engine)
    written_before = engine.tiers.counters.num_disk_written_blocks
    assert written_before >= FIRST_TURN_BLOCKS and disk.stats().num_write_errors == 0
    files_before = kv_files(directory)

    full = _FullDiskOs()
    monkeypatch.setattr(disk_store, "os", full)  # only disk_store's writes see the full disk
    first, new_piece, fillers = turn_prompts(21)
    out, _ = run(engine, first)
    for f in fillers:  # evict the first turn from the pool (its host copy stays)
        run(engine, f)
    settle(engine)
    second = first + out + new_piece
    tokens, last = run(engine, second)
    settle(engine)

    assert tokens == hf_greedy(hf, second, GREEDY.max_tokens)
    assert last.num_host_tokens >= 60 and last.num_disk_tokens == 0
    assert last.num_reused_tokens >= last.num_host_tokens
    c = engine.tiers.counters
    assert full.num_enospc > 0
    assert disk.stats().num_write_errors >= full.num_enospc > 0
    assert c.num_disk_write_failures >= FIRST_TURN_BLOCKS
    assert c.num_disk_written_blocks == written_before  # nothing claimed written
    for h in engine.prompt_hashes_of_tokens(second)[:FIRST_TURN_BLOCKS]:
        assert not disk.contains(engine.tiers.identity, h)
    assert tmp_files(directory) == []  # each torn temp file was removed
    assert kv_files(directory) == files_before
    indexed_bytes_match_files(engine, directory)
    engine.tiers.host.check()

    # The disk has room again: the next write-through succeeds (failed blocks are retried).
    monkeypatch.setattr(disk_store, "os", _REAL_OS)
    third = second + tokens + [7, 8, 9, 10]
    tokens3, _ = run(engine, third)
    settle(engine)
    assert tokens3 == hf_greedy(hf, third, GREEDY.max_tokens)
    assert c.num_disk_written_blocks >= written_before + FIRST_TURN_BLOCKS
    assert disk.contains(engine.tiers.identity, engine.prompt_hashes_of_tokens(second)[0])
    indexed_bytes_match_files(engine, directory)
    engine.tiers.close()


# ── 2. unwritable directory ──────────────────────────────────────────────────────────────────
def test_a_disk_dir_under_a_regular_file_serves_exactly_and_counts_write_errors(tmp_path):
    (tmp_path / "file").write_bytes(b"not a directory")
    directory = tmp_path / "file" / "kv"
    engine, hf = tiny_engine("qwen2", block_size=BS, num_blocks=NUM_BLOCKS, tiers=tiers_on(directory))
    first, new_piece, fillers = turn_prompts(22)
    out, _ = run(engine, first)
    for f in fillers:
        run(engine, f)
    settle(engine)
    second = first + out + new_piece
    tokens, last = run(engine, second)
    settle(engine)
    assert tokens == hf_greedy(hf, second, GREEDY.max_tokens)
    assert last.num_disk_tokens == 0
    stats = engine.tiers.disk.stats()
    assert stats.num_write_errors > 0 and stats.num_writes == 0 and stats.num_files == 0
    assert engine.tiers.counters.num_disk_write_failures >= FIRST_TURN_BLOCKS
    assert engine.tiers.counters.num_disk_written_blocks == 0
    assert (tmp_path / "file").read_bytes() == b"not a directory"
    engine.tiers.close()


# ── 3. two engines on one directory ──────────────────────────────────────────────────────────
def test_two_engines_share_a_directory_and_a_restart_serves_both_from_disk(tmp_path):
    directory = tmp_path / "kv"
    engine_a, hf = tiny_engine("qwen2", block_size=BS, num_blocks=NUM_BLOCKS, tiers=tiers_on(directory))
    engine_b, _ = tiny_engine("qwen2", block_size=BS, num_blocks=NUM_BLOCKS, tiers=tiers_on(directory))
    seconds = []
    for engine, seed in ((engine_a, 23), (engine_b, 24)):
        first, new_piece, _ = turn_prompts(seed)
        out, _ = run(engine, first)
        seconds.append(first + out + new_piece)
    for engine in (engine_a, engine_b):
        settle(engine)
        assert engine.tiers.counters.num_disk_written_blocks >= FIRST_TURN_BLOCKS
        assert engine.tiers.counters.num_disk_write_failures == 0
        engine.tiers.close()
    assert len({p.parent for p in kv_files(directory)}) == 1  # one namespace, both engines'

    engine = restarted(directory.parent)
    assert engine.tiers.disk.stats().num_foreign_namespaces == 0
    for second in seconds:
        tokens, last = run(engine, second)
        assert tokens == hf_greedy(hf, second, GREEDY.max_tokens)
        assert last.num_disk_tokens >= 60 and last.num_reused_tokens == last.num_disk_tokens
    assert engine.tiers.disk.stats().num_verify_failures == 0
    engine.tiers.close()


# ── 4. another model's files ─────────────────────────────────────────────────────────────────
def test_another_models_files_are_neither_served_nor_touched(tmp_path):
    directory = tmp_path / "kv"
    _, second = first_turn_on_disk(tmp_path, seed=25)  # written by the tiny qwen2
    qwen_files = kv_files(directory)
    assert len(qwen_files) >= FIRST_TURN_BLOCKS
    (qwen_ns,) = {p.parent for p in qwen_files}
    contents = {p: p.read_bytes() for p in qwen_files}

    engine, hf_llama = tiny_engine("llama", block_size=BS, num_blocks=NUM_BLOCKS, tiers=tiers_on(directory))
    assert engine.tiers.disk.stats().num_foreign_namespaces == 1
    tokens, last = run(engine, second)  # the same token ids
    settle(engine)
    assert tokens == hf_greedy(hf_llama, second, GREEDY.max_tokens)
    assert last.num_disk_tokens == 0 and last.num_reused_tokens == 0
    stats = engine.tiers.disk.stats()
    assert stats.num_reads == 0 and stats.num_verify_failures == 0 and stats.num_evicted == 0
    assert stats.num_writes >= FIRST_TURN_BLOCKS  # llama wrote its own blocks ...
    assert all(p.parent != qwen_ns for p in kv_files(directory) if p not in contents)  # ... elsewhere
    assert sorted(qwen_ns.glob("*.kv")) == qwen_files
    assert all(p.read_bytes() == b for p, b in contents.items())
    engine.tiers.close()


# ── 5. another tenant's files ────────────────────────────────────────────────────────────────
def test_another_tenants_request_is_not_served_the_unsalted_files(tmp_path):
    hf, second = first_turn_on_disk(tmp_path, seed=26)  # written without a cache salt
    engine = restarted(tmp_path)
    assert engine.prompt_hashes_of_tokens(second, "tenant-b")[0] != engine.prompt_hashes_of_tokens(second)[0]
    expected = hf_greedy(hf, second, GREEDY.max_tokens)

    directory = tmp_path / "kv"
    (unsalted_ns,) = {p.parent for p in kv_files(directory)}
    unsalted_files = sorted(unsalted_ns.glob("*.kv"))

    tokens, last = run(engine, second, "tenant-b")
    settle(engine)
    assert tokens == expected
    assert last.num_disk_tokens == 0 and last.num_reused_tokens == 0
    assert engine.tiers.disk.stats().num_reads == 0
    # Its own blocks went to its own namespace, which names the tenant; the others' are as they were.
    salted_ns = {p.parent for p in kv_files(directory)} - {unsalted_ns}
    assert len(salted_ns) == 1
    (salted_ns,) = salted_ns
    assert json.loads((salted_ns / disk_store.IDENTITY_FILE).read_text())["tenant"] == "tenant-b"
    assert len(list(salted_ns.glob("*.kv"))) >= FIRST_TURN_BLOCKS
    assert sorted(unsalted_ns.glob("*.kv")) == unsalted_files

    tokens, last = run(engine, second, None)
    assert tokens == expected
    assert last.num_disk_tokens >= 60 and last.num_reused_tokens == last.num_disk_tokens
    engine.tiers.close()


# ── 6. aborted while LOADING ─────────────────────────────────────────────────────────────────
def test_a_request_aborted_while_its_disk_read_is_in_flight_leaks_nothing(tmp_path):
    hf, second = first_turn_on_disk(tmp_path, seed=27)
    engine = restarted(tmp_path)
    tiers = engine.tiers
    rid = engine.add(second, GREEDY)
    assert engine.step() == []  # admission queues its disk read: it waits, nothing runs
    request = engine.scheduler.requests[rid]
    assert request.status is RequestStatus.LOADING and request.load_key in tiers.loading
    assert engine.scheduler.pool.num_free_blocks < engine.scheduler.pool.num_blocks  # it holds them
    out = engine.abort(rid)
    assert out is not None and out.finish_reason is FinishReason.ABORT and out.num_generated_tokens == 0
    assert not engine.has_unfinished()
    pool = engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.index  # nothing published unread

    assert tiers.worker.drain()  # the read it asked for ends after it was aborted
    for _ in range(3):
        assert engine.step() == []
        pool.check()
    assert not pool.index  # the stale read was not copied into any block
    assert not tiers.loading and rid not in engine.scheduler.requests
    assert len(tiers.host.index) >= FIRST_TURN_BLOCKS  # kept in host instead

    tokens, last = run(engine, second)
    assert tokens == hf_greedy(hf, second, GREEDY.max_tokens)
    assert last.num_reused_tokens >= 60 and last.num_host_tokens >= 60
    tiers.host.check()
    engine.tiers.close()


# ── 7. host tier at capacity while a load is in flight ───────────────────────────────────────
def test_a_load_lands_in_its_own_blocks_whatever_the_host_tier_holds(tmp_path):
    hf, second = first_turn_on_disk(tmp_path, seed=28)
    engine = restarted(tmp_path, host_bytes=4 * 2048)  # a host tier far smaller than the run
    tiers, host = engine.tiers, engine.tiers.host
    block = tiers.mover.block_nbytes
    rng = random.Random(29)
    rid = engine.add(second, GREEDY)
    assert engine.step() == []
    assert engine.scheduler.requests[rid].status is RequestStatus.LOADING
    for _ in range(50):  # while the read is in flight, other traffic churns the host tier
        host.put(rng.getrandbits(64), bytes(block))
    assert tiers.worker.drain()
    tokens, last = [], None
    while engine.has_unfinished():
        for o in engine.step():
            tokens.extend(o.new_token_ids)
            last = o
        engine.scheduler.pool.check()
        host.check()
    assert tokens == hf_greedy(hf, second, GREEDY.max_tokens)
    assert last.num_disk_tokens >= FIRST_TURN_BLOCKS * BS and last.num_reused_tokens == last.num_disk_tokens
    assert tiers.counters.num_disk_read_misses == 0 and tiers.counters.num_restore_waits == 1
    tiers.close()
