"""Next-token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

A seeded request draws token k from a generator seeded by (seed, k), so its output does not
depend on what else is in the batch, on chunking, or on preemption.

Every accepted parameter is safe: logits are sampled in fp32, shifted so the largest is 0
before dividing by the temperature (no overflow for any temperature > 0; one below fp32's
smallest normal number is greedy, its limit), and a row that
cannot be sampled (NaN or +inf logits, or no allowed token left after the masks) fails alone:
its request ends with an error and the other rows are sampled as usual.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentserve.engine.request import SamplingParams


_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True, slots=True)
class Sampled:
    tokens: dict[int, int]  # row -> token id
    failed: dict[int, str]  # row -> why it could not be sampled


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
        drop[0] = False  # also when top_p rounds to 0 in fp32
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def _draw(row: torch.Tensor, sp: SamplingParams, output_index: int, generator: torch.Generator) -> int:
    # row: [vocab] fp32 with a finite maximum
    scaled = (row - row.max()) / sp.temperature  # the best token scores 0: softmax never sums to 0
    probs = torch.softmax(_filter_top_k_top_p(scaled, sp.top_k, sp.top_p), dim=-1)
    gen = generator
    if sp.seed is not None:
        gen = torch.Generator(device=row.device)
        gen.manual_seed((sp.seed * 1_000_003 + output_index) % (2**63))
    return int(torch.multinomial(probs, 1, generator=gen).item())


def _unsampleable(logits: torch.Tensor) -> dict[int, str]:
    """Rows that no sampling method can draw from, with why: one reduction, as a row's
    maximum is NaN if any logit is, +inf if one is, and -inf if every token is masked."""
    failed = {}
    for row, peak in enumerate(logits.amax(dim=-1).tolist()):
        if peak == float("-inf"):
            failed[row] = "no token is allowed at this position (every token was masked)"
        elif not math.isfinite(peak):
            failed[row] = "the model produced NaN or infinite logits for this request"
    return failed


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_index: Sequence[int],
    suppressed: Sequence[tuple[int, ...]],
    generator: torch.Generator,
) -> Sampled:
    """logits: [rows, vocab] -> one token id per row, or why a row could not be sampled."""
    logits = logits.float()
    for row, ids in enumerate(suppressed):
        if ids:
            logits[row, list(ids)] = float("-inf")
    failed = _unsampleable(logits)
    greedy = logits.argmax(dim=-1).tolist()
    tokens: dict[int, int] = {}
    for row, sp in enumerate(params):
        if row in failed:
            continue
        if sp.temperature < _TINY:  # greedy, or so close that fp32 cannot divide by it
            tokens[row] = greedy[row]
            continue
        try:
            tokens[row] = _draw(logits[row], sp, output_index[row], generator)
        except RuntimeError as exc:  # this row alone
            failed[row] = f"sampling failed: {exc}"
    return Sampled(tokens, failed)
