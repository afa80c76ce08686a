"""The frozen settings of `agentserve bench peers`, read from settings.yaml into plain records.

A variant of an engine (the calibration sweep) replaces named flags of its args, its env or its
preload list; `EngineSettings.with_variant` applies one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

DEFAULT_SETTINGS = Path(__file__).with_name("settings.yaml")
ENGINES = ("agentserve", "vllm", "llama.cpp")  # the table's engines: `--engines`' default
# Extra rows, run only when named: agentserve with the frozen flags of `agentserve` (unless
# settings.yaml gives it its own), driven by a client that sends lifecycle hints (client.py)
EVENTS_ENGINE = "agentserve-events"
EXTRA_ENGINES = (EVENTS_ENGINE,)
KNOWN_ENGINES = ENGINES + EXTRA_ENGINES


@dataclass(frozen=True, slots=True)
class EngineSettings:
    name: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    preload: tuple[str, ...] = ()  # libraries LD_PRELOADed, by short name (tcmalloc, iomp5)

    def with_variant(self, variant: dict[str, object]) -> EngineSettings:
        args = list(self.args)
        for flag, value in dict(variant.get("args") or {}).items():  # type: ignore[call-overload]
            if value is True:  # a flag without a value
                args += [] if flag in args else [flag]
            elif flag in args:
                i = args.index(flag)
                if value is None:
                    del args[i: i + 2]
                else:
                    args[i + 1] = str(value)
            elif value is not None:
                args += [flag, str(value)]
        env = dict(self.env) | {k: str(v) for k, v in dict(variant.get("env") or {}).items()}  # type: ignore[call-overload]
        preload = tuple(variant["preload"]) if "preload" in variant else self.preload  # type: ignore[arg-type]
        return replace(self, args=tuple(args), env=tuple(sorted(env.items())), preload=preload)


@dataclass(frozen=True, slots=True)
class Group:
    name: str
    kv_tokens: int
    max_model_len: int
    workloads: tuple[str, ...]
    extra: tuple[str, ...] = ()  # built and run only when asked for by name

    def runs(self, workload: str) -> bool:
        return workload in self.workloads or workload in self.extra


@dataclass(frozen=True, slots=True)
class Settings:
    model: str
    kv_bytes_per_token: int
    repeats: int
    idle_busy_below: float
    idle_wait_s: float
    start_timeout_s: float
    groups: tuple[Group, ...]
    workloads: dict[str, dict[str, object]]
    engines: dict[str, EngineSettings]
    calibration: dict[str, object] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # printed under the table
    source: str = ""  # the YAML text, kept with the results

    def group_of(self, workload: str) -> Group:
        for g in self.groups:
            if g.runs(workload):
                return g
        raise KeyError(f"no group runs workload {workload!r}")

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token


def load_settings(path: Path = DEFAULT_SETTINGS) -> Settings:
    text = path.read_text()
    doc = yaml.safe_load(text)
    engines = {}
    for name, e in doc["engines"].items():
        if name not in KNOWN_ENGINES:
            raise ValueError(f"{path}: unknown engine {name!r}; known: {', '.join(KNOWN_ENGINES)}")
        engines[name] = EngineSettings(name, tuple(str(a) for a in e.get("args", ())),
                                       tuple(sorted((k, str(v)) for k, v in (e.get("env") or {}).items())),
                                       tuple(e.get("preload", ())))
    if "agentserve" in engines and EVENTS_ENGINE not in engines:
        engines[EVENTS_ENGINE] = replace(engines["agentserve"], name=EVENTS_ENGINE)
    groups = tuple(Group(n, int(g["kv_tokens"]), int(g["max_model_len"]), tuple(g["workloads"]),
                         tuple(g.get("extra") or ()))
                   for n, g in doc["groups"].items())
    return Settings(model=doc["model"], kv_bytes_per_token=int(doc["kv_bytes_per_token"]),
                    repeats=int(doc["repeats"]), idle_busy_below=float(doc["idle"]["busy_below"]),
                    idle_wait_s=float(doc["idle"]["wait_s"]), start_timeout_s=float(doc["start_timeout_s"]),
                    groups=groups, workloads=doc["workloads"], engines=engines,
                    calibration=doc.get("calibration") or {}, notes=tuple(doc.get("notes") or ()), source=text)
