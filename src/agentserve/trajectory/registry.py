"""The trajectory registry: which agent trajectory a request belongs to, and where it stands.

Keyed by (tenant, id): the tenant is the cache salt today (an API key once keys exist), so one
tenant never sees or changes another's trajectory. A trajectory keeps the block hashes of its
last sequence (prompt + reply, what its next turn will resend), its state, when its latest
request and response were, and its parent when it is a sub-agent. No prompt text, tool
arguments or secrets are kept. Bounded: past `capacity` the least recently active trajectory
is dropped (its owner sees it as expired), and `expire` drops those idle past `max_idle_s`.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from agentserve.trajectory.receipts import CacheAdvice, DecisionReceipt

BlockHash = int


class State(enum.Enum):
    RUNNING = "running"  # a request of it is in flight
    PAUSED_TOOL = "paused_tool"  # its last response ended in tool calls
    WAITING_HUMAN = "waiting_human"  # its last response ended the turn
    FINISHED = "finished"
    CANCELLED = "cancelled"


PAUSED = (State.PAUSED_TOOL, State.WAITING_HUMAN)


class TrajectoryKey(NamedTuple):
    """A tuple: hashed in C, as every protected block's bookkeeping hashes it."""

    tenant: str
    id: str


@dataclass(slots=True)
class Trajectory:
    key: TrajectoryKey
    created_s: float
    state: State = State.RUNNING
    pause_class: str | None = None  # while paused: the class its return is predicted by
    hashes: tuple[BlockHash, ...] = ()  # its last sequence's full blocks, in order
    last_request_s: float | None = None
    last_response_s: float | None = None
    parent: TrajectoryKey | None = None
    num_requests: int = 0
    sessions: set[str] = field(default_factory=set)
    advice: CacheAdvice | None = None  # the latest, given at its latest pause
    receipts: deque[DecisionReceipt] = field(default_factory=lambda: deque(maxlen=8))  # the latest

    @property
    def paused(self) -> bool:
        return self.state in PAUSED


@dataclass(slots=True)
class TrajectoryRegistry:
    capacity: int = 100_000
    max_idle_s: float = 3_600.0
    _items: OrderedDict[TrajectoryKey, Trajectory] = field(default_factory=OrderedDict)
    num_dropped: int = 0  # over capacity
    num_expired: int = 0

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self._items.values())

    def get(self, key: TrajectoryKey) -> Trajectory | None:
        return self._items.get(key)

    def request(self, key: TrajectoryKey, now: float, parent: TrajectoryKey | None = None,
                session: str | None = None) -> tuple[Trajectory, list[Trajectory]]:
        """A request of this trajectory arrived: it runs. Returns it and any trajectories the
        registry dropped to stay within capacity (their owners must release them)."""
        t = self._items.get(key)
        dropped: list[Trajectory] = []
        if t is None:
            t = self._items[key] = Trajectory(key, now, parent=parent)
            while len(self._items) > self.capacity:
                _, old = self._items.popitem(last=False)
                self.num_dropped += 1
                dropped.append(old)
        else:
            self._items.move_to_end(key)
        t.state, t.pause_class = State.RUNNING, None
        t.last_request_s = now
        t.num_requests += 1
        if session is not None:
            t.sessions.add(session)
        return t, dropped

    def respond(self, key: TrajectoryKey, now: float, hashes: Sequence[BlockHash], state: State,
                pause_class: str | None) -> Trajectory | None:
        """Its response ended: paused on a tool (with a class), waiting for a human, or done."""
        t = self._items.get(key)
        if t is None:
            return None
        self._items.move_to_end(key)  # the order is by latest activity, for expire()
        t.hashes = tuple(hashes)
        t.last_response_s = now
        t.state = state
        t.pause_class = pause_class if state in PAUSED else None
        return t

    def end(self, key: TrajectoryKey, state: State) -> Trajectory | None:
        t = self._items.get(key)
        if t is not None:
            t.state, t.pause_class = state, None
        return t

    def expire(self, now: float) -> list[Trajectory]:
        """Drop trajectories idle past max_idle_s (oldest activity first); returns them."""
        out = []
        while self._items:
            key, t = next(iter(self._items.items()))
            last = max(x for x in (t.last_request_s, t.last_response_s, t.created_s) if x is not None)
            if now - last <= self.max_idle_s:
                break
            del self._items[key]
            self.num_expired += 1
            out.append(t)
        return out
