"""Cost models: how long one engine step takes, from the shape of its batch.

A step's shape is four integers summed over its chunks (a chunk computes n tokens after s
already-computed ones): tokens (n), attention pairs (n*s + n*(n+1)/2: each new token attends to
its context), context tokens (s + n: KV read and written), and sequences. Integers keep the
arithmetic exact, so a step costs the same whether it is timed alone or in a decode run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Protocol

from agentserve.engine.scheduler import Batch


@dataclass(frozen=True, slots=True)
class StepShape:
    num_seqs: int
    num_tokens: int
    attn_pairs: int
    ctx_tokens: int
    num_decodes: int  # sequences computing exactly one token
    kv_bytes_moved: int = 0  # between tiers (host/disk <-> device), none without a residency policy


def batch_shape(batch: Batch) -> StepShape:
    tokens = pairs = ctx = decodes = 0
    for c in batch.chunks:
        n, s = len(c.token_ids), c.start_position
        tokens += n
        pairs += n * s + n * (n + 1) // 2
        ctx += s + n
        decodes += n == 1
    return StepShape(len(batch.chunks), tokens, pairs, ctx, decodes)


class CostModel(Protocol):
    """step_time_of takes StepShape's fields in order (no object per step in decode runs)."""

    name: str
    kv_bytes_per_token: int
    link_bw: float  # host <-> device, bytes per second
    disk_read_bw: float
    disk_write_bw: float
    disk_latency_s: float

    def step_time_of(self, num_seqs: int, num_tokens: int, attn_pairs: int, ctx_tokens: int,
                     num_decodes: int, kv_bytes_moved: int = 0) -> float: ...
    def decode_run_time(self, num_seqs: int, ctx0: int, num_steps: int) -> float:
        """Total time of num_steps pure decode steps of num_seqs sequences; the first step's
        context (sum of s + 1 over the sequences) is ctx0 and grows by num_seqs a step."""
        ...

    def params(self) -> dict[str, object]: ...


def _series(x: float, y: float, p: int, q: int) -> float:
    """sum of x + y*j for j in [p, q)."""
    n = q - p
    return x * n + y * n * (p + q - 1) / 2 if n > 0 else 0.0


def sum_max_linear(a: float, b: float, c: float, d: float, m: int) -> float:
    """sum over j in [0, m) of max(a + b*j, c + d*j), in closed form."""
    g0, slope = a - c, b - d  # (a + b j) - (c + d j) = g0 + slope * j
    if slope == 0:
        split = 0 if g0 >= 0 else m  # first j where the first line is the max
        return _series(c, d, 0, split) + _series(a, b, split, m)
    root = -g0 / slope
    if slope > 0:  # first line is the max from ceil(root) on
        split = min(max(math.ceil(root), 0), m)
        return _series(c, d, 0, split) + _series(a, b, split, m)
    split = min(max(math.floor(root) + 1, 0), m)  # first line is the max up to floor(root)
    return _series(a, b, 0, split) + _series(c, d, split, m)


def step_time(model: CostModel, shape: StepShape) -> float:
    return model.step_time_of(shape.num_seqs, shape.num_tokens, shape.attn_pairs, shape.ctx_tokens,
                              shape.num_decodes, shape.kv_bytes_moved)


@dataclass(frozen=True, slots=True)
class Roofline:
    """max(compute time, memory time) + a fixed step overhead + tier transfer time.

    compute = (2 * params * tokens + 4 * layers * q_dim * attn_pairs) / (peak_flops * mfu)
    memory  = (weight_bytes + kv_bytes_per_token * ctx_tokens) / (mem_bw * mbu)
    """

    name: str
    params_b: float  # active parameters, billions
    num_layers: int
    q_dim: int  # attention heads * head dim
    kv_bytes_per_token: int  # all layers, K and V
    weight_bytes: float
    peak_flops: float  # dense bf16, per second
    mem_bw: float  # bytes per second
    hbm_bytes: float  # device memory (for the default KV capacity)
    mfu: float = 0.5  # achieved fraction of peak_flops
    mbu: float = 0.7  # achieved fraction of mem_bw
    step_overhead_s: float = 0.003  # scheduling, launch, sampling
    link_bw: float = 25e9  # host <-> device bytes per second, for tier moves (PCIe Gen5 x16, achieved)
    # The disk tier: a host's local NVMe (an H200 node's RAID of Gen4 drives, achieved figures).
    disk_read_bw: float = 10e9
    disk_write_bw: float = 5e9
    disk_latency_s: float = 1e-4

    def step_time_of(self, num_seqs: int, num_tokens: int, attn_pairs: int, ctx_tokens: int,
                     num_decodes: int, kv_bytes_moved: int = 0) -> float:
        flops = 2e9 * self.params_b * num_tokens + 4.0 * self.num_layers * self.q_dim * attn_pairs
        mem = self.weight_bytes + self.kv_bytes_per_token * ctx_tokens
        busy = max(flops / (self.peak_flops * self.mfu), mem / (self.mem_bw * self.mbu))
        return self.step_overhead_s + busy + kv_bytes_moved / self.link_bw

    def decode_run_time(self, num_seqs: int, ctx0: int, num_steps: int) -> float:
        cf = self.peak_flops * self.mfu
        cm = self.mem_bw * self.mbu
        attn = 4.0 * self.num_layers * self.q_dim
        a = (2e9 * self.params_b * num_seqs + attn * ctx0) / cf
        b = attn * num_seqs / cf
        c = (self.weight_bytes + self.kv_bytes_per_token * ctx0) / cm
        d = self.kv_bytes_per_token * num_seqs / cm
        return self.step_overhead_s * num_steps + sum_max_linear(a, b, c, d, num_steps)

    def capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """KV tokens that fit beside the weights in memory_fraction of device memory."""
        return int((self.hbm_bytes * memory_fraction - self.weight_bytes) // self.kv_bytes_per_token)

    def params(self) -> dict[str, object]:
        return dict(asdict(self), kind="roofline", default_capacity_tokens=self.capacity_tokens())


@dataclass(frozen=True, slots=True)
class Linear:
    """t = overhead + per_prefill_token * prefill tokens + per_decode_token * decodes
    + per_attn_pair * attention pairs: a fit to measured step times (CPU engine)."""

    name: str
    step_overhead_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_attn_pair_s: float
    source: str = ""
    # Tier moves as this project's code achieves them on this machine (`agentserve bench
    # kv-copy`, docs/benchmarks.md): the batched gather / scatter between pool and host, and the
    # disk tier's sealed one-file-per-block path (the device itself gives 1.3-2.0 GB/s).
    # KV of Qwen2.5-Coder-0.5B bf16.
    kv_bytes_per_token: int = 12_288
    link_bw: float = 2.7e9
    disk_read_bw: float = 0.32e9
    disk_write_bw: float = 0.22e9
    disk_latency_s: float = 2e-4

    def step_time_of(self, num_seqs: int, num_tokens: int, attn_pairs: int, ctx_tokens: int,
                     num_decodes: int, kv_bytes_moved: int = 0) -> float:
        return (self.step_overhead_s + self.per_prefill_token_s * (num_tokens - num_decodes)
                + self.per_decode_token_s * num_decodes + self.per_attn_pair_s * attn_pairs
                + kv_bytes_moved / self.link_bw)

    def decode_run_time(self, num_seqs: int, ctx0: int, num_steps: int) -> float:
        x = self.step_overhead_s + self.per_decode_token_s * num_seqs + self.per_attn_pair_s * ctx0
        return _series(x, self.per_attn_pair_s * num_seqs, 0, num_steps)

    def params(self) -> dict[str, object]:
        return dict(asdict(self), kind="linear")
