"""A seeded synthetic agent workload. Defaults are fitted to the Claude Code traces
(`fit_synthetic` on ../shared/traces/weka-claude-code, 710 sessions; see docs/sim.md).

A session's turn j+1 prompt is turn j's prompt + its reply + an appended piece (a tool result,
or a human message), so it shares every full block of turn j's prompt. The gap before a turn is
drawn from its tool class (the traces name no tools: classes are bands of the measured tool
gap, fitted separately) or from the human gap. After a turn, sub-agents may fan out; the
parent's next turn waits for them.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

from agentserve.workload.model import AgentSession, InputType, StopReason, SubAgent, Timing, Turn, Workload


@dataclass(frozen=True, slots=True)
class LogNormal:
    median: float
    sigma: float

    def sample(self, rng: random.Random) -> float:
        return self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))

    @staticmethod
    def fit(values: list[float]) -> LogNormal:
        """From the median and the 90th percentile (robust to the long tails of gaps)."""
        v = sorted(x for x in values if x > 0)
        if not v:
            return LogNormal(1.0, 0.0)
        p50, p90 = v[len(v) // 2], v[min(len(v) - 1, int(0.9 * len(v)))]
        return LogNormal(p50, max(0.0, math.log(p90 / p50) / 1.2816))


@dataclass(frozen=True, slots=True)
class ToolClass:
    name: str
    weight: float  # share of tool-result turns
    gap: LogNormal  # seconds


@dataclass(frozen=True, slots=True)
class SyntheticConfig:
    num_sessions: int = 100
    block_size: int = 64
    turns: LogNormal = LogNormal(45.0, 0.97)
    first_prompt: LogNormal = LogNormal(24522.0, 1.84)
    appended: LogNormal = LogNormal(360.0, 1.71)  # beyond the previous prompt and its reply
    output: LogNormal = LogNormal(216.0, 1.11)
    human_turn_share: float = 0.134
    human_gap: LogNormal = LogNormal(122.0, 1.97)
    tool_classes: tuple[ToolClass, ...] = (
        ToolClass("fast", 0.763, LogNormal(7.0, 0.59)),  # gap <= 20 s: reads, searches, edits
        ToolClass("medium", 0.164, LogNormal(38.0, 0.66)),  # 20-120 s: builds, tests
        ToolClass("slow", 0.073, LogNormal(248.0, 1.41)),  # > 120 s: long runs, approvals
    )
    subagent_share: float = 0.00077  # turns followed by a fan-out of sub-agents
    fanout_mean: float = 1.66  # sub-agents per fan-out
    subagent_turns: LogNormal = LogNormal(11.0, 0.34)
    subagent_first_prompt: LogNormal = LogNormal(10335.0, 0.13)
    max_prompt_tokens: int = 900_000

    def __post_init__(self) -> None:
        if self.num_sessions < 1 or self.block_size < 1:
            raise ValueError("num_sessions and block_size must be >= 1")
        if abs(sum(c.weight for c in self.tool_classes) - 1.0) > 1e-6:
            raise ValueError("tool class weights must sum to 1")


@dataclass(slots=True)
class _Gen:
    cfg: SyntheticConfig
    rng: random.Random
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def session(self, sid: str, ns: int, n_turns: int, first: int, agent_type: str | None) -> AgentSession:
        cfg, rng = self.cfg, self.rng
        turns: list[Turn] = []
        prompt, hashes = first, [next(self.ids) for _ in range(first // cfg.block_size)]
        t = 0.0
        for j in range(n_turns):
            out = max(1, round(cfg.output.sample(rng)))
            itype, think, tool = InputType.TEXT, 0.0, None
            if j:
                itype, think, tool = self._gap()
                keep = len(hashes)
                prompt = min(cfg.max_prompt_tokens, prompt + turns[-1].output_tokens + round(cfg.appended.sample(rng)))
                hashes = hashes + [next(self.ids) for _ in range(prompt // cfg.block_size - keep)]
                t += think
            last = j == n_turns - 1
            subs = () if last or agent_type or rng.random() >= cfg.subagent_share else self._fanout(ns, sid, j)
            shared = min(len(turns[-1].new_hashes) + turns[-1].shared_blocks, len(hashes)) if j else 0
            turns.append(Turn(t, think, prompt, out, shared, tuple(hashes[shared:]), itype,
                              StopReason.END_TURN if last else StopReason.TOOL_USE, tool, subs))
        return AgentSession(sid, ns, tuple(turns), Timing.THINK, None, agent_type)

    def _gap(self) -> tuple[InputType, float, str | None]:
        cfg, rng = self.cfg, self.rng
        if rng.random() < cfg.human_turn_share:
            return InputType.TEXT, cfg.human_gap.sample(rng), None
        c = rng.choices(cfg.tool_classes, weights=[c.weight for c in cfg.tool_classes])[0]
        return InputType.TOOL_RESULT, c.gap.sample(rng), c.name

    def _fanout(self, ns: int, sid: str, j: int) -> tuple[SubAgent, ...]:
        cfg, rng = self.cfg, self.rng
        n = 1 + sum(1 for _ in range(20) if rng.random() < (cfg.fanout_mean - 1) / 20)
        return tuple(SubAgent(0.0, True, self.session(
            f"{sid}/t{j}.{k}", ns, max(1, round(cfg.subagent_turns.sample(rng))),
            max(1, round(cfg.subagent_first_prompt.sample(rng))), "subagent")) for k in range(n))


def synthetic_workload(cfg: SyntheticConfig, seed: int) -> Workload:
    gen = _Gen(cfg, random.Random(seed))
    sessions = []
    for i in range(cfg.num_sessions):
        n_turns = max(1, round(cfg.turns.sample(gen.rng)))
        first = min(cfg.max_prompt_tokens, max(1, round(cfg.first_prompt.sample(gen.rng))))
        sessions.append(gen.session(f"synthetic-{seed}-{i}", i + 1, n_turns, first, None))
    return Workload(f"synthetic(seed={seed})", cfg.block_size, tuple(sessions))
