"""Runner: Batch (plain records) -> tensors -> forward -> sampled token ids.

Never mutates a request; owns the KV tensors and the unseeded-sampling generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentserve.engine.engine import RunResult
from agentserve.engine.request import RequestId
from agentserve.engine.scheduler import Batch
from agentserve.model.config import ModelConfig
from agentserve.model.guided import GuidedDecoding
from agentserve.model.sampler import sample
from agentserve.model.transformer import ChunkLayout, DecodeGroup, PagedKV, Transformer


def num_blocks_for_memory(config: ModelConfig, block_size: int, memory_gib: float,
                          dtype: torch.dtype) -> int:
    """How many KV blocks fit in memory_gib."""
    elem = torch.tensor([], dtype=dtype).element_size()
    per_block = 2 * config.num_layers * config.num_kv_heads * config.head_dim * elem * block_size
    return max(1, int(memory_gib * 2**30) // per_block)


# A chunk this short (the new piece of a turn whose prefix is cached, a resumed request) rides the
# decode group, one row per token, where decode attention reads the pool in place: beside running
# decodes it adds rows to one attention call instead of a gather, a mask and an SDPA call of its
# own in every layer (a 5-token chunk beside 4 decodes: +12 ms on a 38 ms step before, +5 after).
SHORT_CHUNK = 16


class ModelRunner:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0, guided: GuidedDecoding | None = None) -> None:
        self.model = model
        self.guided = guided
        self.block_size = block_size
        self.device = device
        self.kv = PagedKV(model.config, num_blocks, block_size, dtype, device)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.short_chunk = SHORT_CHUNK if model.decode_reads_in_place(device) else 1

    def intraop_threads(self) -> int:
        return torch.get_num_threads()

    def bind_threads(self, cpus: list[int]) -> list[int] | None:
        """Pin the intra-op team's member t to cpus[t] (its thread ids, -1 where refused); None
        without the C++ kernels (on CPU) that carry the call."""
        if self.device.type != "cpu" or self.model.kernels is None:
            return None
        return self.model.kernels.bind_threads(cpus)

    # ── whole blocks in and out of the pool, for the lower tiers (engine/tiers.py) ────────────
    @property
    def block_nbytes(self) -> int:
        return self.kv.block_nbytes

    def kv_layout(self) -> str:
        """The payload layout of one block, for the cache identity."""
        return self.kv.layout()

    def kernel_options(self) -> str:
        """What else in the forward changes the KV bits (linear packing is checked bit-exact)."""
        dtype = self.model.compute_dtype
        kernels = "cpp-decode" if self.model.kernels is not None else "sdpa"
        if self.model.prefill_reads_in_place(dtype, self.device):
            kernels += "+cpp-prefill"  # its rounding differs from SDPA's, so later layers' KV does
            if dtype == torch.bfloat16:
                kernels += "+bf16-decode-tiles"  # decode through the same micro kernel
            elif self.model.kernels.avx2_attention:
                kernels += "+avx2-tiles"  # fp32 prefill through the AVX2 kernel: its own sums' order
        linear = "small-rows" if self.model.uses_small_linear() else "onednn"  # the sums' order
        if self.model.fused_norm_rope:
            linear += "+cpp-norm-rope"  # the RMSNorm's sum of squares in another order
        options = f"attention={kernels};linear={linear};torch={torch.__version__};device={self.device.type}"
        if self.model.widened:  # bf16 weights and KV computed in fp32: other KV bits altogether
            options += f";compute={str(dtype).removeprefix('torch.')}"
        return options

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        return self.kv.read_blocks(block_ids)

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        self.kv.write_blocks(block_ids, payloads)

    def _slots(self, block_ids: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        positions = torch.arange(start, stop, dtype=torch.int64)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    def _decode_group(self, rows: list[int], slots: list[torch.Tensor]) -> DecodeGroup | None:
        if not rows:
            return None
        lengths = [len(x) for x in slots]
        longest = max(lengths)
        padded = torch.zeros(len(rows), longest, dtype=torch.int64)  # pads read slot 0, masked out
        for i, x in enumerate(slots):
            padded[i, : len(x)] = x
        visible = None
        if min(lengths) != longest:
            visible = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
            visible = visible.to(self.device)
        return DecodeGroup(torch.tensor(rows, device=self.device), padded.to(self.device),
                           torch.tensor(lengths, dtype=torch.int64, device=self.device), visible)

    @torch.inference_mode()
    def run(self, batch: Batch) -> RunResult:
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        write_slots: list[torch.Tensor] = []
        layouts: list[ChunkLayout] = []
        decode_rows: list[int] = []
        decode_slots: list[torch.Tensor] = []
        logit_rows: list[int] = []
        for c in batch.chunks:
            n, start = len(c.token_ids), c.start_position
            context = self._slots(c.block_ids, 0, start + n)
            if n <= self.short_chunk:  # each row a query over its own causal prefix (KV is written first)
                decode_rows.extend(range(len(token_ids), len(token_ids) + n))
                decode_slots.extend(context[: start + r + 1] for r in range(n))
            else:
                layouts.append(ChunkLayout(len(token_ids), n, start, context.to(self.device)))
            token_ids.extend(c.token_ids)
            positions.append(torch.arange(start, start + n, dtype=torch.int64))
            write_slots.append(context[start:])
            if c.sample:
                logit_rows.append(len(token_ids) - 1)
        dev = self.device
        logits = self.model.forward(
            torch.tensor(token_ids, dtype=torch.int64, device=dev),
            torch.cat(positions).to(dev),
            torch.cat(write_slots).to(dev),
            layouts,
            self.kv,
            torch.tensor(logit_rows, dtype=torch.int64, device=dev),
            self._decode_group(decode_rows, decode_slots),
        )
        return self._sample(batch, logits)

    def _sample(self, batch: Batch, logits: torch.Tensor) -> RunResult:
        """Masks, samples and advances grammars row by row: a row that fails fails its
        request alone (RunResult.failed)."""
        chunks = [c for c in batch.chunks if c.sample]
        failed: dict[RequestId, str] = {}
        if self.guided is not None:
            self.guided.release(batch.finished)
            failed |= self.guided.mask(logits, [(c.request_id, c.sampling.guide) for c in chunks])
        keep = [i for i, c in enumerate(chunks) if c.request_id not in failed]
        if len(keep) < len(chunks):
            chunks, logits = [chunks[i] for i in keep], logits[keep]
        out = sample(logits, [c.sampling for c in chunks], [c.output_index for c in chunks],
                     [c.suppressed_token_ids for c in chunks], self.generator)
        failed |= {chunks[row].request_id: why for row, why in out.failed.items()}
        sampled = {chunks[row].request_id: t for row, t in out.tokens.items()}
        if self.guided is not None:
            for rid, t in sampled.items():
                why = self.guided.accept(rid, t)
                if why is not None:
                    failed[rid] = why
            for rid in failed:
                sampled.pop(rid, None)
        return RunResult(sampled, failed)
