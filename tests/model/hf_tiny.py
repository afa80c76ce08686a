"""Tiny random-weight HF models of each architecture, and our engine pieces built on the same
weights, for exactness tests against transformers' own forward."""

from __future__ import annotations

import torch
import transformers

from agentserve.model.config import ModelConfig

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6)


def tiny_hf_model(arch: str, seed: int = 0) -> transformers.PreTrainedModel:
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
    return model.eval().float()


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
                enable_prefix_caching: bool = True, dtype: torch.dtype = torch.float32):
    """An Engine over a tiny random model: (engine, hf_model)."""
    from agentserve.config import SchedulerConfig
    from agentserve.engine.engine import Engine
    from agentserve.engine.scheduler import Scheduler
    from agentserve.kv.block_pool import BlockPool
    from agentserve.model.runner import ModelRunner
    from agentserve.model.transformer import Transformer

    hf = tiny_hf_model(arch)
    cfg = model_config_of(hf, arch)
    runner = ModelRunner(Transformer(cfg, weights_of(hf, dtype)), num_blocks, block_size, dtype,
                         torch.device("cpu"))
    sched = Scheduler(
        SchedulerConfig(max_model_len=cfg.max_position_embeddings, block_size=block_size,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        enable_prefix_caching=enable_prefix_caching, eos_token_ids=()),
        BlockPool(num_blocks, block_size))
    return Engine(sched, runner, model_id=cfg.name, vocab_size=cfg.vocab_size), hf


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
