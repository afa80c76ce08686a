"""The table's workloads by name, built from settings.yaml (and `--quick`'s smaller versions).

`--quick` keeps every workload's shape and shrinks it for a smoke run: long prompts at an
eighth of their length, agent-4x6 with 0.5 s think time, fan-out on a 500-token prefix,
Claude Code windows of 3 turns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from agentserve.bench.peers.cc import CCScale, cc_workload
from agentserve.bench.peers.settings import Settings
from agentserve.bench.peers.workloads import Workload, agent_4x6, agent_like, fanout, long_prompt

LONG = {"long-2k": 2048, "long-8k": 8192, "long-16k": 16384}


@dataclass(frozen=True, slots=True)
class Inputs:
    agent_4x6: Path  # ../shared/bench/agent-4x6.json
    cc_traces: Path  # ../shared/traces/weka-claude-code/

    @classmethod
    def under(cls, shared: Path) -> Inputs:
        return cls(shared / "bench" / "agent-4x6.json", shared / "traces" / "weka-claude-code")


def names(settings: Settings) -> list[str]:
    return [w for g in settings.groups for w in g.workloads]


def cc_scale(settings: Settings, quick: bool) -> CCScale:
    c = settings.workloads["cc"]
    return CCScale(float(c["token_scale"]), float(c["time_scale"]), float(c["max_think_s"]),
                   3 if quick else int(c["turns"]), int(c["min_context"]), int(c["max_context"]),
                   int(c["max_output"]), int(c["seed"]))


def build(name: str, settings: Settings, inputs: Inputs, quick: bool = False) -> Workload:
    w = settings.workloads
    if name == "agent-4x6":
        a = w["agent-4x6"]
        return agent_4x6(inputs.agent_4x6, tuple(a["sets"]), 0.5 if quick else float(a["think_s"]),
                         int(a["max_tokens"]))
    if name in LONG:
        n = LONG[name] // 8 if quick else LONG[name]
        return long_prompt(n, int(w["long"]["seed"]), int(w["long"]["rerun_tokens"]))
    if name == "fanout":
        f = w["fanout"]
        return fanout(int(f["seed"]), 500 if quick else int(f["prefix_tokens"]), int(f["children"]),
                      int(f["child_tokens"]), int(f["max_tokens"]))
    if name.startswith("cc-c"):
        c = w["cc"]
        return cc_workload(inputs.cc_traces, cc_scale(settings, quick), int(name[4:]), str(c["files"]))
    if name == "calibration-pressured":  # the sweep's KV-pressured half: sessions the table never uses
        k = dict(settings.calibration["pressured"]["workload"])  # type: ignore[call-overload,index]
        return replace(cc_workload(inputs.cc_traces, cc_scale(settings, quick), int(k["level"]), str(k["files"])),
                       name=name)
    if name == "calibration":
        k = dict(settings.calibration["workload"])  # type: ignore[call-overload]
        return agent_like(int(k["seed"]), int(k["sessions"]), 3 if quick else int(k["turns"]),
                          int(k["prefix_tokens"]), int(k["task_tokens"]), int(k["result_tokens"]),
                          int(k["max_tokens"]), float(k["think_s"]))
    raise KeyError(f"unknown workload {name!r}; known: {', '.join(names(settings))}")
