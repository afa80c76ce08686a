"""Requests, their sampling parameters and the outputs the engine returns."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NewType, Protocol, overload

from agentserve.kv.block_pool import BlockId
from agentserve.kv.hashing import BlockHash, ExtraKeys

RequestId = NewType("RequestId", str)


class GuideFormat(enum.Enum):
    JSON_SCHEMA = "json_schema"  # text is a serialized JSON schema
    LARK = "lark"  # text is a Lark grammar in llguidance's dialect (may embed %json{...})


@dataclass(frozen=True, slots=True)
class Guide:
    """Constrained decoding: every sampled token keeps the output a prefix of a string the
    grammar accepts, and the request ends when the grammar is complete."""

    format: GuideFormat
    text: str

    @classmethod
    def json_schema(cls, schema: str) -> Guide:
        return cls(GuideFormat.JSON_SCHEMA, schema)

    @classmethod
    def lark(cls, grammar: str) -> Guide:
        return cls(GuideFormat.LARK, grammar)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k cut
    max_tokens: int = 16
    min_tokens: int = 0  # end-of-sequence is ignored before this many tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    guide: Guide | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.guide is not None and self.min_tokens:
            # A constrained value ends when the grammar completes, where only end-of-sequence is
            # allowed; min_tokens would mask that too and leave no token to sample.
            raise ValueError("min_tokens cannot be combined with a guide (constrained decoding): "
                             "the output ends when the constrained value is complete")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class TokenIds(Protocol):
    """A request's tokens: a list in the engine; the simulator passes a virtual sequence whose
    slices are O(1) (it has counts and block hashes, not token values)."""

    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> TokenIds: ...
    def __iter__(self) -> Iterator[int]: ...
    def append(self, token_id: int) -> None: ...
    def extend(self, token_ids: Sequence[int]) -> None: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted, its blocks held, while its prefix is read from disk
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # end-of-sequence, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    ERROR = "error"  # this request failed (its error says why); the others are unaffected


@dataclass(slots=True)
class Request:
    """Scheduler-owned state of one request.

    Invariant: 0 <= num_computed_tokens <= len(token_ids) - 1 while running (the last token's
    KV is computed in the step that samples the next one); block_ids covers the computed tokens
    plus those scheduled; block_ids[:num_cached_blocks] are published in the prefix cache.
    block_hashes[i] is the hash of full block i of token_ids; the engine extends it as blocks
    fill, a simulator may give it up front (trace hashes, including blocks not yet generated).
    """

    request_id: RequestId
    token_ids: TokenIds  # prompt followed by the generated tokens (a list in the engine)
    num_prompt_tokens: int
    sampling: SamplingParams
    extra_keys: ExtraKeys
    arrival_time: float
    priority: int = 0  # arrival order, set by Scheduler.add: lower runs first, is preempted last
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[BlockId] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks of token_ids
    num_cached_blocks: int = 0
    num_reused_tokens: int | None = None  # prefix-cache hit at first admission (every tier)
    num_host_tokens: int = 0  # of those, restored from the host tier
    num_disk_tokens: int = 0  # of those, read from disk (then restored through host)
    staged: bool = False  # a disk read was considered at this admission
    load_key: str | None = None  # its disk read in flight, while LOADING
    num_recomputed_tokens: int = 0  # tokens computed again after a preemption
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None  # why it failed, with finish_reason ERROR
    final_block_hashes: tuple[BlockHash, ...] = ()  # once finished: its published blocks, in order
    # Its last prefix match in its scheduler's pool: the pool's eviction count then and the
    # device blocks. While no block has been evicted since, that prefix is still cached in the
    # same blocks (only an eviction drops a hash, and block_hashes only grows), so the next
    # match starts after it.
    match_memo: tuple[int, tuple[BlockId, ...]] | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> TokenIds:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request. Token counts are cumulative."""

    request_id: RequestId
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_reused_tokens: int  # prompt tokens served from the prefix cache (any tier)
    num_prefilled_tokens: int  # prompt tokens computed (prompt - reused)
    num_generated_tokens: int
    num_recomputed_tokens: int  # extra work from preemption
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    matched_stop: str | None = None  # the stop string that ended the request (not in the text)
    error: str | None = None  # with finish_reason ERROR: what failed in this request
    # Once finished: the hashes of its blocks that were in the prefix cache (prompt and reply),
    # what its trajectory's next turn would match; () before that or with the cache off.
    block_hashes: tuple[BlockHash, ...] = ()
    num_host_tokens: int = 0  # of num_reused_tokens, restored from the host tier
    num_disk_tokens: int = 0  # of num_reused_tokens, read from disk


def make_output(
    request: Request, new_token_ids: tuple[int, ...], matched_stop: str | None = None
) -> RequestOutput:
    reused = request.num_reused_tokens or 0
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finished=request.status is RequestStatus.FINISHED,
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_reused_tokens=reused,
        num_prefilled_tokens=request.num_prompt_tokens - reused,
        num_generated_tokens=request.num_output_tokens,
        num_recomputed_tokens=request.num_recomputed_tokens,
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        matched_stop=matched_stop,
        error=request.error,
        block_hashes=request.final_block_hashes,
        num_host_tokens=request.num_host_tokens,
        num_disk_tokens=request.num_disk_tokens,
    )
