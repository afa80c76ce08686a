"""Block hashes -> deterministic token ids, so a trace can drive a real model.

Each (namespace, block hash) maps to its own block of token ids drawn from a generator seeded
by a digest of (seed, namespace, hash): equal hashes give equal blocks, different hashes differ
(with overwhelming probability). The last partial block is drawn from the turn's own seed.
`scale` shrinks every block to round(block_size * scale) tokens (at least 1), keeping the
ratios, for models that cannot prefill 100k tokens in reasonable time.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockTokens:
    vocab_size: int
    block_size: int  # tokens per trace block
    scale: float = 1.0
    seed: int = 0
    low: int = 1000  # smallest id used: stays clear of special tokens at the start of a vocab

    def __post_init__(self) -> None:
        if not 0 < self.scale <= 1:
            raise ValueError(f"scale must be in (0, 1], got {self.scale}")
        if self.vocab_size <= self.low + 1:
            raise ValueError(f"vocab_size must exceed {self.low + 1}, got {self.vocab_size}")

    @property
    def tokens_per_block(self) -> int:
        return max(1, round(self.block_size * self.scale))

    def scaled(self, num_tokens: int) -> int:
        """A trace length in scaled tokens (at least 1)."""
        full, rest = divmod(num_tokens, self.block_size)
        return max(1, full * self.tokens_per_block + round(rest * self.scale))

    def _draw(self, *key: object, n: int) -> list[int]:
        digest = hashlib.blake2b(repr((self.seed, *key)).encode(), digest_size=8).digest()
        rng = random.Random(int.from_bytes(digest, "little"))
        return [rng.randrange(self.low, self.vocab_size) for _ in range(n)]

    def block(self, namespace: int, block_hash: int) -> list[int]:
        return self._draw(namespace, block_hash, n=self.tokens_per_block)

    def prompt(self, namespace: int, hashes: Sequence[int], num_tokens: int, tail_key: object) -> list[int]:
        """Token ids of a prompt of num_tokens trace tokens whose full blocks have `hashes`."""
        ids: list[int] = []
        for h in hashes[: num_tokens // self.block_size]:
            ids.extend(self.block(namespace, h))
        want = self.scaled(num_tokens)
        if len(ids) < want:
            ids.extend(self._draw(namespace, "tail", tail_key, n=want - len(ids)))
        return ids[:want]
