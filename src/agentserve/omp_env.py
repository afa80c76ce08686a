"""OpenMP wait settings, chosen per command before torch loads (torch's threads are libgomp's).

At the end of each parallel op an idle OpenMP thread either spins, ready for the next op, or
sleeps and must be woken by a futex at the next one. A decode step is ~120 short parallel ops
(SmolLM2: four matmuls and an attention a layer), so the choice sets the step time. Measured
here (2026-12-03; the table and commands are in docs/benchmarks.md, "OpenMP's wait"): agent-4x6
served took 25.9-26.0 s quiet and 45 s with one core busy at spin 10,000, against 25.7-26.5 s
and more than 240 s at libgomp's default (spin 300,000), and 39 s busy when sleeping.

libgomp's default spin turns one busy core into 15-25x slower steps (the waiting thread burns
its slice while the one it waits for cannot run); sleeping costs a futex wake per op. A short
bounded spin keeps the workers hot within a step and lets them sleep between steps and when the
machine is busy: 10,000 spins lose nothing on a quiet machine and stay within 1.15x of sleeping
on a busy one. So `serve` spins 10,000; offline commands (tests, benchmarks' own processes, the
simulator) sleep. Either variable set by the user wins.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # either one set by the user: nothing is changed
SERVE = {"GOMP_SPINCOUNT": "10000"}
OFFLINE = {"OMP_WAIT_POLICY": "PASSIVE"}
MARK = "AGENTSERVE_OMP_DEFAULTED"  # names the keys set here, so a server started from a command gets its own


def apply(env: MutableMapping[str, str], serving: bool) -> None:
    """Sets the command's default in env (os.environ, before torch is imported) unless the user
    set a wait setting; records which keys were set under MARK."""
    if any(k in env for k in USER_KEYS):
        return
    chosen = SERVE if serving else OFFLINE
    env.update(chosen)
    env[MARK] = ",".join(chosen)


def for_server(env: Mapping[str, str]) -> dict[str, str]:
    """The environment for an `agentserve serve` subprocess started by an offline command: the
    keys the command defaulted for itself are dropped (the server then applies its own); the
    user's own settings pass through."""
    defaulted = set(env.get(MARK, "").split(",")) - {""}
    return {k: v for k, v in env.items() if k not in defaulted and k != MARK}
