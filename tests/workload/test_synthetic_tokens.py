"""Synthetic generator (seeded, fitted defaults) and the hash -> token id converter."""

from __future__ import annotations

from pathlib import Path

from agentserve.workload.claude_code import read_claude_code
from agentserve.workload.fit import fit_synthetic
from agentserve.workload.stats import describe
from agentserve.workload.synthetic import SyntheticConfig, synthetic_workload
from agentserve.workload.tokens import BlockTokens

CC = Path(__file__).parent.parent / "fixtures" / "traces" / "claude-code"


def test_synthetic_is_seeded_and_agent_shaped():
    cfg = SyntheticConfig(num_sessions=40)
    a, b, c = synthetic_workload(cfg, 1), synthetic_workload(cfg, 1), synthetic_workload(cfg, 2)
    assert a == b and a != c
    stats = describe(a)
    assert stats.ideal_reuse > 0.8  # each prompt extends the previous one
    for s in a.all_sessions():
        hashes = list(s.block_hashes())
        for t, (x, y) in zip(s.turns[1:], zip(hashes, hashes[1:])):
            assert y[: len(x)] == x and t.think_s >= 0
    assert 5 < stats.tool_gap_p50_s < 20  # fitted to the traces' 9 s


def test_fit_recovers_a_generator_config():
    fitted = fit_synthetic(read_claude_code([CC]))
    assert fitted.num_sessions == 5 and fitted.block_size == 64
    assert abs(sum(c.weight for c in fitted.tool_classes) - 1) < 1e-9
    assert synthetic_workload(fitted, 0).num_requests > 0


def test_block_tokens_equal_hashes_equal_blocks():
    tok = BlockTokens(vocab_size=50_000, block_size=64)
    assert tok.block(1, 7) == tok.block(1, 7)
    assert tok.block(1, 7) != tok.block(1, 8) and tok.block(1, 7) != tok.block(2, 7)
    a = tok.prompt(1, [5, 6, 7], 64 * 3 + 10, tail_key="a")
    b = tok.prompt(1, [5, 6, 9], 64 * 3 + 20, tail_key="b")
    assert len(a) == 202 and len(b) == 212
    assert a[:128] == b[:128] and a[128:192] != b[128:192]
    assert all(1000 <= t < 50_000 for t in a)


def test_block_tokens_scaling_keeps_ratios():
    tok = BlockTokens(vocab_size=32_000, block_size=64, scale=1 / 16)
    assert tok.tokens_per_block == 4 and tok.scaled(64 * 100 + 32) == 402
    p = tok.prompt(3, list(range(100)), 6400, tail_key=0)
    assert len(p) == 400 and p[:4] == tok.block(3, 0)
