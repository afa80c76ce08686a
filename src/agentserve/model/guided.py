"""Constrained decoding with llguidance: a token mask per guided request, from its JSON schema.

Matchers live here, on the runner's side, keyed by request id: the mask is applied to the
logits before sampling and the sampled token advances the matcher. Preemption does not disturb
them: a recomputed request re-samples nothing it already has.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from agentserve.engine.request import Guide, GuideFormat, RequestId


class GuideError(ValueError):
    pass


class GuidedDecoding:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._matchers: dict[RequestId, llguidance.LLMatcher] = {}

    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built once (several seconds for a 150k vocabulary); `warm()` does it up front."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
            return self._ll_tokenizer

    def warm(self) -> None:
        self.tokenizer()

    @staticmethod
    def grammar(guide: Guide) -> str:
        if guide.format is GuideFormat.LARK:
            return llguidance.LLMatcher.grammar_from_lark(guide.text)
        return llguidance.LLMatcher.grammar_from_json_schema(
            guide.text, defaults={"whitespace_flexible": True})

    @staticmethod
    def validate(guide: Guide) -> None:
        """Raise GuideError naming the problem if the schema cannot be compiled."""
        error = llguidance.LLMatcher.validate_grammar(GuidedDecoding.grammar(guide))
        if error:
            raise GuideError(error)

    def mask(self, logits: torch.Tensor, rows: Sequence[tuple[RequestId, Guide | None]]) -> dict[RequestId, str]:
        """Set logits of tokens the grammar forbids to -inf, in place. logits: [rows, vocab].
        Returns the requests whose grammar failed (with why); their rows are left as they were."""
        guided = [(i, rid, g) for i, (rid, g) in enumerate(rows) if g is not None]
        if not guided:
            return {}
        failed: dict[RequestId, str] = {}
        bitmask = llguidance.torch.allocate_token_bitmask(len(rows), self.vocab_size)
        bitmask.fill_(-1)  # all allowed for unguided rows
        for i, rid, guide in guided:
            try:
                matcher = self._matchers.get(rid)
                if matcher is None:
                    matcher = self._matchers[rid] = llguidance.LLMatcher(self.tokenizer(), self.grammar(guide))
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, i)
                if matcher.is_error():
                    failed[rid] = f"constrained decoding failed: {matcher.get_error()}"
            except Exception as exc:  # this request's grammar alone
                failed[rid] = f"constrained decoding failed: {exc}"
            if rid in failed:
                bitmask[i].fill_(-1)
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
        return failed

    def accept(self, request_id: RequestId, token: int) -> str | None:
        """Advance the request's grammar by the sampled token; why it failed, or None."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return None
        try:
            if matcher.consume_token(token) and not matcher.is_error():
                return None
            return f"constrained decoding failed: {matcher.get_error() or 'token rejected'}"
        except Exception as exc:
            return f"constrained decoding failed: {exc}"

    def release(self, request_ids: Iterable[RequestId]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)
