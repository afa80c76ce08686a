"""The peers' workloads are the same token ids on every build, and have the shapes they claim."""

from __future__ import annotations

import json
from pathlib import Path

from agentserve.bench.peers import catalog
from agentserve.bench.peers.settings import load_settings
from agentserve.bench.peers.workloads import HIGH_ID, LOW_ID, agent_4x6, agent_like, fanout, long_prompt


def test_same_ids_every_build() -> None:
    # Pinned: a change here changes what every engine is sent, and old results stop comparing.
    assert long_prompt(2048, 7).digest() == long_prompt(2048, 7).digest() == "98965d68abd5af6b"
    assert fanout(11, 2000, 8, 200, 32).digest() == "3931065433f25114"
    assert agent_like(101, 3, 5, 500, 150, 120, 24, 1.0).digest() == "e96130ba24b0c8f5"
    assert long_prompt(2048, 8).digest() != long_prompt(2048, 7).digest()


def test_long_prompt_is_prefill_then_a_cached_rerun() -> None:
    w = long_prompt(1024, 7, rerun_tokens=16)
    (s,) = w.scripts
    first, rerun = s.steps
    assert len(first.append) == 1024 and first.max_tokens == 1
    assert rerun.append == () and not rerun.keep_output and rerun.max_tokens == 16
    assert all(LOW_ID <= i < HIGH_ID for i in first.append)


def test_fanout_children_extend_the_parent_prefix_after_it() -> None:
    w = fanout(11, 100, 8, 20, 4)
    parent, *kids = w.scripts
    assert len(kids) == 8 and all(k.after == "parent" for k in kids)
    prefix = parent.steps[0].append
    assert all(k.steps[0].append[:100] == prefix and len(k.steps[0].append) == 120 for k in kids)
    assert len({k.steps[0].append[100:] for k in kids}) == 8


def test_agent_4x6_follows_the_protocol(tmp_path: Path) -> None:
    sessions = [{"task": [5000 + i] * 200, "tool_results": [[6000 + i] * 150] * 5} for i in range(4)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"sets": {"A": {"prefix": [4000] * 600, "sessions": sessions}}}))
    w = agent_4x6(path, ("A",), 2.0, 32)
    assert len(w.scripts) == 4 and w.num_requests == 24
    s = w.scripts[0]
    assert len(s.steps[0].append) == 800 and s.steps[0].think_s == 0
    assert all(len(st.append) == 150 and st.think_s == 2.0 and st.keep_output for st in s.steps[1:])


def test_the_frozen_settings_name_every_table_workload() -> None:
    s = load_settings()
    names = catalog.names(s)
    assert {"agent-4x6", "fanout", "long-2k", "long-8k", "long-16k", "cc-c2", "cc-c8"} <= set(names)
    assert "cc-c4" not in names and s.group_of("cc-c4").name == "cc"  # built only when asked for
    assert "calibration" not in names  # the sweep's workload is not in the table
    assert s.group_of("long-16k").max_model_len > 16384 + 16
    assert s.group_of("cc-c8").kv_tokens < s.group_of("long-16k").kv_tokens


def test_the_pressured_calibration_uses_sessions_the_table_never_does() -> None:
    from agentserve.bench.peers.cli import _calibration_part

    s = load_settings()
    name, part = _calibration_part(s, "pressured")
    assert name == "calibration-pressured" and name not in catalog.names(s)
    # the table's cc rows draw from the even-numbered trace files, this from the odd ones
    assert {s.workloads["cc"]["files"], part["workload"]["files"]} == {"even", "odd"}
    assert part["kv_tokens"] == s.group_of("cc-c8").kv_tokens  # the pressure the cc-c8 row has
    assert "residency-shadow" in part["sweep"]["agentserve"]
    # the frozen flags are what that half chose (docs/peers.md)
    args = s.engines["agentserve"].args
    assert args[args.index("--residency") + 1] == "on"
    assert _calibration_part(s, "roomy") == ("calibration", s.calibration)
