"""Reference cache policies, chosen by name. A policy decides whether the prefix cache is on and
which free cached block to evict; later issues add their own specs to `POLICIES`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agentserve.kv.block_pool import EvictionPolicy, LruEviction
from agentserve.sim.oracle import BeladyEviction, Forecast, NextUse
from agentserve.sim.progress import Progress
from agentserve.trajectory.residency import AgentEviction, build_residency


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy may look at when it is built for one replica of one run."""

    oracle: Callable[[], NextUse]  # built on first use (it reads the whole plan)
    progress: Progress  # where each chain stands (the simulator updates it)
    clock: Callable[[], float]
    replica: int  # the replica whose pool this policy serves
    num_blocks: int  # of that pool
    block_size: int


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    description: str
    prefix_caching: bool
    eviction: Callable[[PolicyContext], EvictionPolicy] | None  # None: no prefix cache
    protects: bool = False  # keeps some free blocks back (admission `auto` is protective then)


POLICIES: tuple[PolicySpec, ...] = (
    PolicySpec("none", "no prefix cache: every prompt token is computed", False, None),
    PolicySpec("lru", "prefix cache, least recently freed block evicted first (vLLM, SGLang default)",
               True, lambda ctx: LruEviction()),
    PolicySpec("belady", "offline oracle: evict the block whose next use is farthest away",
               True, lambda ctx: BeladyEviction(Forecast(ctx.oracle(), ctx.progress, ctx.replica), ctx.clock)),
    PolicySpec("agent", "agent-aware residency: paused trajectories kept by expected value (trajectory/)",
               True, lambda ctx: _agent(ctx), protects=True),
)


def _agent(ctx: PolicyContext) -> AgentEviction:
    """The server's `--residency on`, built by the same function (trajectory/residency.py)."""
    _, eviction = build_residency("on", ctx.num_blocks, ctx.block_size, ctx.clock)
    assert eviction is not None
    return eviction


def get_policy(name: str) -> PolicySpec:
    for p in POLICIES:
        if p.name == name:
            return p
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(p.name for p in POLICIES)}")
