from __future__ import annotations

from pathlib import Path

import pytest

from agentserve.sim.cost import Linear
from agentserve.workload.model import AgentSession, Timing, Turn, Workload

FIXTURES = Path(__file__).parent.parent / "fixtures" / "traces"
UNIT_STEP = Linear("unit-step", 1.0, 0.0, 0.0, 0.0)  # every step takes 1 s, whatever it holds


def session(sid: str, ns: int, turns: list[tuple[float, int, list[int]]]) -> AgentSession:
    """turns: (think_s, prompt_tokens, prompt block hashes); one output token each. Trace
    offsets are those of 1 s turns (UNIT_STEP) with no queueing."""
    out, prev, offset = [], [], 0.0
    for j, (think, n, hashes) in enumerate(turns):
        shared = 0
        while shared < min(len(prev), len(hashes)) and prev[shared] == hashes[shared]:
            shared += 1
        offset += (1.0 + think) if j else 0.0
        out.append(Turn(offset, think, n, 1, shared, tuple(hashes[shared:])))
        prev = hashes
    return AgentSession(sid, ns, tuple(out), Timing.THINK)


@pytest.fixture
def three_sessions() -> Workload:
    """Block size 4; each turn is one step of 1 s. See test_hand_computed_three_sessions."""
    return Workload("three", 4, (
        session("S0", 1, [(0, 8, [1, 2]), (10, 12, [1, 2, 3])]),
        session("S1", 2, [(0, 8, [1, 2]), (10, 8, [1, 2])]),
        session("S2", 3, [(0, 8, [1, 2]), (10, 8, [1, 2])]),
    ))
