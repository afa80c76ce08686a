"""The cache identity: everything that changes the bits of a block's KV besides its tokens.

Two blocks with equal hashes are interchangeable only under equal identities. A lower tier keeps
blocks past the life of the process, so a file written by another model, another dtype, another
kernel build or for another tenant must never be read as ours: stores namespace their contents by
`digest()` and write the identity into every file's header.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

# Bumped whenever the on-disk layout of a block file changes (kv/disk_store.py).
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    model_id: str  # the model and a digest of its weights (model/loader.py: "name@digest")
    dtype: str  # of the KV pool: "bfloat16", "float32"
    block_size: int  # tokens per block
    layout: str  # the payload's shape, e.g. "block-major[layers=24,kv=2,tokens=16,heads=2,dim=64]"
    kernel_options: str  # anything in the forward that changes KV bits (linear packing, kernels)
    tenant: str | None = None  # the cache salt: tenants never share blocks
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> CacheIdentity:
        return cls(**json.loads(text))

    def digest(self) -> str:
        """32 hex digits naming this identity's namespace in a store."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:32]

    def for_tenant(self, tenant: str | None) -> CacheIdentity:
        return self if tenant == self.tenant else replace(self, tenant=tenant)

    def same_except_tenant(self, other: CacheIdentity) -> bool:
        return replace(self, tenant=None) == replace(other, tenant=None)
