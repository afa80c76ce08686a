"""Qwen2 / Qwen3 / Llama decoder forward over a paged KV pool.

The three architectures differ only in q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3),
so one module serves all; parameter names are Hugging Face's so HF checkpoints load as they are.
The forward takes a flat batch: the tokens of every scheduled chunk concatenated, their
positions, the KV slot each token writes, and per chunk the slots of its whole context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentserve.model.config import ModelConfig
from agentserve.model.cpu_kernels import CpuKernels, pack_pairs

# torch's CPU flash attention with its log-sum-exp (F.scaled_dot_product_attention returns only
# the output): the split prefill path merges two calls by it. None where a build lacks it.
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# Chunks over a cached prefix from this many rows take the split path (bf16 on an Intel Xeon
# with AMX: equal to the masked call at 32-64 rows, 1.2x faster at 128, 1.3x at 2,048).
SPLIT_MIN_ROWS = 64


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """One chunk of the flat batch: rows [row_start, row_start + num_rows) of the input,
    attending to context slots `context_slots` (its first start_position + num_rows tokens)."""

    row_start: int
    num_rows: int
    start_position: int
    context_slots: torch.Tensor  # [context_len] int64 slot ids into the KV pool


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """All one-token chunks of a step, attended in one padded call per layer.

    rows: [B] their rows in the flat batch, ascending (so B rows of a B-row batch are 0..B-1);
    slots: [B, max_context] context slots, padded; lengths: [B] context lengths; visible:
    [B, 1, 1, max_context] True where a slot is real (None when no row is padded)."""

    rows: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    visible: torch.Tensor | None


class PagedKV:
    """K and V of every layer: [num_slots, num_kv_heads, head_dim], slot = block * size + offset."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device

    # ── whole blocks in and out, for the lower tiers (engine/tiers.py) ────────────────────
    @property
    def block_nbytes(self) -> int:
        k = self.k[0]
        return 2 * len(self.k) * self.block_size * k.shape[1] * k.shape[2] * k.element_size()

    def layout(self) -> str:
        k = self.k[0]
        return (f"block-major[layers={len(self.k)},kv=2,tokens={self.block_size},"
                f"heads={k.shape[1]},dim={k.shape[2]}]")

    @torch.inference_mode()
    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Each block's K and V of every layer as one payload, block-major
        [layers, 2, block_size, heads, head_dim], gathered in 2 x layers batched copies."""
        if not block_ids:
            return []
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        n = len(block_ids)
        # staging: [n, layers, 2, block_size * heads * head_dim]
        staging = torch.empty((n, len(self.k), 2, self.block_size * self.k[0][0].numel()),
                              dtype=self.k[0].dtype, device=self.device)
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            staging[:, layer, 0] = k.view(self.num_blocks, -1).index_select(0, idx)
            staging[:, layer, 1] = v.view(self.num_blocks, -1).index_select(0, idx)
        raw = staging.view(n, -1).view(torch.uint8).cpu().numpy()
        return [raw[i].tobytes() for i in range(n)]

    @torch.inference_mode()
    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        """Copy payloads (read_blocks' layout) into these blocks, batched the same way."""
        if not block_ids:
            return
        assert len(block_ids) == len(payloads) and all(len(p) == self.block_nbytes for p in payloads)
        n = len(block_ids)
        buf = bytearray().join(payloads)  # one copy, writable for frombuffer
        staged = torch.frombuffer(buf, dtype=torch.uint8).view(self.k[0].dtype)
        staged = staged.view(n, len(self.k), 2, -1).to(self.device)
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k.view(self.num_blocks, -1).index_copy_(0, idx, staged[:, layer, 0])
            v.view(self.num_blocks, -1).index_copy_(0, idx, staged[:, layer, 1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in fp32 and cast back, as the reference implementations do.
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [num_tokens, head_dim] for rotate-half RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Linear:
    """y = x W^T + b. On CPU in bf16 the weight is pre-packed for oneDNN once (2-3x faster for
    the few-row matmuls of decode, bit-identical results); elsewhere it is plain F.linear.
    With `small` (the C++ few-row kernel, csrc/small_linear.cpp) the row-major weight is kept
    as well, and matmuls of 1 to `small_rows` rows go to it: they are bound by memory
    bandwidth, which it uses better than oneDNN does (~1.1-2x here at 1-8 rows). The price is
    a second copy of the weights in RAM (~1 GB for Qwen2.5-0.5B); `--no-cpu-kernels` drops it.

    Widened (bf16 weights computed in fp32, model/precision.py): an fp32 copy serves matmuls of
    many rows (MKL's sgemm), and with `small` the bf16 weight stays for those of 1 to
    `small_rows` rows, which csrc/widened_linear.cpp widens in registers (half the bytes)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool,
                 small: CpuKernels | None = None, compute: torch.dtype | None = None) -> None:
        self.weight, self.bias, self.packed = weight, bias, None
        self.full: torch.Tensor | None = None  # widened: the fp32 copy for many rows
        self.widened = (compute == torch.float32 and weight.dtype == torch.bfloat16
                        and weight.device.type == "cpu")
        if self.widened:
            self.full = weight.float()
            self.bias = None if bias is None else bias.float()
            self.small = small if small is not None and small.widened_rows(weight.shape[1]) > 0 else None
            self.small_rows = self.small.widened_rows(weight.shape[1]) if self.small is not None else 0
            # the kernel's own layout of the bf16 weight (rows in interleaved pairs), or none
            self.weight = None if self.small is None else pack_pairs(weight)
            return
        bf16_cpu = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        self.small = small if bf16_cpu else None
        self.small_rows = self.small.small_linear_rows(weight.shape[1]) if self.small is not None else 0
        if pack and bf16_cpu:
            self.packed = _try_pack(weight, bias)
            if self.packed is not None and self.small_rows == 0:
                self.weight = None  # the packed copy replaces it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.widened:
            if self.small is not None and 0 < x.shape[0] <= self.small_rows:
                return self.small.widened_linear(x, self.weight, self.full.shape[0], self.bias)
            return F.linear(x, self.full, self.bias)
        if self.small is not None and 0 < x.shape[0] <= self.small_rows:
            return self.small.small_linear(x, self.weight, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _try_pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The packed weight, if this build supports it and it reproduces F.linear exactly."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        probe = torch.randn(3, weight.shape[1], dtype=weight.dtype, generator=torch.Generator().manual_seed(0))
        same = torch.equal(torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], ""),
                           F.linear(probe, weight, bias))
    except (RuntimeError, AttributeError):
        return None
    return packed if same else None


@dataclass(slots=True)
class Layer:
    qkv: Linear  # q, k and v projections fused: one matmul
    o: Linear
    gate_up: Linear  # gate and up projections fused
    down: Linear
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class Transformer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], pack: bool = True,
                 kernels: CpuKernels | None = None, compute_dtype: torch.dtype | None = None) -> None:
        """compute_dtype: the activations' dtype, when not the weights' (fp32 over bf16
        weights and KV on CPUs without a bf16 dot product: model/precision.py)."""
        self.config = config
        self.kernels = kernels  # C++ decode attention on CPU, where it could be built
        self.embed = weights["model.embed_tokens.weight"]
        self.compute_dtype = compute_dtype or self.embed.dtype
        self.widened = self.compute_dtype != self.embed.dtype  # storage stays, arithmetic widens
        c = self.compute_dtype
        self.lm_head = Linear(weights.get("lm_head.weight", self.embed), None, pack, kernels, c)
        self.norm = self._compute(weights["model.norm.weight"])
        self.layers = [self._layer(weights, i, pack, kernels, c) for i in range(config.num_layers)]
        self.scale = config.head_dim ** -0.5
        # bf16 on CPU, and fp32 over bf16 weights and KV: residual add + RMSNorm, RoPE + KV write
        # and SiLU * up as one C++ call each (csrc/norm_rope.cpp, the same roundings); a plain
        # attribute so a bench can compare. An fp32 model keeps torch's ops: the exactness tests
        # compare it with transformers' fp32 forward, sums in the same order.
        self.fused_norm_rope = (kernels is not None and self.embed.device.type == "cpu"
                                and (self.compute_dtype == torch.bfloat16 or self.widened))
        # bf16 prefill attention on the C++ kernel; build_runner sets it from a side-by-side
        # measurement at start-up (model/attention_bench.prefill_kernel_wins). fp32 always uses it.
        self.bf16_prefill_kernel = True

    def _compute(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A small parameter (a norm's weight) in the compute dtype."""
        return t if t is None else t.to(self.compute_dtype)

    def _layer(self, w: dict[str, torch.Tensor], i: int, pack: bool, small: CpuKernels | None,
               c: torch.dtype) -> Layer:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv_w = torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])
        qkv_b = None
        if a + "q_proj.bias" in w:
            qkv_b = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
        return Layer(
            qkv=Linear(qkv_w, qkv_b, pack, small, c), o=Linear(w[a + "o_proj.weight"], None, pack, small, c),
            gate_up=Linear(torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]), None, pack, small, c),
            down=Linear(w[m + "down_proj.weight"], None, pack, small, c),
            input_norm=self._compute(w[p + "input_layernorm.weight"]),
            post_norm=self._compute(w[p + "post_attention_layernorm.weight"]),
            q_norm=self._compute(w.get(a + "q_norm.weight")), k_norm=self._compute(w.get(a + "k_norm.weight")))

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                chunks: list[ChunkLayout], kv: PagedKV, logit_rows: torch.Tensor,
                decode: DecodeGroup | None = None) -> torch.Tensor:
        """token_ids, positions, write_slots: [num_tokens]; chunks and decode cover every row
        once; returns fp32 logits for the rows in logit_rows: [len(logit_rows), vocab]."""
        cfg = self.config
        h = self.embed[token_ids].to(self.compute_dtype)  # [num_tokens, hidden]
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, h.dtype)
        in_place = self.prefill_reads_in_place(h.dtype, h.device)
        # the masked SDPA path's additive masks, built once and used by every layer; the kernel
        # and the split path need none
        masks = [None if in_place or self._splits(c, h.device) else self._chunk_mask(c, h.dtype) for c in chunks]
        x = self._norm(h, self.layers[0].input_norm)
        for i, layer in enumerate(self.layers):
            h, x = self._add_norm(h, self._attention(x, layer, cos, sin, write_slots, chunks, masks, decode,
                                                     kv.k[i], kv.v[i]), layer.post_norm)
            mlp = layer.down(self._silu_mul(layer.gate_up(x)))
            if i + 1 < len(self.layers):
                h, x = self._add_norm(h, mlp, self.layers[i + 1].input_norm)
            else:
                h = h + mlp
        last = self._norm(h[logit_rows], self.norm)
        return self.lm_head(last).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused_norm_rope:
            return self.kernels.rms_norm(x, weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_norm_rope:
            return self.kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _add_norm(self, h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + d, rms_norm(h + d)); the kernel adds into h in place (the forward owns h)."""
        if self.fused_norm_rope:
            return h, self.kernels.add_rms_norm(h, d, weight, self.config.rms_norm_eps)
        h = h + d
        return h, rms_norm(h, weight, self.config.rms_norm_eps)

    def _attention(self, x: torch.Tensor, layer: Layer, cos: torch.Tensor,
                   sin: torch.Tensor, write_slots: torch.Tensor, chunks: list[ChunkLayout],
                   masks: list[torch.Tensor | None], decode: DecodeGroup | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor
                   ) -> torch.Tensor:
        cfg = self.config
        n = x.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = layer.qkv(x)
        v = qkv[:, q_size + kv_size :].view(n, cfg.num_kv_heads, cfg.head_dim)
        fused = self.fused_norm_rope and layer.q_norm is None  # rotated in place, K/V written to the pool
        if fused:
            self.kernels.rope_store(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads, write_slots, k_cache, v_cache)
            q = qkv[:, :q_size].view(n, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(n, cfg.num_kv_heads, cfg.head_dim)
        elif layer.q_norm is not None and layer.k_norm is not None:
            q = rms_norm(qkv[:, :q_size].view(n, cfg.num_heads, cfg.head_dim), layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(qkv[:, q_size : q_size + kv_size].view(n, cfg.num_kv_heads, cfg.head_dim),
                         layer.k_norm, cfg.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # q and k rotated in one pass: half the small ops of a decode step's RoPE
            qk = apply_rope(qkv[:, : q_size + kv_size].view(n, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        if not fused:
            if self.widened:  # stored in the cache's dtype; this chunk reads them back as stored
                k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
            k_cache.index_copy_(0, write_slots, k)
            v_cache.index_copy_(0, write_slots, v)
            if self.widened:
                k, v = k.to(self.compute_dtype), v.to(self.compute_dtype)
        if decode is not None and decode.rows.shape[0] == n:  # a decode-only step: rows 0..n-1 in order
            return layer.o(self._decode_attention(q, decode, k_cache, v_cache).reshape(n, -1))
        out = torch.empty_like(q)  # [num_tokens, heads, head_dim]
        in_place = self.prefill_reads_in_place(q.dtype, q.device)
        for c, mask in zip(chunks, masks):
            rows = slice(c.row_start, c.row_start + c.num_rows)
            if in_place:  # K/V of this chunk were written above: the kernel reads all from the pool
                out[rows] = self.kernels.prefill_attention(q[rows], k_cache, v_cache, c.context_slots,
                                                           c.start_position, self.scale)
            elif c.start_position == 0:  # the context is this chunk alone: no need to gather it
                out[rows] = self._sdpa(q[rows], k[rows], v[rows], None, causal=True)
            elif mask is None:
                out[rows] = self._split_attention(q[rows], c, k_cache, v_cache)
            else:
                out[rows] = self._chunk_attention(q[rows], c, mask, k_cache, v_cache)
        if decode is not None:
            out[decode.rows] = self._decode_attention(q[decode.rows], decode, k_cache, v_cache)
        return layer.o(out.view(n, -1))

    def uses_small_linear(self) -> bool:
        """Whether few-row matmuls go to a C++ kernel (bf16 on CPU with AVX512-BF16; widened bf16
        weights on CPUs with AVX2)."""
        return self.lm_head.small_rows > 0

    def linears(self) -> list[Linear]:
        return [self.lm_head] + [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def decode_reads_in_place(self, device: torch.device) -> bool:
        """Whether decode attention reads K/V from the pool in place (the C++ kernel), so a row
        costs its own context and nothing more; the SDPA path gathers every row's context."""
        return (self.kernels is not None and device.type == "cpu"
                and self.kernels.supports(self.config.head_dim))

    def prefill_reads_in_place(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether prefill chunks use the C++ kernel (csrc/prefill_attention.cpp): causal over
        the context read from the pool in place, 2.6-4.2x torch's SDPA in bf16 on the AMD EPYC it
        was written on, from 8-row chunks over 1.7k keys to 2k-row chunks over 16k (where
        torch's path is faster, as with AMX, bf16 stays on it); fp32 for exact tests."""
        return (self.kernels is not None and device.type == "cpu"
                and self.kernels.supports_prefill(dtype, self.config.head_dim)
                and (dtype != torch.bfloat16 or self.bf16_prefill_kernel))

    def _decode_attention(self, q: torch.Tensor, d: DecodeGroup, k_cache: torch.Tensor,
                          v_cache: torch.Tensor) -> torch.Tensor:
        """One query per row over its padded context: the C++ kernel where it was built (it
        reads K/V in place), else one SDPA call for all rows.

        The query heads that share a KV head are folded into SDPA's query-length dimension
        ([B, kv_heads, group, dim] against [B, kv_heads, context, dim]): torch's CPU flash
        kernel then runs B * kv_heads blocks of `group` rows. With one query row per head it ran
        B * heads blocks of a single row and was ~20x slower; fp32 batched matmuls were ~1.5x
        slower, mostly converting the gathered KV."""
        if self.decode_reads_in_place(k_cache.device):
            return self.kernels.decode_attention(q, k_cache, v_cache, d.slots, d.lengths, self.scale)
        b, ctx = d.slots.shape
        kv_heads, dim = k_cache.shape[1], k_cache.shape[2]
        group = q.shape[1] // kv_heads
        flat = d.slots.reshape(-1)
        keys = k_cache.index_select(0, flat).to(q.dtype).view(b, ctx, kv_heads, dim).transpose(1, 2)
        values = v_cache.index_select(0, flat).to(q.dtype).view(b, ctx, kv_heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.view(b, kv_heads, group, dim), keys, values,
                                             attn_mask=d.visible, scale=self.scale)
        return out.reshape(b, kv_heads * group, dim)

    def _chunk_mask(self, c: ChunkLayout, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive mask of a chunk over a cached prefix, rows in `_chunk_attention`'s folded
        order (query head group, then row): row r at position start + r sees keys up to there.
        None for a chunk at position 0 (SDPA's own causal mask covers it)."""
        if c.start_position == 0:
            return None
        device = c.context_slots.device
        rows = torch.arange(c.num_rows, device=device)[:, None] + c.start_position
        hidden = torch.arange(c.context_slots.shape[0], device=device)[None, :] > rows
        mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
        return mask.repeat(self.config.num_heads // self.config.num_kv_heads, 1)

    def _chunk_attention(self, q: torch.Tensor, c: ChunkLayout, mask: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor) -> torch.Tensor:
        """q: [rows, heads, dim] over keys/values gathered from the pool ([context, kv_heads, dim]).
        The query heads sharing a KV head are folded into the row dimension, so torch's flash
        kernel runs kv_heads large blocks instead of heads small ones (~17% faster here, with
        the additive mask built once per step)."""
        rows, heads, dim = q.shape
        kv_heads = k_cache.shape[1]
        group = heads // kv_heads
        folded = q.view(rows, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * rows, dim)
        keys = k_cache.index_select(0, c.context_slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
        values = v_cache.index_select(0, c.context_slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=self.scale)
        return o.view(kv_heads, group, rows, dim).permute(2, 0, 1, 3).reshape(rows, heads, dim)

    def _splits(self, c: ChunkLayout, device: torch.device) -> bool:
        """Whether a chunk over a cached prefix takes `_split_attention` (on CPU, from
        SPLIT_MIN_ROWS rows) rather than one SDPA call with an additive mask."""
        return c.start_position > 0 and c.num_rows >= SPLIT_MIN_ROWS and device.type == "cpu" and _FLASH_LSE is not None

    def _split_attention(self, q: torch.Tensor, c: ChunkLayout, k_cache: torch.Tensor,
                         v_cache: torch.Tensor) -> torch.Tensor:
        """A chunk over a cached prefix as two unmasked flash-attention calls merged by their
        log-sum-exps: every row sees the whole prefix (the query heads of a KV head folded into
        rows, as in `_chunk_attention`), and the chunk itself causally (SDPA's own causal mask,
        which skips the blocks above the diagonal). Softmax over the union is the two partial
        outputs weighted by exp(lse_part - lse_union), in fp32. No mask is read, and none of the
        chunk's future keys is computed: on an Intel Xeon with AMX 2,048 rows over 14,336 cached
        ran 173 against 228 ms with the mask built beforehand (docs/benchmarks.md).
        q: [rows, heads, dim]; every key and value is read back from the pool, as stored."""
        assert _FLASH_LSE is not None
        rows, heads, dim = q.shape
        kv_heads = k_cache.shape[1]
        group = heads // kv_heads
        start = c.start_position
        prefix, own = c.context_slots[:start], c.context_slots[start : start + rows]
        folded = q.view(rows, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * rows, dim)
        keys = k_cache.index_select(0, prefix).to(q.dtype).transpose(0, 1).unsqueeze(0)
        values = v_cache.index_select(0, prefix).to(q.dtype).transpose(0, 1).unsqueeze(0)
        o_prefix, lse_prefix = _FLASH_LSE(folded, keys, values, 0.0, False, scale=self.scale)
        # the chunk's own keys, each KV head repeated for its query heads (a few MB at 2k rows)
        own_k = (k_cache.index_select(0, own).to(q.dtype).transpose(0, 1)[:, None]
                 .expand(kv_heads, group, rows, dim).reshape(1, heads, rows, dim))
        own_v = (v_cache.index_select(0, own).to(q.dtype).transpose(0, 1)[:, None]
                 .expand(kv_heads, group, rows, dim).reshape(1, heads, rows, dim))
        o_own, lse_own = _FLASH_LSE(q.transpose(0, 1).unsqueeze(0), own_k, own_v, 0.0, True, scale=self.scale)
        lse_prefix, lse_own = lse_prefix.reshape(heads, rows), lse_own.reshape(heads, rows)
        union = torch.logaddexp(lse_prefix, lse_own)
        o = (o_prefix.reshape(heads, rows, dim).float() * torch.exp(lse_prefix - union)[..., None]
             + o_own[0].float() * torch.exp(lse_own - union)[..., None])
        return o.to(q.dtype).transpose(0, 1)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool) -> torch.Tensor:
        # q: [rows, heads, dim]; k, v: [context, kv_heads, dim] -> [rows, heads, dim]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=causal, scale=self.scale,
            enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
