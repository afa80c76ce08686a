"""Routing policies for the simulated fleet: pick a replica for each request. Scorers with
weights (the gateway's cache-aware routing) come later; these are the baselines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from agentserve.sim.replica import Replica


class Router(Protocol):
    name: str

    def pick(self, session: int, replicas: Sequence[Replica]) -> int: ...

    def home(self, session: int, num_replicas: int) -> int | None:
        """The replica every request of this session goes to, where the router fixes it."""
        ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, session: int, replicas: Sequence[Replica]) -> int:
        i, self._next = self._next % len(replicas), self._next + 1
        return i

    def home(self, session: int, num_replicas: int) -> int | None:
        return None


class SessionHash:
    """Every request of a session (sub-agents included) to one replica: a multiplicative hash
    of the session index, so neighbouring sessions spread out."""

    name = "session-hash"

    def pick(self, session: int, replicas: Sequence[Replica]) -> int:
        return (session * 2654435761) % (1 << 32) % len(replicas)

    def home(self, session: int, num_replicas: int) -> int | None:
        return (session * 2654435761) % (1 << 32) % num_replicas


class LeastLoaded:
    """Fewest unfinished requests; the lowest index among ties."""

    name = "least-loaded"

    def pick(self, session: int, replicas: Sequence[Replica]) -> int:
        return min(range(len(replicas)), key=lambda i: (replicas[i].load, i))

    def home(self, session: int, num_replicas: int) -> int | None:
        return None


def make_router(name: str) -> Router:
    routers: dict[str, type[RoundRobin] | type[SessionHash] | type[LeastLoaded]] = {
        "round-robin": RoundRobin, "session-hash": SessionHash, "least-loaded": LeastLoaded}
    if name not in routers:
        raise ValueError(f"unknown router {name!r}; known: {', '.join(routers)}")
    return routers[name]()
