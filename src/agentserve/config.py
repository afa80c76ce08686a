"""One frozen config per component, validated on construction, built at the edge (CLI/API)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_model_len: int  # the model's context: prompt + generated tokens
    block_size: int = 16
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()  # end a request unless ignore_eos

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Size of the device KV pool: num_blocks if given, else as many as fit in memory_gib."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_gib: float = 1.0

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_gib <= 0:
            raise ValueError(f"memory_gib must be > 0, got {self.memory_gib}")
