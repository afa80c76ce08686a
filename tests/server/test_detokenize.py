"""Incremental detokenization equals decoding the whole output, on both bundled tokenizers."""

from __future__ import annotations

import random

import pytest

from agentserve.engine.request import FinishReason, RequestId, RequestOutput
from agentserve.model.loader import load_tokenizer
from agentserve.server.generation import TextState

TEXTS = [
    "def add(a, b):\n    return a + b  # sum ✓",
    "Grüße, 世界! 🙂🙂 naïve café — «quotes» and\ttabs",
    '{"name": "search", "arguments": {"query": "κόσμε 日本語"}}',
]


def output(ids: list[int], finished: bool) -> RequestOutput:
    return RequestOutput(RequestId("r"), tuple(ids), finished, FinishReason.LENGTH if finished else None,
                         1, 0, 1, 0, 0, 0.0, None, None)


@pytest.mark.parametrize("model", ["smollm2_dir", "qwen_dir"])
def test_streamed_text_equals_full_decode(model, request):
    tokenizer = load_tokenizer(request.getfixturevalue(model))
    rng = random.Random(0)
    cases = [tokenizer.encode(t) for t in TEXTS]
    # random ids too: byte tokens that split multi-byte characters, special tokens
    cases += [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))] for _ in range(30)]
    for ids in cases:
        for _ in range(3):
            state, streamed, i = TextState(tokenizer, ()), "", 0
            while i < len(ids):
                n = rng.randrange(1, 4)
                delta, _ = state.add(output(ids[i : i + n], finished=i + n >= len(ids)))
                streamed += delta
                i += n
            full = tokenizer.decode(ids, skip_special_tokens=True)
            assert state.text == full and streamed == full
