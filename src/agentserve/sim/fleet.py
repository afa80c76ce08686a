"""The fleet simulator: sessions send turns to N replicas through a router, in virtual time.

Events, in (time, kind, sequence) order, step ends before arrivals at equal times:
- ARRIVAL (chain, turn): build the request (virtual tokens, its planned block ids), route it,
  add it to that replica's Scheduler; an idle replica starts a step.
- STEP_END (replica, generation): update the scheduler; finished turns release the chain's
  next turn (after its think time, or at its trace time) and start its sub-agents; a parent
  turn that awaits sub-agents is sent when the last of them is done.
Everything is deterministic for a given plan, start times and config.
"""

from __future__ import annotations

import heapq
import itertools
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agentserve.config import ADMISSIONS, SchedulerConfig, protective_admission
from agentserve.engine.request import Request, RequestId, RequestOutput, SamplingParams
from agentserve.engine.scheduler import Scheduler
from agentserve.kv.block_pool import BlockPool
from agentserve.kv.hashing import ExtraKeys
from agentserve.kv.tombstones import Tombstones
from agentserve.ledger.ledger import Ledger, Tag
from agentserve.ledger.rows import Row
from agentserve.sim.cost import CostModel
from agentserve.sim.eligible import eligible_blocks
from agentserve.sim.metrics import RequestRecord, summarize
from agentserve.sim.oracle import NextUse
from agentserve.sim.plan import Plan
from agentserve.sim.policies import PolicyContext, get_policy
from agentserve.sim.progress import Progress
from agentserve.sim.replica import Replica, ReplicaStats
from agentserve.sim.router import make_router
from agentserve.sim.tiers import sim_tiers
from agentserve.sim.tokens import VirtualTokens
from agentserve.trajectory.registry import State, TrajectoryKey
from agentserve.trajectory.residency import Residency
from agentserve.workload.model import StopReason, Timing

_STEP_END, _ARRIVAL, _TIER_DONE, _EXPIRE = 0, 1, 2, 3
_KEYS = ExtraKeys("sim")  # one model, one tenant: block ids alone decide sharing
_EXPIRE_EVERY_S = 10.0  # how often residency policies drop trajectories idle too long


def _key(chain: int) -> TrajectoryKey:
    return TrajectoryKey("sim", str(chain))


class SimError(ValueError):
    """A configuration the simulator cannot run; raised before any work is done."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    capacity_tokens: int  # device KV pool per replica, in tokens
    policy: str = "lru"
    num_replicas: int = 1
    router: str = "session-hash"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    decode_runs: bool = True  # take pure decode steps in runs (same records, much faster)
    skip_oversized: bool = False  # skip (and count) requests larger than the pool, else refuse
    events: str = "none"  # lifecycle events a harness sends the `agent` policy: none | terminal
    host_tokens: int = 0  # host KV tier per replica, in tokens (0: none)
    disk_tokens: int = 0  # disk KV tier per replica, in tokens (0: none)
    ledger: bool = False  # keep the server's ledger (a row per attempt, miss reasons) per replica
    # serve's --admission: auto is protective under a policy that protects (`agent`, as serve's
    # `--residency on`), eager otherwise (SchedulerConfig.protect_on_admission)
    admission: str = "auto"

    def __post_init__(self) -> None:
        if self.events not in ("none", "terminal"):
            raise SimError(f"events must be none or terminal, got {self.events!r}")
        if self.admission not in ADMISSIONS:
            raise SimError(f"admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        get_policy(self.policy)
        for name in ("capacity_tokens", "num_replicas", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise SimError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.host_tokens < 0 or self.disk_tokens < 0:
            raise SimError("host_tokens and disk_tokens must be >= 0")
        if (self.host_tokens or self.disk_tokens) and not get_policy(self.policy).prefix_caching:
            raise SimError(f"KV tiers need the prefix cache; policy {self.policy!r} has none")


@dataclass(frozen=True, slots=True)
class SimResult:
    config: SimConfig
    records: tuple[RequestRecord, ...]
    session_jct_s: tuple[float, ...]
    summary: dict[str, float | int]
    replicas: tuple[ReplicaStats, ...]
    num_skipped: int
    wall_s: float
    ledger_rows: tuple[Row, ...] = ()  # with config.ledger, in finishing order


def check_capacity(plan: Plan, capacity_tokens: int) -> None:
    bs = plan.block_size
    need = max((-(-(t.prompt_tokens + t.output_tokens) // bs) for c in plan.chains for t in c.turns), default=0)
    if need * bs > capacity_tokens // bs * bs:
        raise SimError(
            f"--capacity-tokens {capacity_tokens} is smaller than the largest request of {plan.name} "
            f"({plan.max_request_tokens} tokens = {need} blocks of {bs}); use at least {need * bs}, "
            "or skip such requests (--skip-oversized)")


def simulate(plan: Plan, starts: Sequence[float], config: SimConfig, cost: CostModel,
             oracle: Callable[[], NextUse] | None = None) -> SimResult:
    if not config.skip_oversized:
        check_capacity(plan, config.capacity_tokens)
    fleet = Fleet(plan, starts, config, cost, oracle or (lambda: NextUse(plan, starts)))
    t0 = time.perf_counter()
    fleet.run()
    wall = time.perf_counter() - t0
    busy = sum(r.stats.busy_s for r in fleet.replicas)
    makespan = max((r.done_s for r in fleet.records), default=0.0) - min(starts, default=0.0)
    summary = summarize(fleet.records, fleet.jct, makespan, busy, config.num_replicas)
    return SimResult(config, tuple(fleet.records), tuple(fleet.jct), summary,
                     tuple(r.stats for r in fleet.replicas), fleet.num_skipped, wall, tuple(fleet.ledger_rows))


class Fleet:
    def __init__(self, plan: Plan, starts: Sequence[float], config: SimConfig, cost: CostModel,
                 oracle: Callable[[], NextUse]) -> None:
        self.plan, self.config, self.starts = plan, config, starts
        self.now = 0.0
        spec = get_policy(config.policy)
        self.cursor = array("l", [-1]) * len(plan.chains)  # latest turn sent, per chain
        self.router = make_router(config.router)
        homes = [self.router.home(c.session, config.num_replicas) for c in plan.chains]
        self.progress = Progress.start(plan, starts, [-1 if h is None else h for h in homes])
        bs = plan.block_size
        sched = SchedulerConfig(max_model_len=plan.max_request_tokens + 2, block_size=bs,
                                max_num_seqs=config.max_num_seqs,
                                max_num_batched_tokens=config.max_num_batched_tokens,
                                enable_prefix_caching=spec.prefix_caching,
                                protect_on_admission=protective_admission(config.admission, spec.protects))
        self.num_blocks = max(1, config.capacity_tokens // bs)

        self.residency: list[Residency | None] = [None] * config.num_replicas

        def pool(i: int) -> BlockPool:
            ctx = PolicyContext(oracle, self.progress, lambda: self.now, i, self.num_blocks, bs)
            eviction = spec.eviction(ctx) if spec.eviction else None
            residency = self.residency[i] = getattr(eviction, "residency", None)
            # the ledger's miss reasons need tombstones (receipts then count evictions too)
            stones = Tombstones.for_pool(lambda: self.now, self.num_blocks) if config.ledger else None
            built = BlockPool(self.num_blocks, bs, eviction, stones)
            if residency is not None:
                residency.attach(built)  # receipts count resident blocks (evictions too with the ledger)
            return built

        def replica(i: int) -> Replica:
            built = pool(i)
            tiers = None
            if config.host_tokens or config.disk_tokens:
                tiers = sim_tiers(config.host_tokens, config.disk_tokens, bs, cost, built, lambda: self.now,
                                  lambda t: self._push(t, _TIER_DONE, i, 0))
                if self.residency[i] is not None:
                    self.residency[i].tiers = tiers  # type: ignore[union-attr]
            scheduler = Scheduler(sched, built, lower=tiers)
            ledger = None
            if config.ledger:  # the server's ledger, on virtual time (arrival_s = simulated seconds)
                ledger = Ledger(bs, "sim", clock=lambda: self.now, wall_clock=lambda: self.now, keep_tokens=False,
                                block_lives=False)
                ledger.attach(scheduler, tiers)
                ledger.on_row.append(self.ledger_rows.append)
            self.ledgers.append(ledger)
            return Replica(i, scheduler, cost, config.decode_runs, tiers, ledger, self._set_now)

        self.ledger_rows: list[Row] = []
        self.ledgers: list[Ledger | None] = []
        self.replicas = [replica(i) for i in range(config.num_replicas)]
        self.records: list[RequestRecord] = []
        self.jct: list[float] = []
        self.num_skipped = 0
        self.eligible = eligible_blocks(plan, starts)  # per chain, per turn: from the workload alone
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = itertools.count()
        self._prev: dict[int, list[int]] = {}  # chain -> block ids of its latest turn
        self._inflight: dict[RequestId, tuple[int, int, int, int, Request]] = {}
        self._parent = {child: (c.index, awaited) for c in plan.chains for t in c.turns
                        for _, awaited, child in t.subagents}
        self._awaiting = [0] * len(plan.chains)
        self._wait_end = [0.0] * len(plan.chains)
        self._origin = [0.0] * len(plan.chains)
        self._left = [0] * len(plan.sessions)  # requests not yet finished, per session
        for c in plan.chains:
            self._left[c.session] += len(c.turns)

    def _set_now(self, t: float) -> None:
        self.now = t

    def _push(self, t: float, kind: int, a: int, b: int) -> None:
        heapq.heappush(self._heap, (t, kind, next(self._seq), a, b))

    def run(self) -> None:
        for ci, start in zip(self.plan.sessions, self.starts):
            self._origin[ci] = start
            self._push(start, _ARRIVAL, ci, 0)
        # The residency policies' tick is an event of its own, after the steps that end at its
        # time; a decode run in flight is cut there (the tick changes what the pool protects, and
        # with tiers may prefetch into it), so runs and single steps take the same decisions.
        if any(x is not None for x in self.residency):
            self._push(min(self.starts, default=0.0), _EXPIRE, 0, 0)
        while self._heap:
            t, kind, _, a, b = heapq.heappop(self._heap)
            self.now = t
            if kind == _EXPIRE:
                self._expire(t)
                if self._heap:
                    self._push(t + _EXPIRE_EVERY_S, _EXPIRE, 0, 0)
                continue
            if kind == _ARRIVAL:
                self._submit(a, b, t)
                continue
            rep = self.replicas[a]
            if kind == _TIER_DONE:  # a disk job ended: queue the requests it read for
                end = rep.sync(t)
                if end is not None:
                    self._push(end, _STEP_END, rep.index, rep.generation)
                if rep.idle:
                    self._start(rep, t)
                continue
            if b != rep.generation:
                continue  # superseded: a decode run was cut short
            for o in rep.finish(t):
                if o.finished:
                    self._finished(o, t)
            self._start(rep, t)
        stuck = [r.index for r in self.replicas if r.scheduler.has_unfinished()]
        assert not stuck, f"replicas {stuck} still hold requests after the last event"

    def _expire(self, now: float) -> None:
        """The residency policies' periodic tick: it releases trajectories idle too long (with
        tiers it may also prefetch), which a decode run in flight must not see: such a run
        becomes an ordinary step first."""
        for rep, residency in zip(self.replicas, self.residency, strict=True):
            if residency is None:
                continue
            end = rep.sync(now)
            if end is not None:
                self._push(end, _STEP_END, rep.index, rep.generation)
            residency.expire()

    def _start(self, rep: Replica, now: float) -> None:
        end = rep.start(now)
        if end is not None:
            self._push(end, _STEP_END, rep.index, rep.generation)

    def _submit(self, c: int, j: int, now: float) -> None:
        chain = self.plan.chains[c]
        turn = chain.turns[j]
        if j == 0 and c in self._parent:
            self._origin[c] = now
        full = self._prev.get(c, [])[: turn.shared] + turn.new.tolist()
        self._prev[c] = full
        self.cursor[c] = j
        bs = self.plan.block_size
        if -(-(turn.prompt_tokens + turn.output_tokens) // bs) > self.num_blocks:
            self.num_skipped += 1
            self._turn_done(c, j, now, full)
            return
        e = self.eligible[c][j]
        req = Request(RequestId(f"{c}.{j}"), VirtualTokens(turn.prompt_tokens), turn.prompt_tokens,
                      SamplingParams(temperature=0.0, max_tokens=turn.output_tokens, ignore_eos=True),
                      _KEYS, now, block_hashes=full)
        r = self.router.pick(chain.session, self.replicas)
        rep = self.replicas[r]
        end = rep.sync(now)  # first the decode steps that ended before it arrived
        if end is not None:
            self._push(end, _STEP_END, r, rep.generation)
        residency = self.residency[r]
        if residency is not None:  # what a server sees: a request of this trajectory
            parent = self._parent.get(c)
            residency.on_request(_key(c), _key(parent[0]) if parent is not None and j == 0 else None)
        rep.scheduler.add(req)
        ledger = self.ledgers[r]
        if ledger is not None:
            parent = self._parent.get(c)
            ledger.bind(req, Tag(("sim", str(c)), str(chain.session), None if parent is None else str(parent[0]),
                                 "sim"))
        self.progress.sent(c, j, r)
        self._inflight[req.request_id] = (c, j, r, e * bs, req)
        if rep.idle:
            self._start(rep, now)

    def _finished(self, o: RequestOutput, now: float) -> None:
        c, j, r, eligible, req = self._inflight.pop(o.request_id)
        chain = self.plan.chains[c]
        self.records.append(RequestRecord(
            chain.session, c, j, r, req.arrival_time, o.first_token_time or now, now, o.num_prompt_tokens,
            o.num_reused_tokens, eligible, o.num_recomputed_tokens,
            o.num_generated_tokens, req.num_preemptions, o.num_host_tokens, o.num_disk_tokens))
        self._turn_done(c, j, now, req.block_hashes)

    def _turn_done(self, c: int, j: int, now: float, full: list[int]) -> None:
        chain = self.plan.chains[c]
        turn = chain.turns[j]
        self._responded(c, j, full)
        self.progress.finished(c, j, now)
        for delay, awaited, child in turn.subagents:
            self._push(now + delay, _ARRIVAL, child, 0)
            self.progress.scheduled(child, now + delay)
            self._awaiting[c] += awaited
        self._wait_end[c] = now
        if self._awaiting[c] == 0:
            self._next_turn(c, j + 1, now)
        self._left[chain.session] -= 1
        if self._left[chain.session] == 0:
            self.jct.append(now - self.starts[chain.session])
        if j + 1 == len(chain.turns):
            self._prev.pop(c, None)
            self._chain_done(c, now)

    def _responded(self, c: int, j: int, full: list[int]) -> None:
        """Tell the replica's residency policy what a server knows at a response: how it ended
        (tool calls, the end of the turn, or sub-agents it waits for) and the blocks a next turn
        would resend; with `--events terminal` also that the trajectory is done."""
        r = self.progress.replica[c]
        residency = self.residency[r] if r >= 0 else None
        if residency is None:
            return
        chain = self.plan.chains[c]
        if j + 1 == len(chain.turns) and self.config.events == "terminal":
            residency.on_end(_key(c), State.FINISHED)
            return
        turn = chain.turns[j]
        if any(awaited for _, awaited, _ in turn.subagents):
            state, cls = State.PAUSED_TOOL, "subagent"
        elif turn.stop is StopReason.END_TURN:
            state, cls = State.WAITING_HUMAN, "end_turn"
        else:
            state, cls = State.PAUSED_TOOL, turn.stop.value or "none"
        residency.on_response(_key(c), full, state, cls)

    def _chain_done(self, c: int, now: float) -> None:
        parent = self._parent.get(c)
        if parent is None or not parent[1]:
            return
        p = parent[0]
        self._awaiting[p] -= 1
        self._wait_end[p] = max(self._wait_end[p], now)
        if self._awaiting[p] == 0:
            self._next_turn(p, self.cursor[p] + 1, self._wait_end[p])

    def _next_turn(self, c: int, j: int, base: float) -> None:
        chain = self.plan.chains[c]
        if j >= len(chain.turns):
            return
        turn = chain.turns[j]
        if chain.timing is Timing.THINK:
            t = base + turn.think_s
        else:
            t = max(base, self._origin[c] + turn.offset_s)
        self._push(t, _ARRIVAL, c, j)
        self.progress.scheduled(c, t)
