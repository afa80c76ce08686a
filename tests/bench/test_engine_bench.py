"""`agentserve bench engine` end to end on SmolLM2, tiny sizes: every row measured, both sides."""

from __future__ import annotations

import pytest

from agentserve.bench.engine_bench import run_bench

pytestmark = pytest.mark.slow


def test_engine_bench_rows(cache_root):
    # 8 decode tokens, 2 repeats: decode times are differences of two timings, and 3 decode
    # steps were within one busy machine's noise of a 32-token prefill (a CI run saw one <= 0)
    rows = run_bench("smollm2-135m", "bfloat16", cache_root, prompt_len=64, decode_tokens=8,
                     concurrency=2, repeats=2)
    assert [r.metric.split(" ")[0] for r in rows] == ["prefill", "decode", "decode", "matmul"]
    assert all(r.agentserve > 0 and r.transformers > 0 for r in rows), rows
