"""Why a prompt's first unserved block was not served from cache.

Classified when the attempt is first scheduled (its reuse is then final: device match, host
restore and disk load are done, and nothing it computes is published yet), from what a live
server knows at that moment: the prompt's block hashes and tokens, its trajectory's previous
sequence, the pool's tombstones, and a Bloom filter of every block hash ever computed.

With m the first block not served and `servable` = (P - 1) // block_size (at least one token is
always computed, to sample from):
- m >= servable: `partial_block` — what was not served is under one block (or the last block
  of a prompt that ends on a block boundary).
- the trajectory has a previous sequence and the prompt differs from it at token k inside or
  before block m (k within the old sequence): `diverged` at k.
- block m is past the blocks the previous sequence had cached: `partial_block` when it still
  holds old tokens (the old sequence's tail, never a full cached block: a reply's last token
  has no KV), else `cold` (the new part).
- otherwise block m was computed before unless the filter says never: `evicted` with its
  tombstone's cause and policy, `unknown` once the tombstone is gone (never `cold`: the filter
  has no false negatives); `identity` when block 0 misses and the same tokens were cached under
  another tenant or model; else `cold`.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from agentserve.kv.tombstones import Tombstones
from agentserve.ledger.rows import Miss

BlockHash = int
_MIX = 0x9E3779B97F4A7C15


class SeenFilter:
    """A Bloom filter of block hashes ever computed: `h in f` is True for every added hash, and
    for a few others (false positives make a true `cold` read `evicted: unknown`, never the
    reverse). Block hashes are already uniform 64-bit values, so the k probes are slices of
    the hash itself, mixed once."""

    def __init__(self, bits_log2: int = 24, probes: int = 4) -> None:
        self._mask = (1 << bits_log2) - 1
        self._shift = bits_log2
        self._bits = np.zeros(1 << (bits_log2 - 3), dtype=np.uint8)
        self._k = probes
        self.num_added = 0

    def _probes(self, h: int) -> list[int]:
        x = (h * _MIX) & 0xFFFFFFFFFFFFFFFF  # mix: hashes from tests may be small ints
        a, b = x & self._mask, ((x >> 32) | 1) & self._mask
        return [(a + i * b) & self._mask for i in range(self._k)]

    def add_many(self, hashes: Sequence[int]) -> None:
        """The same probes as _probes, for all hashes at once (uint64 arithmetic wraps like
        the mask above; a + i * b stays below 2**64)."""
        if not hashes:
            return
        x = np.fromiter(hashes, dtype=np.uint64, count=len(hashes)) * np.uint64(_MIX)
        mask = np.uint64(self._mask)
        a, b = x & mask, ((x >> np.uint64(32)) | np.uint64(1)) & mask
        probes = (a[:, None] + np.arange(self._k, dtype=np.uint64) * b[:, None]) & mask
        np.bitwise_or.at(self._bits, (probes >> np.uint64(3)).astype(np.intp),
                         (np.uint8(1) << (probes & np.uint64(7)).astype(np.uint8)))
        self.num_added += len(hashes)

    def __contains__(self, h: int) -> bool:
        bits = self._bits
        return all(bits[p >> 3] & (1 << (p & 7)) for p in self._probes(h))


@dataclass(slots=True)
class PrevSequence:
    """A trajectory's previous sequence (prompt + reply of its latest attempt that ran)."""

    hashes: tuple[BlockHash, ...]  # its full blocks that were cached when it finished
    num_tokens: int
    tokens: array.array | None  # its token ids (None: over the memory budget, or simulated)
    finished_s: float  # engine clock


def divergence(prompt_hashes: Sequence[BlockHash], prompt_tokens: Sequence[int] | None,
               num_prompt: int, prev: PrevSequence, block_size: int) -> tuple[int, bool]:
    """(k, exact): the first token where the prompt and prev differ, min(lengths) when one
    extends the other. Without both token lists, k is the first differing block's start
    (exact False)."""
    n = min(num_prompt, prev.num_tokens)
    if prompt_tokens is not None and prev.tokens is not None:
        old = prev.tokens
        # compare block-sized slices first (C speed), then the first differing one token by token
        for start in range(0, n, block_size):
            end = min(start + block_size, n)
            if list(old[start:end]) != list(prompt_tokens[start:end]):
                for i in range(start, end):
                    if old[i] != prompt_tokens[i]:
                        return i, True
        return n, True
    both = min(len(prompt_hashes), len(prev.hashes))
    same = both
    for i in range(0, both, 64):  # list slices compare at C speed; the first unequal one, by hand
        end = min(i + 64, both)
        if prompt_hashes[i:end] != list(prev.hashes[i:end]):
            same = next(j for j in range(i, end) if prompt_hashes[j] != prev.hashes[j])
            break
    if same < both:
        return min(same * block_size, n), False
    return n, False  # every block both have agrees: no divergence known


@dataclass(slots=True)
class Identities:
    """Which identity (tenant digest, model) first cached a block of these tokens, keyed by the
    tokens of a prompt's first block alone (unsalted): a miss at block 0 whose tokens another
    identity cached is an `identity` miss. Bounded, oldest first out."""

    capacity: int = 65_536
    _items: OrderedDict[int, tuple[str, str]] = field(default_factory=OrderedDict)

    def record(self, first_block: Sequence[int], identity: tuple[str, str]) -> None:
        key = hash(tuple(first_block))
        self._items[key] = identity
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def other(self, first_block: Sequence[int], identity: tuple[str, str]) -> tuple[str, str] | None:
        seen = self._items.get(hash(tuple(first_block)))
        return seen if seen is not None and seen != identity else None


def classify(*, prompt_hashes: Sequence[BlockHash], prompt_tokens: Sequence[int] | None, num_prompt: int,
             num_reused: int, block_size: int, prev: PrevSequence | None, tombstones: Tombstones | None,
             seen: SeenFilter, identities: Identities | None, identity: tuple[str, str],
             wall: Callable[[float], float]) -> tuple[Miss | None, int]:
    """(miss, eligible tokens): eligible = tokens of the prompt in full blocks its trajectory's
    previous sequence had cached (what a cache that kept them would have served)."""
    bs = block_size
    servable = (num_prompt - 1) // bs
    m = num_reused // bs
    eligible = 0
    k, exact = 0, True
    if prev is not None:
        k, exact = divergence(prompt_hashes, prompt_tokens, num_prompt, prev, bs)
        eligible = min(k // bs, len(prev.hashes), servable) * bs
    if m >= servable:
        return Miss("partial_block", m, m * bs), eligible
    if m >= len(prompt_hashes):  # no block hashes: the prefix cache is off
        return Miss("cold", m, m * bs, cause="prefix caching off"), eligible
    if prev is not None:
        if k < prev.num_tokens and k < (m + 1) * bs:
            return Miss("diverged", m, k, exact=exact), eligible
        if m >= len(prev.hashes):  # past what the old sequence had cached
            if m * bs < prev.num_tokens:  # its tail: never a full cached block (the last token's
                return Miss("partial_block", m, m * bs), eligible  # KV is never computed)
            return Miss("cold", m, m * bs), eligible  # the new part
    h = prompt_hashes[m]
    stone = tombstones.get(h) if tombstones is not None else None
    if stone is not None:
        return Miss("evicted", m, m * bs, cause=stone.cause, policy=stone.policy,
                    evicted_s=wall(stone.time_s)), eligible
    if h in seen:
        return Miss("evicted", m, m * bs, cause="unknown"), eligible
    if m == 0 and identities is not None and prompt_tokens is not None:
        other = identities.other(prompt_tokens[:bs], identity)
        if other is not None:
            what = "tenant" if other[1] == identity[1] else "model"
            return Miss("identity", 0, 0, cause=f"{what} differs"), eligible
    return Miss("cold", m, m * bs), eligible
