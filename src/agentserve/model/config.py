"""Architecture description of a decoder-only model, independent of where the weights came from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the forward needs to know; built from a GGUF header or an HF config.json.

    Parameter names in the weight dict follow Hugging Face's Qwen2/Llama/Qwen3 naming
    (`model.layers.{i}.self_attn.q_proj.weight`, ...), so HF checkpoints load unchanged.
    """

    architecture: str  # "qwen2" | "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    eos_token_ids: tuple[int, ...]
    name: str  # model identity; part of every block hash so two models never share KV

    def __post_init__(self) -> None:
        if self.architecture not in ("qwen2", "llama", "qwen3"):
            raise ValueError(
                f"unsupported architecture {self.architecture!r}: agentserve runs qwen2, qwen3 "
                "and llama decoder-only models"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of {self.num_kv_heads}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, at 2 bytes per element (bf16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2
