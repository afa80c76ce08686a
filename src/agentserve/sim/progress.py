"""Where every chain stands in a run: written by the fleet, read by the oracle.

The fleet keeps these arrays current at each arrival and each finished turn, so the oracle
predicts next uses from the run's own times rather than the trace's nominal ones.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from agentserve.sim.plan import Plan

NAN = float("nan")


@dataclass(slots=True)
class Progress:
    # per chain, all indexed by chain index:
    turn: array  # "l": earliest turn not finished (in flight or next to send); len(turns): done
    at: array  # "d": when that turn arrives or arrived; NaN while unknown (a sub-agent not yet
    #            spawned, a parent waiting on the sub-agents it awaits)
    ended: array  # "d": when the chain's previous turn ended
    replica: array  # "l": replica its requests go to (the router's fixed choice, else the latest
    #                 one); -1 while unknown

    @classmethod
    def start(cls, plan: Plan, starts: Sequence[float], homes: Sequence[int]) -> Progress:
        """Before the run: sessions start at `starts`; homes[c] is chain c's fixed replica or -1."""
        n = len(plan.chains)
        p = cls(array("l", [0]) * n, array("d", [NAN]) * n, array("d", [0.0]) * n,
                array("l", homes))
        for ci, start in zip(plan.sessions, starts):
            p.at[ci] = start
        return p

    def scheduled(self, c: int, t: float) -> None:
        """Chain c's next turn (turn[c]) arrives at t."""
        self.at[c] = t

    def sent(self, c: int, j: int, replica: int) -> None:
        assert self.turn[c] == j, (c, j, self.turn[c])
        self.replica[c] = replica

    def finished(self, c: int, j: int, now: float) -> None:
        """Turn j of chain c ended at now; its next turn's arrival is not known yet."""
        self.turn[c] = j + 1
        self.ended[c] = now
        self.at[c] = NAN
