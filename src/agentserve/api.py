"""Offline Python API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentserve.config import ADMISSIONS, CacheConfig, SchedulerConfig, TierConfig, protective_admission
from agentserve.engine.engine import Engine
from agentserve.engine.tier_build import build_kv_tiers
from agentserve.engine.tiers import KvTiers
from agentserve.engine.request import FinishReason, RequestId, RequestOutput, SamplingParams
from agentserve.engine.scheduler import Scheduler
from agentserve.kv.block_pool import BlockPool
from agentserve.kv.identity import CacheIdentity
from agentserve.kv.tombstones import Tombstones
from agentserve.ledger.ledger import Ledger, Tag
from agentserve.trajectory.residency import Residency, ResidencyConfig, build_residency

Prompt = str | Sequence[int]
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_reused_tokens: int
    num_prefilled_tokens: int
    num_generated_tokens: int
    num_recomputed_tokens: int
    time_to_first_token_s: float | None  # arrival -> first token
    latency_s: float  # arrival -> finish
    error: str | None = None  # with finish_reason ERROR: why this request failed


class _Decoder:
    """Adapts a HF tokenizer to the engine's Detokenizer protocol."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


class LLM:
    def __init__(
        self,
        model: str = "smollm2-135m",
        dtype: str = "bfloat16",
        enable_prefix_caching: bool = True,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory_gib: float = 1.0,
        num_kv_blocks: int | None = None,
        max_model_len: int | None = None,
        device: str | None = None,
        seed: int = 0,
        cache_root: Path | None = None,
        cpu_kernels: bool = True,
        residency: str = "off",
        residency_config: ResidencyConfig | None = None,
        tiers: TierConfig | None = None,
        ledger: bool = True,
        compute_dtype: str = "auto",
        admission: str = "auto",
        join_rows: int | None = None,
    ) -> None:
        """cpu_kernels: on CPU, build and use the C++ decode-attention kernel (model/csrc/)
        where a compiler is available; False keeps torch's SDPA. residency: off | shadow | on
        (trajectory/residency.py; needs the prefix cache). tiers: host and disk KV tiers
        (engine/tiers.py; need the prefix cache). ledger: keep a row per attempt
        (ledger/ledger.py; `self.ledger`). compute_dtype: auto | bfloat16 | float32, the dtype
        activations are computed in (model/precision.py: auto computes a bf16 model in fp32,
        weights and KV kept in bf16, on a CPU without a bf16 dot product). admission: auto |
        eager | protective (SchedulerConfig.protect_on_admission; auto: protective with
        residency on). join_rows: SchedulerConfig.join_rows; None: 2 where a bf16 model is
        computed in fp32 (its decode steps are bound by arithmetic, so each joining row costs
        the running streams), else 0."""
        if admission not in ADMISSIONS:
            raise ValueError(f"admission {admission!r} not supported; use one of {', '.join(ADMISSIONS)}")
        if residency != "off" and not enable_prefix_caching:
            raise ValueError(f"residency {residency!r} needs the prefix cache; drop --no-prefix-caching "
                             "or use --residency off")
        from agentserve.model.build import build_runner
        from agentserve.model.loader import load_model_config, load_tokenizer, resolve_model_dir

        root = cache_root or Path.home() / ".cache" / "agentserve"
        self.model_dir = resolve_model_dir(model, root)
        self.model_config = load_model_config(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        cache = CacheConfig(block_size=block_size, num_blocks=num_kv_blocks, memory_gib=kv_cache_memory_gib)
        built = build_runner(self.model_dir, self.model_config, dtype, device, cache, seed,
                             tokenizer=self.tokenizer, cpu_kernels=cpu_kernels, compute=compute_dtype)
        self.device = built.device
        self.runner = built.runner
        context, self.max_model_len_note = _fit_context(
            min(max_model_len or self.model_config.max_position_embeddings,
                self.model_config.max_position_embeddings), built.num_blocks, block_size)
        if self.max_model_len_note:
            log.warning("%s", self.max_model_len_note)
        self.scheduler_config = SchedulerConfig(
            max_model_len=context,
            block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            eos_token_ids=self.model_config.eos_token_ids,
            protect_on_admission=protective_admission(admission, residency == "on"),
            join_rows=join_rows if join_rows is not None else (2 if self.runner.model.widened else 0),
        )
        self.residency_mode = residency
        clock = time.monotonic  # the engine's clock too
        self.residency: Residency | None
        self.residency, eviction = build_residency(residency, built.num_blocks, block_size, clock,
                                                   residency_config)
        # tombstones say when and why a block left: for receipts and the ledger's miss reasons
        tombstones = None if self.residency is None and not ledger else \
            Tombstones.for_pool(clock, built.num_blocks)
        pool = BlockPool(built.num_blocks, block_size, eviction, tombstones)
        if self.residency is not None:
            self.residency.attach(pool)
        self.tiers = self._build_tiers(tiers, pool, dtype, enable_prefix_caching)
        if self.tiers is not None and self.residency is not None and residency == "on":
            self.residency.tiers = self.tiers  # advice offloads, prefetches and releases for real
        self.ledger = Ledger(block_size, self.model_config.name, clock) if ledger else None
        self.engine = Engine(
            Scheduler(self.scheduler_config, pool, lower=self.tiers), built.runner,
            model_id=self.model_config.name, vocab_size=self.model_config.vocab_size,
            detokenizer=_Decoder(self.tokenizer), tiers=self.tiers, ledger=self.ledger,
        )

    def _build_tiers(self, config: TierConfig | None, pool: BlockPool, dtype: str, prefix_caching: bool
                     ) -> KvTiers | None:
        if config is None or not config.enabled:
            return None
        if not prefix_caching:
            raise ValueError("KV tiers need the prefix cache; drop --no-prefix-caching")
        identity = CacheIdentity(model_id=self.model_config.name, dtype=dtype,
                                 block_size=pool.block_size, layout=self.runner.kv_layout(),
                                 kernel_options=self.runner.kernel_options())
        return build_kv_tiers(config, self.runner, pool, identity)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the lower tiers' I/O worker; queued disk writes are finished first (for at most
        timeout_s: a file not written is only a future miss)."""
        if self.tiers is not None and self.tiers.worker is not None:
            if not self.tiers.worker.drain(timeout_s):
                log.warning("KV disk writes still queued after %.0f s at shutdown: dropped", timeout_s)
            self.tiers.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the model's own chat template."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | None = None,
                 trajectory_id: str | None = None) -> list[CompletionOutput]:
        """Run prompts to completion together (continuous batching); outputs in prompt order.
        A prompt that is rejected raises ValueError before any of them runs. trajectory_id: the
        agent task these prompts are turns of, for the ledger's turns and miss reasons
        (`self.ledger`; docs/ledger.md)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        sampling = sampling or SamplingParams()
        encoded = [self.encode(p) for p in prompts]  # type: ignore[union-attr]
        ids: list[RequestId] = []
        try:
            for tokens in encoded:
                ids.append(self.engine.add(tokens, sampling))
                if self.ledger is not None and trajectory_id is not None:
                    self.ledger.bind(self.engine.scheduler.requests[ids[-1]], Tag(("", trajectory_id), route="offline"))
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, encoded)

    def _run(self, ids: list[RequestId], encoded: list[list[int]]) -> list[CompletionOutput]:
        tokens: dict[RequestId, list[int]] = {rid: [] for rid in ids}
        final: dict[RequestId, tuple[RequestOutput, float]] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.request_id in tokens:
                    tokens[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        final[out.request_id] = (out, self.engine.clock())
        return [self._completion(*final[rid], p, tokens[rid]) for rid, p in zip(ids, encoded)]

    def _completion(self, out: RequestOutput, now: float, prompt: list[int], toks: list[int]
                    ) -> CompletionOutput:
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        if out.matched_stop is not None:
            text = text[: text.find(out.matched_stop)]
        ttft = None if out.first_token_time is None else out.first_token_time - out.arrival_time
        return CompletionOutput(
            request_id=out.request_id, prompt_token_ids=tuple(prompt), token_ids=tuple(toks),
            text=text, finish_reason=out.finish_reason, num_prompt_tokens=out.num_prompt_tokens,
            num_reused_tokens=out.num_reused_tokens, num_prefilled_tokens=out.num_prefilled_tokens,
            num_generated_tokens=out.num_generated_tokens,
            num_recomputed_tokens=out.num_recomputed_tokens, time_to_first_token_s=ttft,
            latency_s=now - out.arrival_time, error=out.error,
        )


def _fit_context(max_model_len: int, num_blocks: int, block_size: int) -> tuple[int, str | None]:
    """The context the KV pool can hold for one sequence, and a note when that is less than
    asked: every accepted request must be able to finish alone (engine/scheduler.py)."""
    held = num_blocks * block_size
    if max_model_len <= held:
        return max_model_len, None
    return held, (f"max_model_len lowered from {max_model_len} to {held} tokens: the KV pool holds "
                  f"{num_blocks} blocks of {block_size} tokens; give it more memory "
                  "(kv_cache_memory_gib / --kv-cache-memory-gib) for a longer context")


__all__ = ["LLM", "SamplingParams", "CompletionOutput"]
