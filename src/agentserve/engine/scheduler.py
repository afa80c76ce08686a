"""schedule() -> Batch ; update(batch, sampled) -> outputs. No tensors here.

Each request's num_computed_tokens catches up to its num_tokens: a prompt is computed in
chunks under the step's token budget, a running request then computes one token per step, and
prefill chunks and decodes share a step. Admission is optimistic: no blocks are reserved for
future decode steps.

Priority is arrival order (`Request.priority`, set by `add`): running requests get the step's
budget in that order, and when a request cannot get a block the latest-arriving running
request is preempted (its blocks freed last-first so its shared prefix stays cached; it is
recomputed later from whatever prefix is still cached). So a request is never preempted for a
later arrival, and the earliest unfinished request always runs: if it is waiting, it is
admitted first, preempting later arrivals for a sequence slot or blocks. Since `add` accepts
only requests whose longest possible sequence fits the pool alone, the earliest request
advances every step exactly as it would alone, so every request finishes within the solo step
counts of those that arrived before it, plus its own (tests/engine/test_scheduler_properties.py).
Other waiting requests are admitted in priority order while budget, slots and blocks last
(with `protect_on_admission`, only blocks whose taking evicts nothing the eviction policy
protects; `admission_lookahead` > 0 also passes over that many that do not fit now, to admit smaller
ones behind them). No request that could never fit is ever queued, so none blocks the ones
behind it for longer than the requests ahead of it take.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from agentserve.config import SchedulerConfig
from agentserve.engine.request import (
    FinishReason,
    Request,
    RequestId,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    make_output,
)
from agentserve.engine.decode_run import DecodeOp, decode_horizon, plan_events
from agentserve.kv.block_pool import BlockId, BlockPool
from agentserve.kv.hashing import BlockHash, ExtraKeys, extend_block_hashes


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One request's work in a step: compute KV for token_ids at positions start_position..."""

    request_id: RequestId
    token_ids: Sequence[int]  # a tuple in the engine; a virtual slice in the simulator
    start_position: int
    block_ids: tuple[BlockId, ...]  # block table covering start_position + len(token_ids)
    sample: bool  # the chunk reaches the last token: sample the next one
    sampling: SamplingParams
    output_index: int  # index of the token to be sampled among the outputs (seeded sampling)
    suppressed_token_ids: tuple[int, ...]  # may not be sampled (stop ids before min_tokens)


@dataclass(frozen=True, slots=True)
class Preemption:
    """A scheduling decision: `request_id` lost its blocks so that `by` could run (`by` is
    the request itself when it was the latest arrival and the free blocks ran out)."""

    request_id: RequestId
    by: RequestId
    for_slot: bool  # True: `by` needed a sequence slot; False: it needed blocks


@dataclass(frozen=True, slots=True)
class Restore:
    """Blocks allocated for a prefix run found in a lower tier: the engine copies hashes[i]
    into block_ids[i] before the forward (they are already published in the prefix cache)."""

    request_id: RequestId
    block_ids: tuple[BlockId, ...]
    hashes: tuple[BlockHash, ...]


class LowerTier(Protocol):
    """What the scheduler asks the lower tiers (engine/tiers.py): how many of these hashes, from
    the first, the host tier can restore into the pool in this step (`match`); how many the
    disk holds (`disk_run`); and to start reading a disk run for a request (`load`: False if
    the read cannot be queued now)."""

    def match(self, hashes: Sequence[BlockHash]) -> int: ...
    def disk_run(self, hashes: Sequence[BlockHash], keys: ExtraKeys) -> int: ...
    def load(self, key: str, hashes: Sequence[BlockHash], keys: ExtraKeys) -> bool: ...


@dataclass(frozen=True, slots=True)
class Batch:
    chunks: tuple[ScheduledChunk, ...]
    preemptions: tuple[Preemption, ...]
    finished: tuple[RequestId, ...] = ()  # ended since the last batch: runner state to drop
    restores: tuple[Restore, ...] = ()  # copy in before the forward

    @property
    def preempted(self) -> tuple[RequestId, ...]:
        return tuple(p.request_id for p in self.preemptions)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _priority(request: Request) -> int:
    return request.priority


def _frozen(token_ids: Sequence[int]) -> Sequence[int]:
    """A list slice becomes a tuple; a virtual sequence's slice is already immutable."""
    return tuple(token_ids) if isinstance(token_ids, list) else token_ids


class SchedulerObserver(Protocol):
    """Told of each request's first scheduled chunk (its prefix reuse is final then) and of
    its end, whatever ended it (the ledger, ledger/ledger.py)."""

    def first_chunk(self, request: Request) -> None: ...
    def finished(self, request: Request) -> None: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, lower: LowerTier | None = None) -> None:
        assert pool.block_size == config.block_size
        self.config = config
        self.pool = pool
        self.lower = lower if config.enable_prefix_caching else None
        self._restores: list[Restore] = []
        self._finished_requests: list[Request] = []  # for the lower tiers' write-through
        self._started: list[Request] = []  # admitted since the last take (lower tiers' prefetch)
        # Both lists are kept in priority (arrival) order.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[RequestId, Request] = {}
        self._finished: list[RequestId] = []
        self._next_priority = 0
        self.observer: SchedulerObserver | None = None
        self._decoding = False  # this step: join_rows is on and a running request decodes

    # ── admission and removal ─────────────────────────────────────────────────────────────
    def max_sequence_blocks(self, request: Request) -> int:
        """Blocks the request holds at most: its longest sequence (prompt + max_tokens, capped
        by the context) less the last token, whose KV is never computed."""
        longest = min(request.num_prompt_tokens + request.sampling.max_tokens, self.config.max_model_len)
        return _cdiv(max(longest, request.num_tokens + 1) - 1, self.pool.block_size)

    def add(self, request: Request) -> None:
        """Queue a request; raises ValueError if it can never run. A request is accepted only
        if its longest sequence fits the pool alone, so every accepted request can finish."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        n, limit = request.num_tokens, self.config.max_model_len
        if n >= limit:
            raise ValueError(f"prompt has {n} tokens; the model's context is {limit} (prompt + at least 1 generated)")
        needed = self.max_sequence_blocks(request)
        if needed > self.pool.num_blocks:
            bs = self.pool.block_size
            raise ValueError(
                f"prompt of {n} tokens with max_tokens {request.sampling.max_tokens} needs up to "
                f"{needed} KV blocks ({needed * bs} tokens); the pool has {self.pool.num_blocks} "
                f"({self.pool.num_blocks * bs} tokens): lower max_tokens or the prompt")
        request.priority = self._next_priority
        self._next_priority += 1
        self.requests[request.request_id] = request
        self.waiting.append(request)  # the latest arrival: the end of the priority order

    def loading_request(self, key: str) -> Request | None:
        """The LOADING request a disk read with this key is for; None if it was preempted or
        ended since (the read is then stale)."""
        request = self.requests.get(RequestId(key.rsplit("#", 1)[0]))
        if request is None or request.status is not RequestStatus.LOADING or request.load_key != key:
            return None
        return request

    def loaded(self, request: Request, n: int) -> tuple[list[BlockId], list[BlockHash]]:
        """Its disk read ended with the first n blocks of the run read and verified (the caller
        copies them into the returned blocks first): they are published and counted as
        computed; the rest of the run is computed. It runs from the next schedule."""
        assert request.status is RequestStatus.LOADING
        first = request.num_cached_blocks
        ids, hashes = request.block_ids[first : first + n], request.block_hashes[first : first + n]
        self.pool.insert_many(ids, hashes)
        request.num_cached_blocks += n
        request.num_computed_tokens += n * self.pool.block_size
        tokens = n * self.pool.block_size
        if request.num_preemptions == 0:
            request.num_reused_tokens = (request.num_reused_tokens or 0) + tokens
            request.num_disk_tokens += tokens
        else:
            request.num_recomputed_tokens -= min(tokens, request.num_recomputed_tokens)
        request.status = RequestStatus.RUNNING
        request.load_key = None
        return ids, hashes

    def num_loading(self) -> int:
        return sum(r.status is RequestStatus.LOADING for r in self.running)

    def finish(self, request_id: RequestId, reason: FinishReason, error: str | None = None) -> Request | None:
        """End a request (abort, stop string, a failure): free its blocks at once. None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status in (RequestStatus.RUNNING, RequestStatus.LOADING):
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        if request.num_cached_blocks:
            request.final_block_hashes = tuple(request.block_hashes[: request.num_cached_blocks])
        self._free_blocks(request)
        self._finished.append(request_id)
        if self.lower is not None:
            self._finished_requests.append(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        if self.observer is not None:
            self.observer.finished(request)
        return request

    def take_started(self) -> list[Request]:
        """Requests admitted since the last call (kept only with a lower tier)."""
        out, self._started = self._started, []
        return out

    def take_finished(self) -> list[Request]:
        """Requests finished since the last call (kept only with a lower tier, which writes
        their cached blocks through)."""
        out, self._finished_requests = self._finished_requests, []
        return out

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ── schedule ──────────────────────────────────────────────────────────────────────────
    def schedule(self, now: float) -> Batch:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preemptions: list[Preemption] = []
        self._admit_earliest(preemptions)
        self._decoding = self.config.join_rows > 0 and any(
            r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.status is RequestStatus.LOADING:  # its blocks are being read from disk
                i += 1
                continue
            n = self._joining(request, min(request.num_tokens - request.num_computed_tokens, budget))
            if not self._grow(request, n, preemptions):
                continue  # request itself was preempted; running[i] is now the next one
            chunks.append(self._chunk(request, n, now))
            budget -= n
            i += 1
        if not preemptions:  # admitting now would only make new victims
            budget = self._admit(budget, chunks, now)
        finished: tuple[RequestId, ...] = ()
        if chunks:  # an empty batch is not run: keep the list for the next one
            finished, self._finished = tuple(self._finished), []
        restores, self._restores = tuple(self._restores), []  # (a LOADING request's host run too)
        return Batch(chunks=tuple(chunks), preemptions=tuple(preemptions), finished=finished,
                     restores=restores)

    def _earliest_waiting(self) -> Request | None:
        """The earliest unfinished request, if it is waiting (it then runs this step)."""
        if not self.waiting:
            return None
        head = self.waiting[0]
        return head if not self.running or head.priority < self.running[0].priority else None

    def _admit_earliest(self, preemptions: list[Preemption]) -> None:
        """Admit the earliest unfinished request if it waits, with its cached prefix and a slot,
        preempting later arrivals for the slot; its blocks come in the running loop (`_grow`),
        preempting later arrivals too. It always fits: `add` checked it fits the pool alone."""
        request = self._earliest_waiting()
        if request is None:
            return
        while len(self.running) >= self.config.max_num_seqs:
            self._preempt(self.running[-1], request, preemptions, for_slot=True)
        matched, lower = self._match(request)
        free = self.pool.num_free_blocks - self.pool.count_free(matched)
        del self.waiting[0]
        if self._load(request, matched, lower, free):
            return
        # Its blocks come in `_grow`; those of a lower-tier run now, if free blocks allow.
        lower = min(lower, free)
        self._start(request, matched, lower, lower, (len(matched) + lower) * self.pool.block_size)

    def _grow(self, request: Request, n: int, preemptions: list[Preemption]) -> bool:
        """Give request blocks for n more tokens, preempting the latest arrivals. False if the
        request was the latest and had to preempt itself."""
        need = _cdiv(request.num_computed_tokens + n, self.pool.block_size) - len(request.block_ids)
        while need > self.pool.num_free_blocks:
            victim = self.running[-1]
            self._preempt(victim, request, preemptions, for_slot=False)
            if victim is request:
                return False
        if need > 0:
            request.block_ids.extend(self.pool.allocate(need))
        return True

    def _preempt(self, request: Request, by: Request, preemptions: list[Preemption], for_slot: bool) -> None:
        assert by.priority <= request.priority, "a request is preempted only for an earlier arrival"
        self.running.remove(request)
        if self.pool.tombstones is not None:  # if its blocks are evicted now, preemption did it
            self.pool.tombstones.note(request.block_hashes[: request.num_cached_blocks], "preemption")
        request.load_key = None  # a read in flight for it is stale now
        request.staged = False  # it may load from disk again when it is admitted again
        self._free_blocks(request)
        request.num_recomputed_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=_priority)
        preemptions.append(Preemption(request.request_id, by.request_id, for_slot))

    def _admit(self, budget: int, chunks: list[ScheduledChunk], now: float) -> int:
        """Admit waiting requests in priority order while budget, slots and blocks last, passing
        over up to `admission_lookahead` that do not fit now (they are admitted in priority
        order once they fit, or first once they are the earliest). A request whose
        next uncached block is being computed right now by a running request waits a step
        rather than compute it twice (agents starting together share their system prompt)."""
        in_flight: set[BlockHash] | None = None
        i = passed = 0
        while (i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs
               and passed <= self.config.admission_lookahead):
            request = self.waiting[i]
            matched, lower = self._match(request)
            reach = len(matched) + lower
            if self.config.enable_prefix_caching and reach < len(request.block_hashes):
                in_flight = self._in_flight() if in_flight is None else in_flight
                if request.block_hashes[reach] in in_flight:
                    i += 1  # it waits a step; the ones behind it may go
                    continue
            computed, n, need = self._admission(request, reach, budget, len(matched))
            hit = self.pool.count_free(matched)
            if not self._fits(need, matched, hit):
                i, passed = i + 1, passed + 1
                continue
            free = self.pool.num_free_blocks - hit
            del self.waiting[i]
            if self._load(request, matched, lower, free):
                continue
            self._start(request, matched, need, lower, computed)
            if in_flight is not None:
                in_flight.update(request.block_hashes[request.num_cached_blocks :])
            chunks.append(self._chunk(request, n, now))
            budget -= n
        return budget

    def _admission(self, request: Request, reach: int, budget: int, num_matched: int
                         ) -> tuple[int, int, int]:
        """(tokens already computed, tokens to compute now, new blocks needed) to admit request
        under `budget` with `reach` blocks of its prefix reusable, the first num_matched of them
        in the pool (the others are restored from a lower tier into new blocks)."""
        computed = reach * self.pool.block_size
        n = self._joining(request, min(request.num_tokens - computed, budget))
        return computed, n, _cdiv(computed + n, self.pool.block_size) - num_matched

    def _joining(self, request: Request, n: int) -> int:
        """The tokens of a short prompt remainder to compute this step (SchedulerConfig.join_rows):
        spread while others decode, so the step they wait for grows by a few rows, not all of
        them. Never the earliest request's: it advances as it would alone (module docstring)."""
        cfg = self.config
        if not self._decoding or n <= cfg.join_rows or n > cfg.join_short or request is self._earliest():
            return n
        return cfg.join_rows

    def _earliest(self) -> Request | None:
        """The earliest unfinished request (both lists are in priority order)."""
        heads = [q[0] for q in (self.running, self.waiting) if q]
        return min(heads, key=_priority, default=None)

    def _protective(self) -> bool:
        """Whether admission now must leave protected blocks alone: with protect_on_admission,
        once `protective_floor` requests run (below it, one more running request is worth more
        than the prefixes it may evict: a decode step costs about as much for one row as for
        several)."""
        return self.config.protect_on_admission and len(self.running) >= self.config.protective_floor

    def _fits(self, need: int, matched: list[BlockId], hit: int) -> bool:
        """Whether `need` new blocks can be admitted beside this device prefix, `hit` of whose
        blocks are free (taken, not evicted): free blocks enough, and under protective admission
        enough that taking them evicts no protected block."""
        pool = self.pool
        free = pool.num_free_blocks - hit
        unprotected_free = pool.num_unprotected_free_blocks
        if need > free or not self._protective() or unprotected_free == pool.num_free_blocks:
            # (every free block unprotected, as under LRU: the hit ones too, so the rule is `free`)
            return need <= free
        unprotected = unprotected_free - pool.count_unprotected(matched)
        return need <= unprotected

    def _in_flight(self) -> set[BlockHash]:
        """Hashes of full blocks that running requests are computing (not yet published)."""
        return {h for r in self.running for h in r.block_hashes[r.num_cached_blocks :]}

    def _start(self, request: Request, matched: list[BlockId], need: int, lower: int, computed: int) -> None:
        """Run request with its device prefix `matched`, `need` new blocks, the first `lower`
        of them restored from a lower tier (published now, copied in before the forward)."""
        assert lower <= need
        self.pool.lock(matched)
        request.block_ids = matched + self.pool.allocate(need)
        request.num_cached_blocks = len(matched) + lower
        if lower:
            self._restore(request, len(matched), lower)
        if self.lower is not None:
            self._started.append(request)
        if request.num_reused_tokens is None:
            request.num_reused_tokens = min(computed, request.num_prompt_tokens)
            request.num_host_tokens = min(lower * self.pool.block_size, request.num_reused_tokens)
        else:  # back after preemption: the hit is recomputation avoided
            request.num_recomputed_tokens -= min(computed, request.num_recomputed_tokens)
        request.num_computed_tokens = computed
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=_priority)

    def _load(self, request: Request, matched: list[BlockId], lower: int, free: int) -> bool:
        """At admission, once per admission: if its prefix continues on disk after the pool and
        host runs, start it LOADING instead: blocks are allocated for the host and disk runs
        (the host run is restored now, as always), the disk run is read into the others by
        the worker, and until `loaded` it holds them and a sequence slot without running. A
        read starts only for a request that would run now: it waits for one read, not a queue."""
        if self.lower is None or request.staged:
            return False
        request.staged = True
        reach = len(matched) + lower
        max_blocks = (request.num_tokens - 1) // self.pool.block_size
        n = 0 if reach >= max_blocks else min(
            self.lower.disk_run(request.block_hashes[reach:max_blocks], request.extra_keys), free - lower)
        if n <= 0:
            return False
        key = f"{request.request_id}#{request.num_preemptions}"
        if not self.lower.load(key, request.block_hashes[reach : reach + n], request.extra_keys):
            return False
        self._start(request, matched, lower + n, lower, reach * self.pool.block_size)
        request.status = RequestStatus.LOADING
        request.load_key = key
        return True

    def _restore(self, request: Request, first: int, n: int) -> None:
        ids, hashes = request.block_ids[first : first + n], request.block_hashes[first : first + n]
        self.pool.insert_many(ids, hashes)
        self._restores.append(Restore(request.request_id, tuple(ids), tuple(hashes)))

    def _match(self, request: Request) -> tuple[list[BlockId], int]:
        """Longest cached prefix in full blocks, leaving at least one token to compute: the
        device blocks holding it, and how many blocks after them a lower tier can restore."""
        if not self.config.enable_prefix_caching:
            return [], 0
        bs = self.pool.block_size
        extend_block_hashes(request.block_hashes, request.token_ids, bs, request.extra_keys)
        max_blocks, pool, memo = (request.num_tokens - 1) // bs, self.pool, request.match_memo
        if memo is not None and memo[0] == pool.num_evictions and len(memo[1]) <= max_blocks:
            # (a waiting request is matched again at every step it waits: the prefix found last
            # time is still there, only what follows it can have been published since)
            known = memo[1]
            matched = [*known, *pool.match_prefix(request.block_hashes[len(known) : max_blocks])]
        else:
            matched = pool.match_prefix(request.block_hashes[:max_blocks])
        request.match_memo = (pool.num_evictions, tuple(matched))
        if self.lower is None or len(matched) == max_blocks:
            return matched, 0
        return matched, self.lower.match(request.block_hashes[len(matched) : max_blocks])

    def _chunk(self, request: Request, n: int, now: float) -> ScheduledChunk:
        start = request.num_computed_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            if self.observer is not None:
                self.observer.first_chunk(request)
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=_frozen(request.token_ids[start : start + n]),
            start_position=start,
            block_ids=tuple(request.block_ids),
            sample=start + n == request.num_tokens,
            sampling=request.sampling,
            output_index=request.num_output_tokens,
            suppressed_token_ids=self._suppressed(request),
        )

    def _suppressed(self, request: Request) -> tuple[int, ...]:
        sp = request.sampling
        if request.num_output_tokens + 1 >= sp.min_tokens:
            return ()
        eos = () if sp.ignore_eos else self.config.eos_token_ids
        return tuple(sorted(set(eos) | set(sp.stop_token_ids)))

    # ── update ────────────────────────────────────────────────────────────────────────────
    def update(self, batch: Batch, sampled: Mapping[RequestId, int], now: float,
               failed: Mapping[RequestId, str] | None = None) -> list[RequestOutput]:
        """Apply a run's results. `failed` names requests whose row the runner could not
        sample (with why): each ends with FinishReason.ERROR; the others are unaffected."""
        outputs: list[RequestOutput] = []
        for chunk in batch.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted between schedule and update
            if failed and chunk.request_id in failed:
                self.finish(request.request_id, FinishReason.ERROR, failed[chunk.request_id])
                outputs.append(make_output(request, ()))
                continue
            request.num_computed_tokens += len(chunk.token_ids)
            self._publish(request)
            if not chunk.sample:
                continue
            token = sampled[chunk.request_id]
            request.token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            reason = self._stop_reason(request, token)
            if reason is not None:
                self.finish(request.request_id, reason)
            outputs.append(make_output(request, (token,)))
        return outputs

    def _publish(self, request: Request) -> None:
        """Enter newly computed full blocks into the prefix cache."""
        if not self.config.enable_prefix_caching:
            return
        bs = self.pool.block_size
        num_full = request.num_computed_tokens // bs
        if num_full <= request.num_cached_blocks:
            return
        extend_block_hashes(request.block_hashes, request.token_ids, bs, request.extra_keys)
        first = request.num_cached_blocks
        self.pool.insert_many(request.block_ids[first:num_full], request.block_hashes[first:num_full])
        request.num_cached_blocks = num_full

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        sp = request.sampling
        n_out = request.num_output_tokens
        is_eos = not sp.ignore_eos and token in self.config.eos_token_ids
        if n_out >= sp.min_tokens and (is_eos or token in sp.stop_token_ids):
            return FinishReason.STOP
        if n_out >= sp.max_tokens or request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _free_blocks(self, request: Request) -> None:
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_cached_blocks = 0

    # ── runs of pure decode steps (the simulator's fast path) ────────────────────────────
    def decode_horizon(self) -> int:
        """How many next steps are pure decode steps (engine/decode_run.py): decode_ahead(k)
        for any k up to this number is exactly k schedule/update steps. 0 when there are none."""
        if self._earliest_waiting() is not None:
            return 0  # it is admitted in the next step
        if self.lower is not None and self.num_loading():
            return 0  # a read may end at any moment
        blocked = not self.waiting or len(self.running) >= self.config.max_num_seqs or self._admission_blocked()
        return decode_horizon(self.running, 0 if blocked else len(self.waiting), self.config,
                              self.pool.num_free_blocks)

    def _admission_blocked(self) -> bool:
        """True if `_admit` would admit none of the waiting requests it looks at (the first
        admission_lookahead + 1) now, and pure decode steps cannot change that."""
        budget = self.config.max_num_batched_tokens - len(self.running)
        if budget <= 0:
            return True
        in_flight: set[BlockHash] | None = None
        for request in self.waiting[: self.config.admission_lookahead + 1]:
            matched, lower = self._match(request)
            reach = len(matched) + lower
            _, _, need = self._admission(request, reach, budget, len(matched))
            if self._fits(need, matched, self.pool.count_free(matched)):
                return False  # admitted now, or a step after its next block is published
            # Pure decode steps only take free blocks (its need and the free blocks outside its
            # match never improve; nor do the unprotected ones, and no request starts or ends,
            # so protective admission's rule holds too); only a publish of its next block hash
            # could extend its match.
            if reach < len(request.block_hashes):
                in_flight = self._in_flight() if in_flight is None else in_flight
                if request.block_hashes[reach] in in_flight:
                    return False
        return True

    def decode_ahead(self, num_steps: int, token_id: int,
                     moment: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Take num_steps pure decode steps at once, every running request sampling token_id
        each step; one output per request with all its new tokens. `moment(j)`, if given, is
        called before the block operations that single steps do once j steps have ended (step
        j allocates in its schedule, at j; it publishes in its update, at j + 1), so that a
        simulator's clock reads then what it would have read stepping one by one (an eviction
        policy's order may depend on the time)."""
        assert 0 < num_steps <= self.decode_horizon()
        running, bs = self.running, self.pool.block_size
        for r in running:
            sp = r.sampling
            assert token_id not in sp.stop_token_ids and (sp.ignore_eos or token_id not in self.config.eos_token_ids)
        start = [r.num_computed_tokens for r in running]
        added = [0] * len(running)  # tokens appended so far: step j publishes after j of them
        at = -1
        for step, op, i in plan_events(running, num_steps, bs, self.config.enable_prefix_caching):
            r = running[i]
            if moment is not None and (j := step + (op != DecodeOp.ALLOCATE.value)) != at:
                moment(j)
                at = j
            if op == DecodeOp.ALLOCATE.value:
                r.block_ids.extend(self.pool.allocate(1))
                continue
            r.token_ids.extend((token_id,) * (step - added[i]))
            added[i] = step
            r.num_computed_tokens = start[i] + step + 1
            self._publish(r)
        for i, r in enumerate(running):
            r.num_computed_tokens = start[i] + num_steps
            r.token_ids.extend((token_id,) * (num_steps - added[i]))
        new = (token_id,) * num_steps
        return [make_output(r, new) for r in running]
