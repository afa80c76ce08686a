"""The Claude Code scaling rule: tokens x scale, output and appends keep their ratios, think times
x time scale with a cap, windows only where every turn extends the previous prompt."""

from __future__ import annotations

from agentserve.bench.peers.cc import CCScale, scale_window, windows
from agentserve.bench.peers.workloads import HIGH_ID
from agentserve.workload.model import AgentSession, Turn
from agentserve.workload.tokens import BlockTokens

CFG = CCScale(token_scale=1 / 32, time_scale=0.125, max_think_s=4.0, turns=3, min_context=100,
              max_context=400, max_output=64, seed=3)
TOKENS = BlockTokens(HIGH_ID, 64, CFG.token_scale, seed=3)


def _session() -> AgentSession:
    # prompts 3,200 / 4,800 / 6,400 / 8,000 trace tokens; each extends the one before except turn 4
    turns = (Turn(0, 0.0, 3200, 320, 0, tuple(range(50))),
             Turn(0, 16.0, 4800, 64, 50, tuple(range(50, 75))),
             Turn(0, 80.0, 6400, 640, 75, tuple(range(75, 100))),
             Turn(0, 8.0, 8000, 32, 10, tuple(range(1000, 1115))))
    return AgentSession("s", 1, turns)


def test_output_and_think_scaling() -> None:
    assert CFG.output(320) == 10 and CFG.output(10) == 1 and CFG.output(10_000) == 64
    assert CFG.think(16.0) == 2.0 and CFG.think(80.0) == 4.0  # 10 s capped at 4


def test_windows_need_extension_and_bounds() -> None:
    s = _session()
    # window [0..2]: starts at 3200/32 = 100 >= 100 and ends at 6400/32 = 200 <= 400; [1..3] breaks
    assert windows(s, CFG, TOKENS) == [0]
    assert windows(s, CCScale(**{**_fields(CFG), "min_context": 101}), TOKENS) == []


def _fields(c: CCScale) -> dict[str, object]:
    return {f: getattr(c, f) for f in c.__slots__}  # type: ignore[attr-defined]


def test_appends_are_the_scaled_growth_minus_the_scaled_output() -> None:
    steps = scale_window(_session(), 0, CFG, TOKENS)
    assert [len(s.append) for s in steps] == [100, 150 - 100 - 10, 200 - 150 - 2]
    assert [s.max_tokens for s in steps] == [10, 2, 20]
    assert [s.think_s for s in steps] == [0.0, 2.0, 4.0]
    # the first prompt is the trace's blocks mapped to ids: the same hashes, the same ids
    assert list(steps[0].append) == TOKENS.prompt(1, list(range(50)), 3200, ("s", 0))
    assert scale_window(_session(), 0, CFG, TOKENS) == steps
