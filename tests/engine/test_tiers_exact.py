"""Greedy tokens of a trajectory's next turn equal transformers' own greedy continuation when its
prefix comes back from the host tier, from disk, partly from each, or is recomputed; fp32 on
the tiny random models. Every test also asserts where the reused tokens came from, so a tier
that silently served nothing could not pass."""

from __future__ import annotations

import random

import pytest

from agentserve.config import TierConfig
from agentserve.engine.request import SamplingParams
from tests.model.hf_tiny import hf_greedy, tiny_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
BS = 4
NUM_BLOCKS = 40  # 160 tokens: two fillers of 60 push a finished 68-token sequence out


def turn_prompts(seed: int) -> tuple[list[int], list[int], list[list[int]]]:
    """A first turn, the new piece of its next turn, and fillers that evict it from the pool."""
    rng = random.Random(seed)
    first = [rng.randrange(2, 256) for _ in range(60)]
    new_piece = [rng.randrange(2, 256) for _ in range(10)]
    fillers = [[rng.randrange(2, 256) for _ in range(60)] for _ in range(3)]
    return first, new_piece, fillers


def run(engine, prompt, cache_salt=None):
    rid = engine.add(prompt, GREEDY, cache_salt=cache_salt)
    tokens, last = [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                tokens.extend(o.new_token_ids)
                last = o
        engine.scheduler.pool.check()
    return tokens, last


def next_turn(engine, hf, seed: int, num_fillers: int):
    """Run the first turn, the fillers, then the next turn; check the next turn against HF."""
    first, new_piece, fillers = turn_prompts(seed)
    out, _ = run(engine, first)
    for f in fillers[:num_fillers]:
        run(engine, f)
    second = first + out + new_piece
    tokens, last = run(engine, second)
    assert tokens == hf_greedy(hf, second, GREEDY.max_tokens)
    return last


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_next_turn_restored_from_host_matches_hf(arch):
    engine, hf = tiny_engine(arch, block_size=BS, num_blocks=NUM_BLOCKS,
                             tiers=TierConfig(host_bytes=1 << 22))
    last = next_turn(engine, hf, seed=1, num_fillers=3)
    assert last.num_host_tokens >= 60  # the whole first turn came back from host
    assert last.num_reused_tokens >= last.num_host_tokens
    assert engine.tiers.counters.num_restored_blocks >= 60 // BS
    engine.tiers.host.check()


def test_partly_from_the_pool_and_partly_from_host_matches_hf():
    engine, hf = tiny_engine("qwen2", block_size=BS, num_blocks=NUM_BLOCKS,
                             tiers=TierConfig(host_bytes=1 << 22))
    last = next_turn(engine, hf, seed=2, num_fillers=2)  # the second filler evicts its tail
    assert 0 < last.num_host_tokens < last.num_reused_tokens


def test_without_tiers_the_same_turn_is_recomputed_and_matches_hf():
    engine, hf = tiny_engine("qwen2", block_size=BS, num_blocks=NUM_BLOCKS)
    last = next_turn(engine, hf, seed=1, num_fillers=3)
    assert last.num_host_tokens == 0 and last.num_reused_tokens == 0


def test_a_full_host_tier_keeps_the_newest_blocks_and_stays_exact():
    engine, hf = tiny_engine("qwen2", block_size=BS, num_blocks=NUM_BLOCKS,
                             tiers=TierConfig(host_bytes=6 * 4096))
    block = engine.tiers.mover.block_nbytes
    assert engine.tiers.host.index.capacity_bytes // block < 60 // BS  # it cannot hold a turn
    next_turn(engine, hf, seed=3, num_fillers=3)
    engine.tiers.host.check()
    assert engine.tiers.host.index.used_bytes <= 6 * 4096


KEY = bytes(range(32))


def disk_tiers(tmp_path, host_bytes: int = 0) -> TierConfig:
    return TierConfig(host_bytes=host_bytes, disk_dir=tmp_path / "kv", disk_bytes=1 << 24, key=KEY)


def first_turn_on_disk(tmp_path, seed: int):
    """A server that ran the first turn and wrote it through to disk, then went away."""
    engine, hf = tiny_engine("qwen2", block_size=BS, num_blocks=NUM_BLOCKS, tiers=disk_tiers(tmp_path))
    first, new_piece, _ = turn_prompts(seed)
    out, _ = run(engine, first)
    assert engine.tiers.worker.drain()
    engine.tiers.poll()
    assert engine.tiers.counters.num_disk_written_blocks >= 60 // BS
    engine.tiers.close()
    return hf, first + out + new_piece


def restarted(tmp_path, host_bytes: int = 0):
    engine, _ = tiny_engine("qwen2", block_size=BS, num_blocks=NUM_BLOCKS,
                            tiers=disk_tiers(tmp_path, host_bytes))
    return engine


def test_next_turn_after_a_restart_is_read_from_disk_and_matches_hf(tmp_path):
    hf, second = first_turn_on_disk(tmp_path, seed=4)
    engine = restarted(tmp_path)
    tokens, last = run(engine, second)
    assert tokens == hf_greedy(hf, second, GREEDY.max_tokens)
    assert last.num_disk_tokens >= 60 and last.num_reused_tokens == last.num_disk_tokens
    engine.tiers.close()


def test_partly_from_host_and_partly_from_disk_matches_hf(tmp_path):
    hf, second = first_turn_on_disk(tmp_path, seed=5)
    engine = restarted(tmp_path, host_bytes=1 << 22)
    hashes = engine.prompt_hashes_of_tokens(second)
    for h in hashes[:6]:  # the head is in host (as if its host copy outlived the pool's)
        engine.tiers.host.put(h, engine.tiers.disk.get(engine.tiers.identity, h))
    tokens, last = run(engine, second)
    assert tokens == hf_greedy(hf, second, GREEDY.max_tokens)
    assert last.num_host_tokens == 6 * BS and last.num_disk_tokens >= 60 - 6 * BS
    engine.tiers.close()


def test_a_corrupt_file_mid_prefix_is_recomputed_from_there_and_matches_hf(tmp_path):
    hf, second = first_turn_on_disk(tmp_path, seed=6)
    engine = restarted(tmp_path)
    hashes = engine.prompt_hashes_of_tokens(second)
    (path,) = (tmp_path / "kv").glob(f"*/{hashes[5]:016x}.kv")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    tokens, last = run(engine, second)
    assert tokens == hf_greedy(hf, second, GREEDY.max_tokens)
    assert last.num_disk_tokens == 5 * BS  # the five blocks before it; the rest recomputed
    assert engine.tiers.disk.stats().num_verify_failures == 1
    assert engine.tiers.worker.drain()  # the recomputed block was written through again, whole
    assert engine.tiers.disk.get(engine.tiers.identity, hashes[5]) is not None
    engine.tiers.close()
