"""The in-memory ledger: a row per generation attempt, on the engine's thread.

The scheduler tells it when an attempt is first scheduled (its reuse is final: the miss reason
is classified then, ledger/miss.py) and when it finishes (its row is made then); the engine
tells it each step's time, split among the step's requests by the tokens each computed, so the
rows' `busy_s` sum to the engine's busy time. The server binds each request to its trajectory,
session, parent and route before its first step (`bind`); a request never bound (offline
`LLM.generate`, the simulator without sessions) is a row with no trajectory.

Turns and attempts: a trajectory's request is a new attempt of its current turn when the
previous attempt did not complete (aborted or failed) or sent the same prompt again; any
other request starts the next turn.

Exact: every attempt the scheduler accepted is one row, and the running totals (`totals`,
`misses`) are never trimmed. Bounded: rows are kept for the `max_trajectories` most recently
active trajectories (older ones are only in the totals and the JSONL file), and previous
sequences' token ids within `max_prev_tokens` (beyond it a divergence is located to its block).
"""

from __future__ import annotations

import array
import functools
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from agentserve.kv.tombstones import Tombstones
from agentserve.ledger.cost import Totals, miss_key
from agentserve.ledger.miss import Identities, PrevSequence, SeenFilter, classify
from agentserve.ledger.receipts import BlockLives, ReceiptKeys, build_receipt, identity_digest
from agentserve.ledger.rows import Decision, Miss, Outcome, Row

if TYPE_CHECKING:
    from agentserve.engine.request import Request
    from agentserve.engine.scheduler import Batch, Scheduler

log = logging.getLogger(__name__)
BlockHash = int
Key = tuple[str, str]  # (tenant: the cache salt as given, trajectory id)
Describe = Callable[[int], "Where"]


@dataclass(frozen=True, slots=True)
class Where:
    """Where a token position falls in a chat prompt (the server renders it; None if unknown)."""

    message_index: int | None
    role: str | None = None
    old: str | None = None  # a window of the old and new text, only with the opt-in flag
    new: str | None = None


@dataclass(frozen=True, slots=True)
class Tag:
    """What the server knows about a request that the engine does not."""

    trajectory: Key | None
    session_id: str | None = None
    parent_id: str | None = None
    route: str = "chat"
    decision: Decision | None = None
    describe: Callable[[int, Sequence[int] | None], Where] | None = None  # token k, old tokens
    same_turn: bool = False  # a generation the server makes inside a turn (the tool loop's answer)
    receipt: bool = False  # build a cache receipt for it (ledger/receipts.py; `receipt()` takes it)


class _Lower(Protocol):
    def held(self, hashes: Sequence[BlockHash], cache_salt: str | None) -> tuple[int, int]: ...


class _Pool(Protocol):
    tombstones: Tombstones | None

    @property
    def index(self) -> Mapping[BlockHash, int]: ...


class PoolCacheView:
    """The engine's (or the simulator's) block pool and lower tiers as the ledger reads them."""

    def __init__(self, pool: _Pool, lower: _Lower | None) -> None:
        self.pool = pool
        self.lower_tiers = lower

    @property
    def tombstones(self) -> Tombstones | None:
        return self.pool.tombstones

    def num_resident(self, hashes: Sequence[BlockHash]) -> int:
        return sum(map(self.pool.index.__contains__, hashes))

    def lower(self, hashes: Sequence[BlockHash], tenant: str | None) -> tuple[int, int]:
        """How many of hashes the host store and the disk hold."""
        return (0, 0) if self.lower_tiers is None else self.lower_tiers.held(hashes, tenant)


@dataclass(slots=True)
class _Attempt:
    tag: Tag | None
    turn: int = 1
    attempt: int = 1
    busy_s: float = 0.0
    miss: Miss | None = None
    eligible: int = 0
    kv_token_s: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class _Trajectory:
    tenant: str  # digest
    turn: int = 0
    attempt: int = 0
    last_digest: int | None = None
    last_complete: bool = True
    prev: PrevSequence | None = None
    rows: list[Row] = field(default_factory=list)
    outcome: Outcome | None = None
    children: set[Key] = field(default_factory=set)


@functools.lru_cache(maxsize=4096)
def tenant_digest(salt: str | None) -> str:
    """The tenant as rows carry it: a digest, so a ledger file never holds a cache salt."""
    return hashlib.sha256(salt.encode()).hexdigest()[:16] if salt else ""


class Ledger:
    def __init__(self, block_size: int, model_id: str, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, max_trajectories: int = 10_000,
                 max_prev_tokens: int = 8_000_000, keep_tokens: bool = True, block_lives: bool = True) -> None:
        """keep_tokens: previous sequences' token ids (False: the simulator, whose tokens have
        no values); block_lives: when blocks were computed and served, for cache receipts
        (False: the simulator, which asks for none)."""
        self.block_size = block_size
        self.model_id = model_id
        self.clock = clock
        self._wall_offset = wall_clock() - clock()
        self.max_trajectories = max_trajectories
        self.max_prev_tokens = max_prev_tokens
        self.keep_tokens = keep_tokens  # False: the simulator (its token ids are not real)
        self.view: PoolCacheView | None = None  # set by attach()
        self.on_row: list[Callable[[Row | Outcome], None]] = []  # engine thread: metrics, writer
        self._active: dict[str, _Attempt] = {}
        self._traj: OrderedDict[Key, _Trajectory] = OrderedDict()
        self._prev_tokens = 0  # token ids kept across trajectories' previous sequences
        self.seen = SeenFilter()
        self.identities = Identities()
        self.totals = Totals()  # exact, never trimmed
        self.misses: Counter[str] = Counter()
        self.finish_reasons: Counter[str] = Counter()
        self.num_preemptions = 0
        self.busy_s = 0.0  # the engine's step time, all of it attributed
        self.num_errors = 0  # bookkeeping failures (logged); the requests were unaffected
        self.lives = BlockLives() if block_lives else None
        self.receipt_keys = ReceiptKeys()
        self.identity = identity_digest(model_id)  # the server sets model + template + runtime
        self._receipts: OrderedDict[str, dict[str, object]] = OrderedDict()

    def attach(self, scheduler: Scheduler, lower: _Lower | None) -> None:
        """Watch this scheduler (its first chunks and ends) and read its pool and lower tiers."""
        scheduler.observer = self
        self.view = PoolCacheView(scheduler.pool, lower)

    def wall(self, t: float) -> float:
        return t + self._wall_offset

    # ── the server ───────────────────────────────────────────────────────────────────────
    def bind(self, request: Request, tag: Tag) -> None:
        """Right after the request was added, before any step."""
        a = self._active.setdefault(request.request_id, _Attempt(tag))
        a.tag = tag
        key = tag.trajectory
        if key is None:
            return
        t = self._traj.get(key)
        if t is None:
            t = self._traj[key] = _Trajectory(tenant_digest(key[0]))
            if tag.parent_id is not None:
                parent = self._traj.get((key[0], tag.parent_id))
                if parent is not None:
                    parent.children.add(key)
            self._trim()
        else:
            self._traj.move_to_end(key)
        if tag.same_turn:
            a.turn, a.attempt = max(t.turn, 1), max(t.attempt, 1)
            return
        if self.keep_tokens:
            digest = hash(tuple(request.token_ids[: request.num_prompt_tokens]))
        else:  # simulated tokens have no values: the prompt's block hashes stand for them
            digest = hash((request.num_prompt_tokens,
                           tuple(request.block_hashes[: request.num_prompt_tokens // self.block_size])))
        if t.turn and (not t.last_complete or digest == t.last_digest):
            t.attempt += 1
        else:
            t.turn, t.attempt = t.turn + 1, 1
        t.last_digest = digest
        t.last_complete = False
        a.turn, a.attempt = t.turn, t.attempt

    def outcome(self, key: Key, success: bool) -> Outcome:
        """The harness's verdict on a task; KeyError if the ledger never saw the trajectory."""
        t = self._traj[key]
        o = Outcome(key[1], t.tenant, success, self.wall(self.clock()))
        t.outcome = o
        for fn in self.on_row:
            fn(o)
        return o

    # ── the scheduler (SchedulerObserver) ────────────────────────────────────────────────
    # Bookkeeping never fails a request: an error here is logged and counted (num_errors).
    def first_chunk(self, request: Request) -> None:
        try:
            self._first_chunk(request)
        except Exception:
            self.num_errors += 1
            log.exception("%s: ledger bookkeeping at its first chunk failed", request.request_id)

    def finished(self, request: Request) -> None:
        try:
            self._finished(request)
        except Exception:
            self.num_errors += 1
            log.exception("%s: ledger row failed (not recorded)", request.request_id)

    def _first_chunk(self, request: Request) -> None:
        a = self._active.setdefault(request.request_id, _Attempt(None))
        key = a.tag.trajectory if a.tag is not None else None
        t = self._traj.get(key) if key is not None else None
        prev = t.prev if t is not None else None
        view = self.view
        tokens = request.token_ids if self.keep_tokens else None
        a.miss, a.eligible = classify(
            prompt_hashes=request.block_hashes, prompt_tokens=tokens, num_prompt=request.num_prompt_tokens,
            num_reused=request.num_reused_tokens or 0, block_size=self.block_size, prev=prev,
            tombstones=view.tombstones if view is not None else None, seen=self.seen,
            identities=self.identities, identity=(tenant_digest(request.extra_keys.cache_salt), self.model_id),
            wall=self.wall)
        if a.miss is not None and a.miss.reason == "diverged" and a.tag is not None and a.tag.describe:
            try:
                where = a.tag.describe(a.miss.token, prev.tokens if prev is not None else None)
            except Exception:  # bookkeeping only: the row keeps the position without the message
                log.exception("%s: locating its divergence failed", request.request_id)
                where = Where(None)
            a.miss = _with_where(a.miss, where)
        if prev is not None and view is not None:
            a.kv_token_s = self._held(request, prev, view)
        self._served(request, a)

    def _served(self, request: Request, a: _Attempt) -> None:
        """Touch the reused prefix's segment ends (device, host, disk) in the block lives; with
        a receipt asked for, build it from what they were before this access."""
        bs = self.block_size
        reused = (request.num_reused_tokens or 0) // bs
        if self.lives is None and (a.tag is None or not a.tag.receipt):
            return
        if not reused:
            if a.tag is not None and a.tag.receipt:
                self._keep_receipt(request.request_id, build_receipt([], bs, "", self.receipt_keys,
                                                                     self.identity, self.wall))
            return
        host, disk = request.num_host_tokens // bs, request.num_disk_tokens // bs
        now = self.clock()
        segments = []
        end = 0
        for tier, n in (("device", reused - host - disk), ("host", host), ("disk", disk)):
            if n > 0:
                end += n
                h = request.block_hashes[end - 1]
                segments.append((tier, end, h, None if self.lives is None else self.lives.served(h, now)))
        if a.tag is not None and a.tag.receipt:
            self._keep_receipt(request.request_id, build_receipt(
                segments, bs, request.extra_keys.cache_salt or "", self.receipt_keys, self.identity, self.wall))

    def _keep_receipt(self, rid: str, receipt: dict[str, object]) -> None:
        self._receipts[rid] = receipt
        while len(self._receipts) > 4096:  # never taken (the client left): the oldest go
            self._receipts.popitem(last=False)

    def receipt(self, request_id: str) -> dict[str, object] | None:
        """The cache receipt of a request that asked for one (taken once)."""
        return self._receipts.pop(request_id, None)

    def _held(self, request: Request, prev: PrevSequence, view: PoolCacheView) -> dict[str, float]:
        """KV token-seconds held for this trajectory while it was paused, by tier: on the
        device each block until its tombstone (or the whole gap if still resident); in host
        and on disk the blocks there now, for the whole gap (their eviction times are not kept)."""
        gap = max(0.0, request.arrival_time - prev.finished_s)
        if not gap or not prev.hashes:
            return {}
        stones = view.tombstones
        # resident and tombstoned are disjoint (a publish revives a tombstone): C-level counts
        device = gap * view.num_resident(prev.hashes)
        if stones is not None:
            start = prev.finished_s
            for stone in stones.get_many(prev.hashes):
                if stone.time_s >= start:
                    device += min(gap, stone.time_s - start)
        host, disk = view.lower(prev.hashes, request.extra_keys.cache_salt)
        bs = self.block_size
        return {"device": device * bs, "host": host * bs * gap, "disk": disk * bs * gap}

    def _finished(self, request: Request) -> None:
        a = self._active.pop(request.request_id, None) or _Attempt(None)
        now = self.clock()
        tag = a.tag
        key = tag.trajectory if tag is not None else None
        t = self._traj.get(key) if key is not None else None
        reused = request.num_reused_tokens or 0
        fs, ft, arr = request.first_scheduled_time, request.first_token_time, request.arrival_time
        reason = request.finish_reason.value if request.finish_reason is not None else "abort"
        row = Row(
            request_id=request.request_id, trajectory_id=key[1] if key else None,
            session_id=tag.session_id if tag else None,
            parent_trajectory_id=tag.parent_id if tag else None,
            tenant=t.tenant if t is not None else tenant_digest(request.extra_keys.cache_salt),
            turn=a.turn, attempt=a.attempt, route=tag.route if tag else "offline",
            arrival_s=self.wall(arr), queue_s=None if fs is None else fs - arr,
            prefill_s=None if fs is None or ft is None else ft - fs,
            decode_s=None if ft is None else now - ft, ttft_s=None if ft is None else ft - arr,
            e2e_s=now - arr, busy_s=a.busy_s, prompt_tokens=request.num_prompt_tokens,
            reused_device=reused - request.num_host_tokens - request.num_disk_tokens,
            reused_host=request.num_host_tokens, reused_disk=request.num_disk_tokens,
            generated_tokens=request.num_output_tokens, recomputed_tokens=request.num_recomputed_tokens,
            preemptions=request.num_preemptions, eligible_tokens=a.eligible, finish_reason=reason,
            error=request.error, decision=tag.decision if tag else None, miss=a.miss,
            kv_token_s=a.kv_token_s)
        self._account(row)
        computed = request.final_block_hashes[reused // self.block_size :]
        if computed:
            self.seen.add_many(computed)
            if self.lives is not None:
                self.lives.computed(computed, now)
        if self.keep_tokens and request.num_prompt_tokens >= self.block_size and request.final_block_hashes:
            self.identities.record(request.token_ids[: self.block_size],
                                   (tenant_digest(request.extra_keys.cache_salt), self.model_id))
        if t is not None:
            t.rows.append(row)
            if tag is not None and not tag.same_turn:
                t.last_complete = reason in ("stop", "length")
                if t.last_complete:
                    self._set_prev(t, request, now)
        for fn in self.on_row:
            fn(row)

    def _account(self, row: Row) -> None:
        self.totals.add(row, 0.0)
        self.finish_reasons[row.finish_reason] += 1
        self.num_preemptions += row.preemptions
        k = miss_key(row)
        if k is not None:
            self.misses[k] += 1

    def _set_prev(self, t: _Trajectory, request: Request, now: float) -> None:
        if t.prev is not None and t.prev.tokens is not None:
            self._prev_tokens -= len(t.prev.tokens)
        tokens = None
        n = request.num_tokens
        if self.keep_tokens:
            tokens = array.array("l", request.token_ids)
            self._prev_tokens += n
        t.prev = PrevSequence(request.final_block_hashes, n, tokens, now)
        if self._prev_tokens > self.max_prev_tokens:
            self._shed_tokens()

    def _shed_tokens(self) -> None:
        """Over the token budget: drop the token ids of the least recently active trajectories
        (their hashes stay: a divergence is then located to its block)."""
        for t in self._traj.values():
            if self._prev_tokens <= self.max_prev_tokens * 0.9:
                return
            if t.prev is not None and t.prev.tokens is not None:
                self._prev_tokens -= len(t.prev.tokens)
                t.prev.tokens = None

    def _trim(self) -> None:
        while len(self._traj) > self.max_trajectories:
            _, old = self._traj.popitem(last=False)
            if old.prev is not None and old.prev.tokens is not None:
                self._prev_tokens -= len(old.prev.tokens)

    # ── the engine ───────────────────────────────────────────────────────────────────────
    def on_step(self, batch: Batch, seconds: float) -> None:
        """Split a step's time among its requests by the tokens each computed."""
        total = batch.num_tokens
        if not total:
            return
        self.busy_s += seconds
        per = seconds / total
        active = self._active
        for c in batch.chunks:
            a = active.get(c.request_id)
            if a is None:
                a = active[c.request_id] = _Attempt(None)
            a.busy_s += per * len(c.token_ids)

    def on_decode_run(self, request_ids: Sequence[str], seconds: float) -> None:
        """The simulator's run of pure decode steps: one token per request per step, so the
        run's time splits evenly."""
        if not request_ids:
            return
        self.busy_s += seconds
        per = seconds / len(request_ids)
        for rid in request_ids:
            a = self._active.get(rid)
            if a is None:
                a = self._active[rid] = _Attempt(None)
            a.busy_s += per

    # ── views ────────────────────────────────────────────────────────────────────────────
    def rows_of(self, key: Key, with_children: bool = True) -> tuple[list[Row], list[Outcome]] | None:
        """A trajectory's rows (and its sub-agents', recursively), None if unknown."""
        t = self._traj.get(key)
        if t is None:
            return None
        rows: list[Row] = []
        outcomes: list[Outcome] = []
        seen: set[Key] = set()
        stack = [key]
        while stack:
            k = stack.pop()
            if k in seen or (s := self._traj.get(k)) is None:
                continue
            seen.add(k)
            rows.extend(s.rows)
            if s.outcome is not None:
                outcomes.append(s.outcome)
            if with_children:
                stack.extend(s.children)
        return rows, outcomes


def _with_where(miss: Miss, where: Where) -> Miss:
    return replace(miss, message_index=where.message_index, role=where.role, old=where.old, new=where.new)
