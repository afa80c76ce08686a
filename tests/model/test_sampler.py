"""Every accepted sampling parameter is safe, and a row that cannot be sampled fails alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.engine.request import SamplingParams
from agentserve.model.sampler import sample

VOCAB = 50


def run(logits: torch.Tensor, params: list[SamplingParams], suppressed=None):
    rows = logits.shape[0]
    return sample(logits, params, list(range(rows)), suppressed or [()] * rows,
                  torch.Generator().manual_seed(0))


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-8, 0.5, 2.0, 1e30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_temperature_samples_a_valid_token(temperature, dtype):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits[1, 7] = logits[1].max() + 5  # a clear winner: tiny temperatures must pick it
    out = run(logits, [SamplingParams(temperature=temperature, top_p=0.9, top_k=5, seed=3)] * 3)
    assert not out.failed and sorted(out.tokens) == [0, 1, 2]
    assert all(0 <= t < VOCAB for t in out.tokens.values())
    if temperature <= 1e-8:
        assert out.tokens[1] == 7


@pytest.mark.parametrize("top_p", [7e-46, 5e-324, 1e-45])
def test_a_top_p_that_rounds_to_zero_keeps_the_best_token(top_p):
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    out = run(logits, [SamplingParams(temperature=1.0, top_p=top_p)])
    assert not out.failed and out.tokens == {0: int(logits[0].argmax())}


def test_a_bad_row_fails_alone():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    logits[0, 3] = float("nan")
    logits[1] = float("-inf")  # everything masked
    logits[2, 5] = float("inf")
    params = [SamplingParams(temperature=0.7, seed=1)] * 3 + [SamplingParams(temperature=0.0)]
    out = run(logits.clone(), params)
    assert set(out.failed) == {0, 1, 2} and "NaN" in out.failed[0] and "masked" in out.failed[1]
    assert out.tokens == {3: int(logits[3].argmax())}


def test_suppressing_every_allowed_token_fails_the_row_not_the_batch():
    logits = torch.full((2, VOCAB), float("-inf"))
    logits[:, 4] = 0.0  # a grammar that allows only token 4 (say end-of-sequence)
    out = run(logits, [SamplingParams(temperature=0.0)] * 2, suppressed=[(4,), ()])
    assert out.failed.keys() == {0} and out.tokens == {1: 4}


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0.0, max_value=1e38, allow_subnormal=True),
       st.floats(min_value=0.0, max_value=1.0, exclude_min=True), st.none() | st.integers(1, 2 * VOCAB),
       st.none() | st.integers(-(2**70), 2**70), st.floats(-1e4, 1e4))
def test_sampling_never_fails_for_finite_logits(temperature, top_p, top_k, seed, scale):
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5)) * scale
    out = run(logits, [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)] * 2)
    assert not out.failed and all(0 <= t < VOCAB for t in out.tokens.values())
