"""Each peer's reply fields, settings variants, and the table's winner marks and failure rows."""

from __future__ import annotations

from agentserve.bench.peers.client import Dialect
from agentserve.bench.peers.report import table
from agentserve.bench.peers.runner import Row
from agentserve.bench.peers.settings import EngineSettings


def test_each_dialect_reads_ids_and_reuse_from_its_own_fields() -> None:
    llama = Dialect("llama.cpp", "m")
    assert llama.path == "/completion" and llama.body([1, 2], 3)["n_predict"] == 3
    assert llama.parse({"tokens": [7], "stop": False}) == ([7], None, None)
    final = {"tokens": [], "stop": True, "tokens_predicted": 3, "timings": {"cache_n": 96, "prompt_n": 4}}
    assert llama.parse(final) == ([], 96, 3)
    oai = Dialect("openai", "m")
    assert oai.body([1], 2)["return_token_ids"] and oai.body([1], 2)["min_tokens"] == 2
    assert oai.parse({"choices": [{"token_ids": [5, 6]}]}) == ([5, 6], None, None)
    usage = {"completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
    assert oai.parse({"choices": [], "usage": usage}) == ([], 32, 2)


def test_a_variant_replaces_flags_env_and_preload() -> None:
    e = EngineSettings("vllm", ("--a", "1", "--b", "2"), (("X", "1"),), ("tcmalloc", "iomp5"))
    v = e.with_variant({"args": {"--b": "3", "--c": "4", "--a": None}, "env": {"X": "auto"}, "preload": ["tcmalloc"]})
    assert v.args == ("--b", "3", "--c", "4") and v.env == (("X", "auto"),) and v.preload == ("tcmalloc",)
    assert e.with_variant({"args": {"--eager": True}}).args == ("--a", "1", "--b", "2", "--eager")


def test_table_marks_a_winner_only_when_the_interval_excludes_parity() -> None:
    rows = [Row("w", "a", k, "ok", {"jct_p50_s": j, "turns_per_min": 10.0 + k}) for k, j in enumerate([1.0, 1.1, 1.05])]
    rows += [Row("w", "b", k, "ok", {"jct_p50_s": j, "turns_per_min": 10.2 + k}) for k, j in enumerate([2.0, 2.1, 2.0])]
    rows += [Row("w", "c", 0, "failed", error="not installed: cmake failed", log_tail="error: no cc")]
    text = table(rows, ["w"], ["a", "b", "c"])
    line_a = next(ln for ln in text.splitlines() if ln.startswith("| w | a |"))
    assert "**1.05 ± " in line_a  # a wins JCT p50 ...
    assert "**" not in line_a.split("|")[3]  # ... but not turns/min (paired ratio interval holds 1)
    assert "| w | c | failed: not installed: cmake failed |" in text and "error: no cc" in text


def test_an_engine_whose_requests_failed_wins_nothing() -> None:
    """llama.cpp's cc-c8 at -np 8: every request fails at once, so its (empty) sessions end first;
    a row with request errors neither wins a metric nor blocks another engine's win."""
    rows = [Row("w", "a", k, "ok", {"jct_p50_s": j, "errors": 0.0}) for k, j in enumerate([3.0, 3.1, 3.05])]
    rows += [Row("w", "b", k, "ok", {"jct_p50_s": j, "errors": 0.0}) for k, j in enumerate([4.0, 4.2, 4.1])]
    rows += [Row("w", "c", k, "ok", {"jct_p50_s": 0.5, "errors": 8.0}) for k in range(3)]
    text = table(rows, ["w"], ["a", "b", "c"])
    assert "**" in next(ln for ln in text.splitlines() if ln.startswith("| w | a |"))
    assert "**" not in next(ln for ln in text.splitlines() if ln.startswith("| w | c |"))
