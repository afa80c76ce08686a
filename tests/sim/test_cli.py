"""`agentserve sim` end to end on the fixtures: sweep outputs, manifest, bad input."""

from __future__ import annotations

import json

from agentserve.cli import main
from tests.sim.conftest import FIXTURES


def test_sweep_writes_rows_plots_summary_and_manifest(tmp_path):
    out = tmp_path / "out"
    rc = main(["sim", str(FIXTURES / "claude-code"), "--policy", "none,lru,belady", "--sweep-capacity",
               "--capacities", "160k,320k", "--seeds", "0,1", "--session-rate", "0.01", "--replicas", "2",
               "--router", "session-hash", "--cost-model", "h100-llama3-8b", "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 3 * 2 * 2
    need = {"policy", "capacity_tokens", "seed", "requests", "prompt_tokens", "reused_tokens",
            "recomputed_tokens", "jct_p50_s", "jct_p99_s", "reuse_ratio", "rebuild_tax"}
    assert all(need <= set(r) for r in rows)
    by = {(r["policy"], r["capacity_tokens"], r["seed"]): r for r in rows}
    assert all(by["none", c, s]["reused_tokens"] == 0 for c in (160_000, 320_000) for s in (0, 1))
    assert by["lru", 320_000, 0]["reused_tokens"] > 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["workload"]["sources"]) == 5 and manifest["seeds"] == [0, 1]
    assert manifest["cost_model"]["name"] == "h100-llama3-8b" and "commit" in manifest["code"]
    assert (out / "reuse_ratio.png").stat().st_size > 1000
    assert "| 160,000 | lru |" in (out / "summary.md").read_text()


def test_sim_cli_bad_input_is_a_message_not_a_traceback(tmp_path, capsys):
    assert main(["sim", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: no such file" in capsys.readouterr().err
    assert main(["sim", str(FIXTURES / "claude-code"), "--capacity-tokens", "4096", "--policy", "lru"]) == 2
    err = capsys.readouterr().err
    assert "--capacity-tokens 4096 is smaller than the largest request" in err
    assert main(["sim", str(FIXTURES / "claude-code"), "--policy", "magic", "--capacity-tokens", "1M"]) == 2
    assert "unknown policy 'magic'" in capsys.readouterr().err


def test_sim_on_mooncake_and_synthetic(tmp_path):
    assert main(["sim", str(FIXTURES / "mooncake"), "--policy", "lru,belady", "--capacity-tokens", "200k"]) == 0
    assert main(["sim", "--format", "synthetic", "--synthetic-sessions", "3", "--policy", "lru",
                 "--capacity-tokens", "2M", "--out", str(tmp_path)]) == 0
