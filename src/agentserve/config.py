"""One frozen config per component, validated on construction, built at the edge (CLI/API)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ADMISSIONS = ("auto", "eager", "protective")  # LLM(admission=...), serve --admission, sim --admission


def protective_admission(admission: str, order_protects: bool) -> bool:
    """SchedulerConfig.protect_on_admission for an admission mode: `auto` is protective exactly
    when the eviction order protects blocks (serve's `--residency on`, the simulator's `agent`)."""
    return admission == "protective" or (admission == "auto" and order_protects)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_model_len: int  # the model's context: prompt + generated tokens
    block_size: int = 16
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()  # end a request unless ignore_eos
    # Waiting requests that do not fit now and are passed over in one step to admit the ones
    # behind them (0: admission in arrival order stops at the first that does not fit). Off by
    # default: on the Mooncake conversation trace at 256k tokens per replica, 8 made LRU
    # recompute 343M prompt tokens instead of 48.5M (JCT p50 1,268 s instead of 14 s): the
    # requests let past a large one fill the pool and evict the cached prefixes.
    admission_lookahead: int = 0
    # A waiting request other than the earliest is admitted only into blocks whose taking evicts
    # nothing the eviction policy protects (paused and returned trajectories under `--residency
    # on`); the earliest is always admitted. Where prefill is the bottleneck (a CPU), running one
    # more request at once gains little and evicting a paused trajectory's prefix costs its whole
    # recompute: on the peers' cc-c8 workload (8 Claude Code sessions, the KV holding about half)
    # it cut JCT p50 by ~1/5 (docs/residency.md). No effect under LRU, which protects nothing.
    protect_on_admission: bool = False
    # ... but only once this many run: a decode step of one row costs about what one of several
    # does, so the second running request is worth the prefixes it may evict (cc-c8: a floor of
    # 1 measured JCT p50 66 s, 2 59-61 s, 4 70 s, eager admission 73 s).
    protective_floor: int = 2
    # While a running request decodes, a prompt remainder of at most `join_short` tokens (a
    # turn's last piece over a cached prefix: it rides the decode group, one row per token)
    # computes at most this many tokens per step, except the earliest request's (0: all at
    # once). Where the decode step is bound by arithmetic rather than memory (bf16 weights
    # computed in fp32 on a CPU without a bf16 dot product) every extra row lengthens the step
    # that all running streams wait for: on a Zen 3, 4 decodes took ~32 ms a step and the step
    # that admitted 6 such rows 1.35-1.9x that; at 2 rows a step the spike went (the joining
    # request's first token comes 2 steps later). docs/benchmarks.md, issue 9's grammar runs, run 16.
    join_rows: int = 0
    join_short: int = 16

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.protective_floor < 1:
            raise ValueError(f"protective_floor must be >= 1, got {self.protective_floor}")
        if self.join_rows < 0 or self.join_short < 0:
            raise ValueError(f"join_rows and join_short must be >= 0, got {self.join_rows}, {self.join_short}")
        if self.admission_lookahead < 0:
            raise ValueError(f"admission_lookahead must be >= 0, got {self.admission_lookahead}")


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


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP server's bounds (docs/reliability.md). A request past a bound is refused at
    the door (429 with Retry-After, 413) so that every accepted request completes and memory
    stays bounded."""

    # Accepted requests that have not produced a token yet (being read, queued, in prefill).
    max_queued_requests: int = 256
    # Their prompt tokens; a request alone is accepted even above this (a long prompt must run).
    max_queued_prompt_tokens: int = 262_144
    max_request_body_bytes: int = 8 * 2**20
    request_body_timeout_s: float = 60.0  # a client that takes longer to send its body: 408
    # A streaming client that takes no data for this long is dropped, and its request aborted.
    stream_stall_timeout_s: float = 60.0
    # /health says 503 when one engine step has run this long (a wedged step loop).
    engine_stall_timeout_s: float = 300.0
    # After an unrecoverable engine failure: how long failed requests get to receive their
    # errors before the process exits non-zero (for a supervisor to restart it).
    failure_grace_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_queued_prompt_tokens", "max_request_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_body_timeout_s", "stream_stall_timeout_s", "engine_stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.failure_grace_s < 0:
            raise ValueError(f"failure_grace_s must be >= 0, got {self.failure_grace_s}")


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Lower KV tiers (engine/tiers.py, docs/tiers.md). Off when both are zero / absent.

    With a disk tier and no host_bytes, the host store holds `default_host_blocks` blocks (loads
    whose requests went away land there)."""

    host_bytes: int = 0
    disk_dir: Path | None = None
    disk_bytes: int = 0
    key: bytes | None = None  # the master key (flag or environment); None: the key file
    key_path: Path | None = None  # where the generated key lives (outside disk_dir)
    encrypt: bool = False  # AES-GCM on disk (always HMAC-SHA256)
    disk_page_cache: bool = True  # False: files are dropped from the OS page cache (equal-memory runs)
    max_queued_jobs: int = 1024  # the I/O worker's queue (write-through goes in jobs of 8 blocks)
    default_host_blocks: int = 256

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_dir is not None

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.disk_dir is not None and self.disk_bytes <= 0:
            raise ValueError("a disk tier needs a size: give --kv-disk-gib > 0 with --kv-disk-dir")
        if self.disk_dir is None and self.disk_bytes:
            raise ValueError("--kv-disk-gib needs --kv-disk-dir")
        if self.key is not None and len(self.key) != 32:
            raise ValueError(f"the KV store key must be 32 bytes, got {len(self.key)}")
        if self.max_queued_jobs < 1 or self.default_host_blocks < 1:
            raise ValueError("max_queued_jobs and default_host_blocks must be >= 1")
