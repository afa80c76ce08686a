"""Next-token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

A seeded request draws token k from a generator seeded by (seed, k), so its output does not
depend on what else is in the batch, on chunking, or on preemption.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentserve.engine.request import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    # logits: [vocab] fp32, already temperature-scaled
    if top_k is not None and top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_index: Sequence[int],
    suppressed: Sequence[tuple[int, ...]],
    generator: torch.Generator,
) -> list[int]:
    """logits: [rows, vocab] fp32 -> one token id per row."""
    for row, ids in enumerate(suppressed):
        if ids:
            logits[row, list(ids)] = float("-inf")
    tokens = logits.argmax(dim=-1).tolist()
    for row, sp in enumerate(params):
        if sp.greedy:
            continue
        filtered = _filter_top_k_top_p(logits[row] / sp.temperature, sp.top_k, sp.top_p)
        probs = torch.softmax(filtered, dim=-1)
        gen = generator
        if sp.seed is not None:
            gen = torch.Generator(device=logits.device)
            gen.manual_seed((sp.seed * 1_000_003 + output_index[row]) % (2**63))
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens
