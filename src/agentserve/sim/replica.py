"""One simulated replica: the engine's Scheduler over a BlockPool, stepped in virtual time.

A step is schedule() at its start, then update() at its end (start + the cost model's time);
requests arriving in between wait for the next schedule(), as on a server. When the next steps
are pure decode (engine/decode_run.py) the replica takes them as one decode run: it precomputes
each step's end time and applies them all at the run's end, or, when a request arrives first,
applies those finished by then and turns the one in progress into an ordinary step, so the
records equal those of stepping one by one (times to float rounding: a run's time is summed in
closed form). For that, a run's block operations happen with the simulator's clock set to the
times their single steps would have read (`set_clock`): an eviction policy may rank by time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from agentserve.engine.request import RequestOutput
from agentserve.engine.scheduler import Batch, Scheduler
from agentserve.engine.tiers import KvTiers
from agentserve.ledger.ledger import Ledger
from agentserve.sim.cost import CostModel, batch_shape, step_time

SAMPLED_TOKEN = 0  # what every simulated step samples: never a stop token (ignore_eos, no stop ids)


@dataclass(slots=True)
class ReplicaStats:
    busy_s: float = 0.0
    num_steps: int = 0
    num_decode_runs: int = 0


class Replica:
    def __init__(self, index: int, scheduler: Scheduler, cost: CostModel, decode_runs: bool = True,
                 tiers: KvTiers | None = None, ledger: Ledger | None = None,
                 set_clock: Callable[[float], None] | None = None) -> None:
        self.index = index
        self.scheduler = scheduler
        self.tiers = tiers  # the server's KvTiers over simulated stores (sim/tiers.py)
        self.ledger = ledger  # the server's ledger: each step's time split among its requests
        self.cost = cost
        self.decode_runs = decode_runs
        self.set_clock = set_clock  # moves the clock the policies read (the fleet's now)
        self.stats = ReplicaStats()
        self.generation = 0  # bumped when the end of the work in flight moves (stale events)
        self._batch: Batch | None = None  # the ordinary step in flight
        self._run: tuple[int, int, int] | None = None  # decode run in flight: (seqs, ctx0, steps)
        self._start = 0.0  # when the step or run in flight began

    @property
    def idle(self) -> bool:
        return self._batch is None and self._run is None

    @property
    def load(self) -> int:
        s = self.scheduler
        return len(s.running) + len(s.waiting)

    def start(self, now: float) -> float | None:
        """Begin the next step or decode run; its end time, or None when there is nothing to do."""
        assert self.idle
        sch = self.scheduler
        if self.tiers is not None:
            self.tiers.apply_loads(sch)
        if not sch.has_unfinished():
            return None
        k = sch.decode_horizon() if self.decode_runs else 0
        self._start = now
        if k >= 2:
            running = sch.running
            self._run = (len(running), sum(q.num_computed_tokens for q in running) + len(running), k)
            return self._run_end(k)
        batch = sch.schedule(now)
        if not batch.chunks and self.tiers is not None and sch.num_loading():
            self._step_time(batch)  # host runs of requests that started loading
            return None  # only requests whose disk reads are in flight: woken when one ends
        assert batch.chunks, "unfinished requests but nothing to schedule"
        self._batch = batch
        return now + self._step_time(batch)

    def _step_time(self, batch: Batch) -> float:
        """The step's time; with tiers, the restores it copies in first and the forward rate
        the advice measures."""
        t = self._forward_time(batch)
        if self.ledger is not None:
            self.ledger.on_step(batch, t)
        return t

    def _forward_time(self, batch: Batch) -> float:
        tiers = self.tiers
        if tiers is None:
            return step_time(self.cost, batch_shape(batch))
        moved = 0
        if batch.restores:
            tiers.restore(batch.restores)
            moved = sum(len(r.block_ids) for r in batch.restores) * tiers.mover.block_nbytes
        for request in self.scheduler.take_started():
            tiers.on_started(request.block_hashes[: request.num_cached_blocks])
        t = step_time(self.cost, replace(batch_shape(batch), kv_bytes_moved=moved))
        tiers.timed_step(batch.num_tokens, t)
        return t

    def _offload(self) -> None:
        if self.tiers is not None:
            for request in self.scheduler.take_finished():
                if request.final_block_hashes:
                    self.tiers.offload(request.final_block_hashes, request.extra_keys)

    def _run_end(self, j: int) -> float:
        """End of step j-1 of the run in flight (its start for j = 0)."""
        assert self._run is not None
        seqs, ctx0, _ = self._run
        return self._start + self.cost.decode_run_time(seqs, ctx0, j)

    def finish(self, now: float) -> list[RequestOutput]:
        """End the step or decode run in flight (at its end time)."""
        self.stats.busy_s += now - self._start
        if self._run is not None:
            if self.ledger is not None:
                self.ledger.on_decode_run([r.request_id for r in self.scheduler.running], now - self._start)
            k = self._run[2]
            self.stats.num_steps += k
            self.stats.num_decode_runs += 1
            outputs = self._decode_ahead(k, now)
            self._run = None
            self._offload()
            return outputs
        batch, self._batch = self._batch, None
        assert batch is not None
        self.stats.num_steps += 1
        sampled = {c.request_id: SAMPLED_TOKEN for c in batch.chunks if c.sample}
        outputs = self.scheduler.update(batch, sampled, now)
        self._offload()
        return outputs

    def sync(self, now: float) -> float | None:
        """Before something changes this replica at `now`: if a decode run is in flight, apply
        the steps that ended by now and make the step in progress an ordinary one. Returns its
        end time (the run's end event is stale: generation moved), or None if nothing moved."""
        if self._run is None:
            return None
        k = self._run[2]
        lo, hi = 0, k - 1  # j = steps ending at or before now (step ends precede arrivals)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._run_end(mid) <= now:
                lo = mid
            else:
                hi = mid - 1
        j = lo
        assert self._run_end(k) > now, "a decode run past its end was not finished"
        if self.ledger is not None:
            self.ledger.on_decode_run([r.request_id for r in self.scheduler.running], self._run_end(j) - self._start)
        if j:
            self._decode_ahead(j, now)
            self.stats.num_steps += j
            self._offload()
        start = self._run_end(j)
        self.stats.busy_s += start - self._start
        self._run, self._start = None, start
        self._clock(start)  # the step in progress was scheduled at its start
        self._batch = self.scheduler.schedule(start)
        self.generation += 1
        end = start + self._step_time(self._batch)
        self._clock(now)
        return end

    def _clock(self, t: float) -> None:
        if self.set_clock is not None:
            self.set_clock(t)

    def _decode_ahead(self, num_steps: int, now: float) -> list[RequestOutput]:
        """The run in flight's first num_steps steps, each block operation at its step's time;
        the clock is back at `now` after."""
        outputs = self.scheduler.decode_ahead(num_steps, SAMPLED_TOKEN,
                                              None if self.set_clock is None else lambda j: self._clock(self._run_end(j)))
        self._clock(now)
        return outputs
