"""The residency policy only changes which blocks are hit: greedy outputs of agent-like
trajectories under pool pressure equal transformers' own forward, with the policy on and off."""

from __future__ import annotations

import random

from agentserve.engine.request import SamplingParams
from agentserve.trajectory.registry import State, TrajectoryKey
from agentserve.trajectory.residency import ResidencyConfig, build_residency
from tests.model.hf_tiny import hf_greedy, tiny_engine


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def run_trajectories(mode: str, hf_check: bool):
    clock = Clock()
    num_blocks, bs = 32, 4
    # every paused trajectory may be protected: the pool must then evict protected blocks
    residency, eviction = build_residency(mode, num_blocks, bs, clock, ResidencyConfig(budget=1.0))
    engine, hf = tiny_engine(block_size=bs, num_blocks=num_blocks, eviction=eviction)
    if residency is not None:
        residency.attach(engine.scheduler.pool)
    rng = random.Random(7)
    vocab = engine.vocab_size
    system = [rng.randrange(vocab) for _ in range(12)]
    seqs = {n: system + [rng.randrange(vocab) for _ in range(6)] for n in range(8)}
    sampling = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outputs, reused = [], 0
    for turn in range(4):
        for n in rng.sample(sorted(seqs), len(seqs)):  # trajectories come back in shuffled order
            clock.t += rng.uniform(0.5, 20.0)
            key = TrajectoryKey("", f"t{n}")
            rid = engine.add(seqs[n], sampling)
            if residency is not None:
                residency.on_request(key)
            got, last = [], None
            while engine.has_unfinished():
                for o in engine.step():
                    got.extend(o.new_token_ids)
                    last = o
                engine.scheduler.pool.check()
            assert last is not None and last.finished and last.request_id == rid
            if hf_check:
                assert got == hf_greedy(hf, seqs[n], len(got)), (mode, turn, n)
            reused += last.num_reused_tokens
            if residency is not None:
                residency.on_response(key, last.block_hashes, State.PAUSED_TOOL, "tool" if n % 2 else "slow")
            outputs.append(got)
            seqs[n] = seqs[n] + got + [rng.randrange(vocab) for _ in range(3)]  # the tool result
    return outputs, reused, eviction


def test_greedy_outputs_equal_transformers_with_the_policy_on_and_off():
    off, reused_off, _ = run_trajectories("off", hf_check=True)
    on, reused_on, eviction = run_trajectories("on", hf_check=True)
    assert on == off
    assert eviction.num_protected_evictions > 0  # the pool was under pressure: the policy chose
    shadow, reused_shadow, _ = run_trajectories("shadow", hf_check=False)
    assert shadow == off and reused_shadow == reused_off  # shadow never changes the pool
