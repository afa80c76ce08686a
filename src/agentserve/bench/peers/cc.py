"""Claude Code sessions (../shared/traces/weka-claude-code/) scaled to run on two CPU cores.

The rule, fixed before any run (settings.yaml `workloads.cc`):
- tokens: every trace length is multiplied by `token_scale` (a 64-token block becomes
  round(64 * scale) tokens, `BlockTokens`); a turn's output is round(out * scale), at least 1
  and at most `max_output`; what a turn appends is its scaled prompt minus the previous scaled
  prompt and the previous scaled output (at least 1), so appended : output : context keep the
  trace's ratios;
- time: each think time (the gap before a turn) is multiplied by `time_scale`, at most
  `max_think_s`;
- which turns: per top-level session a window of `turns` consecutive turns in which every turn
  extends the previous prompt (all its full blocks shared) and whose scaled context starts at
  `min_context` tokens or more and ends at `max_context` or less; one window per session,
  picked with the seed; sessions in an order shuffled with the seed; level c replays the first c.
- contents: block ids -> token ids (`BlockTokens`, seeded by the seed and the level), so two
  levels run on one server share no tokens; sub-agents are not replayed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from agentserve.bench.peers.workloads import HIGH_ID, Script, Step, Workload
from agentserve.workload.claude_code import BLOCK_SIZE, read_claude_code
from agentserve.workload.model import AgentSession
from agentserve.workload.tokens import BlockTokens


@dataclass(frozen=True, slots=True)
class CCScale:
    token_scale: float
    time_scale: float
    max_think_s: float
    turns: int
    min_context: int
    max_context: int
    max_output: int
    seed: int

    def output(self, trace_out: int) -> int:
        return min(self.max_output, max(1, round(trace_out * self.token_scale)))

    def think(self, trace_think_s: float) -> float:
        return min(self.max_think_s, trace_think_s * self.time_scale)


def windows(session: AgentSession, cfg: CCScale, tokens: BlockTokens) -> list[int]:
    """Start indices of the session's windows that the rule allows."""
    turns = session.turns
    extends = [j > 0 and turns[j].shared_blocks == turns[j - 1].num_blocks for j in range(len(turns))]
    out = []
    for s in range(len(turns) - cfg.turns + 1):
        if not all(extends[s + 1: s + cfg.turns]):
            continue
        if tokens.scaled(turns[s].prompt_tokens) < cfg.min_context:
            continue
        if tokens.scaled(turns[s + cfg.turns - 1].prompt_tokens) > cfg.max_context:
            continue
        out.append(s)
    return out


def scale_window(session: AgentSession, start: int, cfg: CCScale, tokens: BlockTokens) -> tuple[Step, ...]:
    """The window's turns as steps: the first sends its whole scaled prompt, later ones append."""
    hashes = list(session.block_hashes())
    steps: list[Step] = []
    prev_len = prev_out = 0
    for j in range(start, start + cfg.turns):
        t = session.turns[j]
        ids = tokens.prompt(session.namespace, hashes[j], t.prompt_tokens, (session.session_id, j))
        n_out = cfg.output(t.output_tokens)
        if j == start:
            steps.append(Step(tuple(ids), n_out))
        else:
            begin = min(prev_len + prev_out, len(ids) - 1)
            steps.append(Step(tuple(ids[begin:]), n_out, cfg.think(t.think_s)))
        prev_len, prev_out = len(ids), n_out
    return tuple(steps)


def trace_files(trace_dir: Path, parity: str, max_files: int) -> list[Path]:
    want = 0 if parity == "even" else 1
    files = sorted(p for p in trace_dir.glob("trace_*.json*") if int(p.name[6:10]) % 2 == want)
    return files[:max_files]


def cc_workload(trace_dir: Path, cfg: CCScale, level: int, parity: str = "even", max_files: int = 120) -> Workload:
    tokens = BlockTokens(HIGH_ID, BLOCK_SIZE, cfg.token_scale, seed=cfg.seed * 1000 + level)
    shape = BlockTokens(HIGH_ID, BLOCK_SIZE, cfg.token_scale, seed=cfg.seed)  # windows do not depend on level
    rng = random.Random(f"cc-{cfg.seed}")
    candidates = []
    for session in read_claude_code(trace_files(trace_dir, parity, max_files)).sessions:
        starts = windows(session, cfg, shape)
        if starts:
            candidates.append((session, rng.choice(starts)))
    rng.shuffle(candidates)
    if len(candidates) < level:
        raise ValueError(f"only {len(candidates)} sessions in {trace_dir} fit the CC rule; level {level} needs more")
    scripts = tuple(Script(f"{Path(s.session_id).name}@{start}", scale_window(s, start, cfg, tokens))
                    for s, start in candidates[:level])
    final = sum(sum(len(st.append) for st in sc.steps) + sum(st.max_tokens for st in sc.steps[:-1]) for sc in scripts)
    return Workload(f"cc-c{level}", "cc", scripts,
                    f"{level} Claude Code sessions x {cfg.turns} turns, tokens x{cfg.token_scale:g}, "
                    f"think x{cfg.time_scale:g} (<= {cfg.max_think_s:g} s); final contexts {final} tokens in all")
