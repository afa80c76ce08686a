"""The server and the simulator take the same decisions for the same event sequence: one
scripted sequence of requests, responses (tool calls or answers) and lifecycle events, fed once
through the server's glue (server/trajectories.py on a policy built as `LLM(residency="on")`
builds it) and once the way the simulator's fleet feeds the policy it builds for
`--policy agent`, over the same pool operations. Every advice and every eviction must match."""

from __future__ import annotations

import random
from dataclasses import dataclass

from agentserve.engine.request import FinishReason
from agentserve.kv.block_pool import BlockPool
from agentserve.server.metrics import Metrics
from agentserve.server.protocol import AgentHints
from agentserve.server.trajectories import Identity, Trajectories
from agentserve.sim.policies import PolicyContext, get_policy
from agentserve.trajectory.events import Event
from agentserve.trajectory.registry import State, TrajectoryKey
from agentserve.trajectory.residency import build_residency

NUM_BLOCKS, BS = 48, 16


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass(frozen=True)
class Out:  # the fields of a RequestOutput the server's glue reads
    block_hashes: tuple[int, ...]
    num_prompt_tokens: int
    finish_reason: FinishReason = FinishReason.STOP


def script(seed: int):
    rng = random.Random(seed)
    seqs = {f"t{i}": [1000 * i + j for j in range(rng.randrange(2, 6))] for i in range(8)}
    steps = []
    for _ in range(60):
        who = rng.choice(sorted(seqs))
        dt = rng.choice([0.5, 2.0, 9.0, 40.0, 200.0])
        seqs[who] = seqs[who] + [seqs[who][-1] * 7 + k for k in range(1, rng.randrange(2, 5))]
        tool = rng.random() < 0.7
        steps.append((dt, who, list(seqs[who]), tool))
        if rng.random() < 0.1:
            steps.append((0.1, who, None, Event.TRAJECTORY_FINISHED))
            seqs[who] = seqs[who][:2]
    return steps


def run(steps, frontend: str):
    clock = Clock()
    if frontend == "server":
        residency, eviction = build_residency("on", NUM_BLOCKS, BS, clock)
        glue = Trajectories(residency, "on", Metrics())
    else:
        eviction = get_policy("agent").eviction(PolicyContext(lambda: None, None, clock, 0, NUM_BLOCKS, BS))
        residency = eviction.residency
    pool = BlockPool(NUM_BLOCKS, BS, eviction)
    residency.attach(pool)
    residency.log = []
    for dt, who, hashes, what in steps:
        clock.t += dt
        key = TrajectoryKey("", who)
        if isinstance(what, Event):
            residency.on_event(key, what)
            continue
        if frontend == "server":
            glue.then(None, Identity("", who, "trajectory_id"))("req")  # type: ignore[arg-type]
        else:
            residency.on_request(key)
        hit = pool.match_prefix(hashes)
        pool.lock(hit)
        new = pool.allocate(min(len(hashes) - len(hit), pool.num_free_blocks))
        blocks = hit + new
        pool.insert_many(new, hashes[len(hit):len(blocks)])
        done = tuple(hashes[:len(blocks)])
        clock.t += 0.05
        if frontend == "server":
            calls = ["bash"] if what else []
            glue._respond(key, Out(done, max(0, len(done) - 1) * BS), calls, AgentHints())
        else:  # the fleet: stop reason tool_use -> paused on its class, end_turn -> waiting for a human
            state, cls = (State.PAUSED_TOOL, "bash") if what else (State.WAITING_HUMAN, "human")
            residency.on_response(key, done, state, cls, None, len(done) - 1)
        pool.free(list(reversed(blocks)))
        pool.check()
    return residency.log, sorted(pool.index.items())


def test_server_and_simulator_take_the_same_decisions():
    for seed in range(3):
        steps = script(seed)
        server_log, server_pool = run(steps, "server")
        sim_log, sim_pool = run(steps, "sim")
        assert sum(d[1] == "evict" for d in server_log) > 5  # under pressure: the order decided
        assert server_log == sim_log
        assert server_pool == sim_pool
