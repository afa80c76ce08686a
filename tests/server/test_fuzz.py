"""schemathesis against the server's own OpenAPI document, bounded, as part of `make test`.

Every route: the coverage phase sends each field at its bounds, of each wrong JSON type and
missing; the fuzzing phase draws positive and negative bodies. The server is the real app on
127.0.0.1 (bench/fuzz_server.py says why), SmolLM2 in fp32 with a 256-token context and
generation capped at 8 tokens. The longer run is `agentserve bench fuzz --examples 200`.
"""

from __future__ import annotations

import pytest

from agentserve.bench.fuzz import FuzzConfig, render, run_fuzz
from agentserve.bench.fuzz_server import cap_body


def test_cap_leaves_invalid_values_for_the_server_to_reject():
    assert cap_body({"max_tokens": 100}, 8) == {"max_tokens": 8}
    assert cap_body({"max_tokens": 1.0e14}, 8) == {"max_tokens": 8}  # the server reads 2.0 as 2
    assert cap_body({"max_tokens": 3}, 8) is None
    assert cap_body({"messages": []}, 8) == {"messages": [], "max_tokens": 8}
    assert cap_body({"max_completion_tokens": 99, "max_tokens": None}, 8) == {
        "max_completion_tokens": 8, "max_tokens": None}
    for bad in ("100", True, -1, 0, 2.5, [100]):
        assert cap_body({"max_tokens": bad}, 8) is None
    assert cap_body([1, 2], 8) is None


@pytest.mark.slow
def test_fuzz_all_routes_no_5xx_no_leaked_block():
    report = run_fuzz(FuzzConfig(max_examples=8))  # one pass of each phase: no max_time
    print(render(report))
    assert report.num_examples >= 600, render(report)  # the coverage phase alone sends ~650
    assert not report.server_errors, render(report)
    assert not report.check_failures, render(report)
    assert not report.engine_errors, render(report)
    assert report.alive, render(report)
    assert report.num_leaked_blocks == 0 and report.pool_ok, render(report)
