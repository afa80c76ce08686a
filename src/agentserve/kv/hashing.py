"""Chained block hashes: equal hash <=> equal tokens from the start of the sequence to the end
of that block, under the same extra keys (model identity, tenant salt).

hash(block i) = H(hash(block i-1), token ids of block i, extra keys). Only full blocks are
hashed: a partial block can still change, so it is never shared.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

BlockHash = NewType("BlockHash", int)


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What else, besides the tokens, must match for two blocks to be interchangeable.

    model_id keeps two models (or two weight versions) from sharing KV; cache_salt isolates a
    tenant: requests with different salts never hit each other's blocks.
    """

    model_id: str
    cache_salt: str | None = None
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        key = f"{self.model_id}\x00{self.cache_salt or ''}".encode()
        object.__setattr__(self, "digest", hashlib.blake2b(key, digest_size=16).digest())


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: ExtraKeys) -> BlockHash:
    """Hash of one full block chained to its parent (None for the first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" * 8 if parent is None else parent.to_bytes(8, "little"))
    h.update(extra.digest)
    h.update(array("q", token_ids).tobytes())
    return BlockHash(int.from_bytes(h.digest(), "little"))


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra: ExtraKeys
) -> None:
    """Append the hashes of the full blocks of token_ids not yet in `hashes` (in place)."""
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
