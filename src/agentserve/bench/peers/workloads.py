"""The benchmark's workloads as token-id scripts, the same for every engine and every build.

A workload is a set of scripts (sessions); a script is a chain of requests. Each request's
prompt is the session's context: the previous prompt, then the ids the engine generated for it
(unless `keep_output` is off: the same prompt again), then the step's `append` ids. Only the
generated ids come from the engine (greedy, fixed length); everything else is fixed here, from
seeds, so `Workload.digest()` names the exact token ids sent.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

LOW_ID, HIGH_ID = 1000, 151_000  # clear of Qwen2's special tokens (151643 and up) and the lowest ids


@dataclass(frozen=True, slots=True)
class Step:
    append: tuple[int, ...]  # ids appended to the context before this request
    max_tokens: int  # generated exactly (ignore_eos)
    think_s: float = 0.0  # wait after the previous response (after the start for the first)
    keep_output: bool = True  # the previous response's ids stay in the context


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    steps: tuple[Step, ...]
    start_s: float = 0.0  # after the workload starts (or after `after` finishes)
    after: str | None = None  # the script that must finish first (fan-out children)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    kind: str  # agent | long | fanout | cc | calibration
    scripts: tuple[Script, ...]
    note: str = ""

    @property
    def num_requests(self) -> int:
        return sum(len(s.steps) for s in self.scripts)

    @property
    def num_fixed_tokens(self) -> int:
        return sum(len(st.append) for s in self.scripts for st in s.steps)

    def digest(self) -> str:
        doc = [[s.name, s.start_s, s.after, [[list(st.append), st.max_tokens, st.think_s, st.keep_output]
                                             for st in s.steps]] for s in self.scripts]
        return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:16]


def random_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(LOW_ID, HIGH_ID) for _ in range(n))


def agent_4x6(path: Path, sets: tuple[str, ...] = ("A",), think_s: float = 2.0, max_tokens: int = 32) -> Workload:
    """The agent-4x6 protocol (../shared/bench/README.md): 4 sessions start together, 6 turns."""
    data = json.loads(path.read_text())
    scripts = []
    for set_name in sets:
        s = data["sets"][set_name]
        for i, sess in enumerate(s["sessions"]):
            steps = [Step(tuple(s["prefix"]) + tuple(sess["task"]), max_tokens)]
            steps += [Step(tuple(r), max_tokens, think_s) for r in sess["tool_results"]]
            scripts.append(Script(f"{set_name}{i}", tuple(steps)))
    return Workload("agent-4x6", "agent", tuple(scripts), f"sets {','.join(sets)} of {path.name}")


def long_prompt(num_tokens: int, seed: int, rerun_tokens: int = 16) -> Workload:
    """One request: prefill only (1 token out), then the same prompt again with decode steps."""
    ids = random_ids(random.Random(f"long-{seed}-{num_tokens}"), num_tokens)
    steps = (Step(ids, 1), Step((), rerun_tokens, keep_output=False))
    return Workload(f"long-{num_tokens // 1024}k", "long", (Script("long", steps),),
                    f"{num_tokens} random ids; prefill, then a cached rerun of {rerun_tokens} tokens")


def fanout(seed: int, prefix_tokens: int, children: int, child_tokens: int, max_tokens: int) -> Workload:
    """A parent request on a shared prefix, then `children` requests at once that extend it."""
    rng = random.Random(f"fanout-{seed}")
    prefix = random_ids(rng, prefix_tokens)
    parent = Script("parent", (Step(prefix, max_tokens),))
    kids = tuple(Script(f"child{i}", (Step(prefix + random_ids(rng, child_tokens), max_tokens),), after="parent")
                 for i in range(children))
    return Workload("fanout", "fanout", (parent, *kids),
                    f"parent {prefix_tokens} tokens, then {children} x (prefix + {child_tokens}) at once")


def agent_like(seed: int, sessions: int, turns: int, prefix_tokens: int, task_tokens: int,
               result_tokens: int, max_tokens: int, think_s: float, name: str = "calibration") -> Workload:
    """An agent-4x6-like set with its own seed and sizes: the calibration workload."""
    rng = random.Random(f"agent-like-{seed}")
    prefix = random_ids(rng, prefix_tokens)
    scripts = []
    for i in range(sessions):
        steps = [Step(prefix + random_ids(rng, task_tokens), max_tokens)]
        steps += [Step(random_ids(rng, result_tokens), max_tokens, think_s) for _ in range(turns - 1)]
        scripts.append(Script(f"s{i}", tuple(steps)))
    return Workload(name, "calibration", tuple(scripts),
                    f"{sessions} sessions x {turns} turns, prefix {prefix_tokens}, seed {seed}")
