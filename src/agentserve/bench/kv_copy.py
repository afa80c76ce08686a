"""`agentserve bench kv-copy`: what moving KV between the pool and the lower tiers achieves,
against a plain memcpy of the same bytes.

For a model's real pool layout (per-layer K and V, [slots, kv_heads, head_dim]) and n blocks
scattered over the pool: `read_blocks` (the batched gather into a block-major staging buffer,
then one bytes object per block) and `write_blocks` (the batched scatter back), each timed
against `dst.copy_(src)` of a contiguous buffer of the same size; then the disk tier's own path
for the same payloads (sealed with HMAC-SHA256, optionally AES-GCM, written to a temporary name
and renamed; read back and verified), with the page cache dropped after each write so that the
reads come from the device. Best of `repeats` per figure: the machine is shared.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CopyRow:
    what: str
    nbytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(model: str, dtype: str, num_blocks: int, pool_blocks: int, repeats: int, encrypt: bool,
            seed: int = 0) -> list[CopyRow]:
    import torch

    from agentserve.kv.disk_store import DiskStore
    from agentserve.kv.identity import CacheIdentity
    from agentserve.kv.sealing import derive_keys
    from agentserve.model.build import resolve_dtype
    from agentserve.model.loader import load_model_config, resolve_model_dir
    from agentserve.model.transformer import PagedKV

    config = load_model_config(resolve_model_dir(model, Path.home() / ".cache" / "agentserve"))
    kv = PagedKV(config, pool_blocks, 16, resolve_dtype(dtype), torch.device("cpu"))
    for t in (*kv.k, *kv.v):
        t.normal_()
    ids = random.Random(seed).sample(range(pool_blocks), num_blocks)
    nbytes = num_blocks * kv.block_nbytes
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.random_(0, 255)
    memcpy = _best(lambda: dst.copy_(src), repeats)
    payloads = kv.read_blocks(ids)
    rows = [CopyRow("memcpy (torch copy_ of one contiguous buffer)", nbytes, memcpy),
            CopyRow("pool -> host: read_blocks (gather + bytes per block)", nbytes,
                    _best(lambda: kv.read_blocks(ids), repeats)),
            CopyRow("host -> pool: write_blocks (join + scatter)", nbytes,
                    _best(lambda: kv.write_blocks(ids, payloads), repeats))]
    ident = CacheIdentity(config.name, dtype, 16, kv.layout(), "bench")
    with tempfile.TemporaryDirectory(prefix="agentserve-kv-copy-") as d:
        store = DiskStore(Path(d), 4 * nbytes + (1 << 20), ident, derive_keys(bytes(32), encrypt), page_cache=False)
        base = iter(range(10**9))

        def write() -> None:
            k = next(base) * num_blocks
            for i, p in enumerate(payloads):
                assert store.put(ident, k + i, p)
            for i in range(num_blocks):
                store.delete(ident, k + i)

        rows.append(CopyRow(f"host -> disk: seal{' + AES-GCM' if encrypt else ''} + write + rename + sync",
                            nbytes, _best(write, max(3, repeats // 4))))
        for i, p in enumerate(payloads):
            store.put(ident, i, p)

        def read() -> None:
            for i in range(num_blocks):
                assert store.get(ident, i) is not None

        rows.append(CopyRow("disk -> host: read + verify (page cache dropped)", nbytes,
                            _best(read, max(3, repeats // 4))))
    return rows


def run(args) -> int:  # type: ignore[no-untyped-def]
    rows = measure(args.model, args.dtype, args.blocks, args.pool_blocks, args.repeats, args.encrypt)
    memcpy = rows[0].seconds
    print(f"{args.model} {args.dtype}: {args.blocks} blocks of 16 tokens scattered over a pool of "
          f"{args.pool_blocks} ({rows[0].nbytes / 2**20:.1f} MiB)\n")
    print("| path | ms | GB/s | vs memcpy |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r.what} | {r.seconds * 1e3:.2f} | {r.gb_per_s:.2f} | {memcpy / r.seconds:.2f}x |")
    return 0


def add_args(p) -> None:  # type: ignore[no-untyped-def]
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--blocks", type=int, default=64, help="blocks moved (64 = 1,024 tokens)")
    p.add_argument("--pool-blocks", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--encrypt", action="store_true")
