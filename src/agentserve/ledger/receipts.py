"""Cache receipts: what a request's reused prefix was, asked for per request (`cache_receipt`).

Distinct from the residency policy's decision receipts (trajectory/receipts.py): this one
describes the cache objects that served the prompt, one per tier segment of its reused prefix
(device, then host, then disk):

- object_id: names the segment's last block, keyed per tenant (opaque; equal for equal objects
  of one tenant on this server),
- prefix_digest: HMAC-SHA256 over the chained hash of the whole reused prefix, with a key
  derived per tenant, so a digest never confirms a guess of another tenant's prompt,
- tokens: the prefix length up to the segment's end; identity_digest: model + tokenizer +
  chat template + runtime; tier; created / last access (wall clock) and generation (how many
  times the segment's last block was computed) from a bounded record of block lives.

The server key is random per process unless one is given (the KV tiers' key, so digests match
across restarts on the same store).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BlockHash = int


@dataclass(slots=True)
class BlockLife:
    created_s: float  # engine clock: when it was last computed
    last_access_s: float  # ... or last served to a prompt
    generation: int  # times computed while recorded here


class BlockLives:
    """Bounded: the least recently touched block's record goes first."""

    def __init__(self, capacity: int = 262_144) -> None:
        self.capacity = capacity
        self._items: OrderedDict[BlockHash, BlockLife] = OrderedDict()

    def computed(self, hashes: Sequence[BlockHash], now: float) -> None:
        items = self._items
        for h in hashes:
            life = items.get(h)
            if life is None:
                items[h] = BlockLife(now, now, 1)
            else:
                life.created_s = life.last_access_s = now
                life.generation += 1
                items.move_to_end(h)
        while len(items) > self.capacity:
            items.popitem(last=False)

    def served(self, h: BlockHash, now: float) -> BlockLife | None:
        """Its record as it was before this access (then touched)."""
        life = self._items.get(h)
        if life is None:
            return None
        before = BlockLife(life.created_s, life.last_access_s, life.generation)
        life.last_access_s = now
        self._items.move_to_end(h)
        return before


class ReceiptKeys:
    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else os.urandom(32)
        self._tenants: dict[str, bytes] = {}

    def tenant_key(self, tenant: str) -> bytes:
        key = self._tenants.get(tenant)
        if key is None:
            if len(self._tenants) > 65_536:
                self._tenants.clear()
            key = self._tenants[tenant] = hmac.new(self._secret, b"cache-receipt\x00" + tenant.encode(),
                                                   hashlib.sha256).digest()
        return key


def identity_digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]


def build_receipt(segments: Sequence[tuple[str, int, BlockHash, BlockLife | None]], block_size: int,
                  tenant: str, keys: ReceiptKeys, identity: str, wall: Callable[[float], float]
                  ) -> dict[str, object]:
    """segments: (tier, prefix blocks up to its end, its last block's hash, that block's life
    before this access), device first."""
    key = keys.tenant_key(tenant)
    objects = []
    for tier, end, last, life in segments:
        raw = last.to_bytes(8, "little")
        objects.append({
            "object_id": hmac.new(key, b"object\x00" + raw, hashlib.sha256).hexdigest()[:24],
            "prefix_digest": hmac.new(key, b"prefix\x00" + raw, hashlib.sha256).hexdigest(),
            "tokens": end * block_size, "tier": tier, "identity_digest": identity,
            "created_s": None if life is None else round(wall(life.created_s), 3),
            "last_access_s": None if life is None else round(wall(life.last_access_s), 3),
            "generation": None if life is None else life.generation,
        })
    reused = segments[-1][1] * block_size if segments else 0
    return {"reused_tokens": reused, "identity_digest": identity, "objects": objects}
