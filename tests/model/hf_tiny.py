"""Tiny random-weight HF models of each architecture, and our engine pieces built on the same
weights, for exactness tests against transformers' own forward."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import torch
import transformers

from agentserve.model.config import ModelConfig
from agentserve.model.cpu_kernels import CpuKernels, load_cpu_kernels

if TYPE_CHECKING:
    from agentserve.model.transformer import Transformer

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6)
# Gains for `sharp_attention`. At the random init q.k is ~0.1: over 300 keys every head's
# softmax has the entropy of a uniform one (5.70 nats), and the residual is mostly the
# embedding, so greedy tokens hardly depend on attention (a tiny Llama with tied embeddings
# emits 8 distinct tokens in 8 prompts x 12). Scaling q and k by 12 (Qwen3: its q/k norm
# weights by 3, as it normalizes the projections) brings the entropy to 0.5-3 nats; v and o
# by 3 give attention a real share of the residual. Then a C++ kernel that skips the
# online-softmax rescale, reads V from a wrong slot or drops the last key changes the greedy
# tokens in every engine test of all three architectures (tried with such mutants).
QK_GAIN, QK_NORM_GAIN, VO_GAIN = 12.0, 3.0, 3.0


def tiny_hf_model(arch: str, seed: int = 0, sharp_attention: bool = False) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, rope_theta=10000.0, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "llama":
        cfg = transformers.LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**TINY, head_dim=32, rope_theta=10000.0, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # Random init leaves biases/norms at 0/1; perturb them so they matter in the comparison.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        if sharp_attention:
            for layer in model.model.layers:
                _sharpen(layer.self_attn)
    return model.eval().float()


def _sharpen(attn: torch.nn.Module) -> None:
    normed = hasattr(attn, "q_norm")  # a gain on Qwen3's projections would be normalized away
    qk = [attn.q_norm, attn.k_norm] if normed else [attn.q_proj, attn.k_proj]
    for module in qk:
        for p in module.parameters():
            p.mul_(QK_NORM_GAIN if normed else QK_GAIN)
    attn.v_proj.weight.mul_(VO_GAIN)
    attn.o_proj.weight.mul_(VO_GAIN)


def model_config_of(model: transformers.PreTrainedModel, arch: str) -> ModelConfig:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
    return ModelConfig(
        architecture=arch, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=head_dim,
        rope_theta=float(rope), rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=bool(c.tie_word_embeddings), attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3", eos_token_ids=(1,), name=f"tiny-{arch}",
    )


def weights_of(model: transformers.PreTrainedModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def tiny_engine(arch: str = "qwen2", *, block_size: int = 4, num_blocks: int = 64,
                max_num_batched_tokens: int = 64, max_num_seqs: int = 16,
                enable_prefix_caching: bool = True, dtype: torch.dtype = torch.float32,
                kernels: CpuKernels | KernelSpy | None = None, sharp_attention: bool = True,
                eviction=None, tiers=None, ledger: bool = False, compute_dtype: torch.dtype | None = None):
    """An Engine over a tiny random model: (engine, hf_model). kernels: the C++ decode
    attention (or a spy on it); None runs decode attention through torch's SDPA. The model's
    attention is sharp by default: engine tests compare greedy tokens, and only then do the
    tokens depend on what attention computed. eviction: the pool's EvictionPolicy (LRU if None).
    tiers: a TierConfig for host and disk KV tiers (engine.tiers is then the KvTiers).
    ledger: keep a ledger (engine.ledger), with tombstones in the pool for its miss reasons.
    compute_dtype: the activations' dtype when not `dtype` (fp32 over bf16 weights and KV)."""
    from agentserve.config import SchedulerConfig
    from agentserve.engine.engine import Engine
    from agentserve.engine.scheduler import Scheduler
    from agentserve.kv.block_pool import BlockPool
    from agentserve.model.runner import ModelRunner
    from agentserve.model.transformer import Transformer

    hf = tiny_hf_model(arch, sharp_attention=sharp_attention)
    cfg = model_config_of(hf, arch)
    model = Transformer(cfg, weights_of(hf, dtype), kernels=kernels, compute_dtype=compute_dtype)
    runner = ModelRunner(model, num_blocks, block_size, dtype, torch.device("cpu"))
    tombstones = None
    if ledger:
        import time

        from agentserve.kv.tombstones import Tombstones

        tombstones = Tombstones(time.monotonic)
    pool = BlockPool(num_blocks, block_size, eviction, tombstones)
    kv_tiers = None
    if tiers is not None:
        from agentserve.engine.tier_build import build_kv_tiers
        from agentserve.kv.identity import CacheIdentity

        identity = CacheIdentity(cfg.name, str(dtype).removeprefix("torch."), block_size,
                                 runner.kv_layout(), runner.kernel_options())
        kv_tiers = build_kv_tiers(tiers, runner, pool, identity)
    sched = Scheduler(
        SchedulerConfig(max_model_len=cfg.max_position_embeddings, block_size=block_size,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        enable_prefix_caching=enable_prefix_caching, eos_token_ids=()),
        pool, lower=kv_tiers)
    book = None
    if ledger:
        from agentserve.ledger.ledger import Ledger

        book = Ledger(block_size, cfg.name)
    return Engine(sched, runner, model_id=cfg.name, vocab_size=cfg.vocab_size, tiers=kv_tiers, ledger=book), hf


def run_all(engine, prompts, sampling) -> list[list[int]]:
    """Add every prompt at once, step to completion, return generated ids in order."""
    ids = [engine.add(p, sampling) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        engine.scheduler.pool.check()
    return [out[i] for i in ids]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by transformers' full forward, recomputed from scratch each token
    (no KV cache on the reference side, so nothing is shared with what is tested)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def cpu_kernels_or_skip() -> CpuKernels:
    """The built C++ kernels. Where they cannot be built (no compiler, a build error) the
    calling test is skipped with the builder's own message: a kernel test must never pass
    silently on the torch path."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("agentserve.model.cpu_kernels")
    logger.addHandler(handler)
    try:
        kernels = load_cpu_kernels()
    finally:
        logger.removeHandler(handler)
    if kernels is None:
        pytest.skip("C++ decode attention could not be built: " + ("; ".join(messages) or "no reason logged"))
    return kernels


@dataclass(slots=True)
class KernelSpy:
    """Stands in for CpuKernels inside a Transformer and records what went through the C++
    decode attention, so a test can assert the kernel path was taken (the Transformer falls
    back to SDPA without a word when a kernel is absent or does not support the head size)."""

    kernels: CpuKernels
    num_calls: int = 0
    num_rows: int = 0
    max_context: int = 0  # longest context attended: > 128 means the online softmax rescaled
    prefill_calls: int = 0  # C++ prefill attention calls (one per chunk and layer)
    prefill_rows: int = 0
    prefill_over_cache: int = 0  # of them, chunks starting past position 0
    max_prefill_context: int = 0
    small_linear_calls: int = 0  # few-row bf16 matmuls through csrc/small_linear.cpp
    widened_calls: int = 0  # few-row matmuls of bf16 weights in fp32 through csrc/widened_linear.cpp
    norm_calls: int = 0  # RMSNorms (with or without the residual add) through csrc/norm_rope.cpp
    rope_calls: int = 0
    silu_calls: int = 0

    def install(self, model: Transformer) -> None:
        """Stand in for the kernels everywhere the model holds them (its linears too)."""
        model.kernels = self  # type: ignore[assignment]
        for lin in model.linears():
            if lin.small is not None:
                lin.small = self  # type: ignore[assignment]

    def small_linear_rows(self, k: int) -> int:
        return self.kernels.small_linear_rows(k)

    def small_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.small_linear_calls += 1
        return self.kernels.small_linear(x, weight, bias)

    def widened_rows(self, k: int) -> int:
        return self.kernels.widened_rows(k)

    def widened_linear(self, x: torch.Tensor, pairs: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        self.widened_calls += 1
        return self.kernels.widened_linear(x, pairs, n, bias)

    @property
    def avx2_attention(self) -> bool:
        return self.kernels.avx2_attention

    def supports(self, head_dim: int) -> bool:
        return self.kernels.supports(head_dim)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.norm_calls += 1
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.norm_calls += 1
        return self.kernels.add_rms_norm(h, d, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        self.silu_calls += 1
        return self.kernels.silu_mul(gate_up)

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.rope_calls += 1
        self.kernels.rope_store(qkv, cos, sin, q_heads, kv_heads, slots, k_cache, v_cache)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
        self.num_calls += 1
        self.num_rows += q.shape[0]
        self.max_context = max(self.max_context, int(lengths.max()))
        return self.kernels.decode_attention(q, k_cache, v_cache, slots, lengths, scale)

    def supports_prefill(self, dtype: torch.dtype, head_dim: int) -> bool:
        return self.kernels.supports_prefill(dtype, head_dim)

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          context_slots: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        self.prefill_calls += 1
        self.prefill_rows += q.shape[0]
        self.max_prefill_context = max(self.max_prefill_context, int(context_slots.shape[0]))
        if start > 0:
            self.prefill_over_cache += 1
        return self.kernels.prefill_attention(q, k_cache, v_cache, context_slots, start, scale)
