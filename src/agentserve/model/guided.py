"""Constrained decoding with llguidance: a token mask per guided request, from its Guide.

Matchers live here, on the runner's side, keyed by request id: each is a copy of the Guide's
compiled template (model/grammar.py; compiled before the request reached the engine, so the
step thread only copies it), the mask is applied to the logits before sampling and the sampled
token advances the matcher. Preemption does not disturb them: a recomputed request re-samples
nothing it already has.

A failure is one request's own: `mask` returns the requests whose grammar failed (it does not
compile or hit a resource limit) and `accept` says why a request's sampled token was rejected;
neither touches another row. A failed row is left unmasked: the caller ends that request and
drops its token (main's runner: RunResult.failed).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from agentserve.engine.request import Guide, RequestId
from agentserve.model.grammar import GrammarCompiler, grammar_text, guarded


FAILED = "constrained decoding failed: "


class GuidedDecoding:
    def __init__(self, tokenizer: Any, vocab_size: int, cache_capacity: int = 128,
                 mask_threads: int | None = None) -> None:
        """mask_threads: llguidance's pool for several rows' masks (None: its default, 80% of
        the CPUs up to 32)."""
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._mask_threads = mask_threads
        self._executor: llguidance.LLExecutor | None = None
        self._matchers: dict[RequestId, llguidance.LLMatcher] = {}
        self.compiler = GrammarCompiler(self.tokenizer, vocab_size, cache_capacity)

    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built once (several seconds for a 150k vocabulary); `warm()` does it up front."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
            return self._ll_tokenizer

    def warm(self) -> None:
        """The token table, and the mask pool's threads: started now, from the thread that
        starts the server, so they never inherit the pinned step thread's one CPU."""
        self.tokenizer()
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._mask_threads)

    @staticmethod
    def grammar(guide: Guide) -> str:
        """The guide as llguidance grammar text."""
        return grammar_text(guide)

    def _matcher(self, rid: RequestId, guide: Guide) -> llguidance.LLMatcher | str:
        """The request's matcher, copied from the template on its first step; or why not."""
        matcher = self._matchers.get(rid)
        if matcher is None:
            compiled = self.compiler.compiled_for_step(guide)
            if compiled.matcher is None:
                return FAILED + (compiled.error or "the grammar did not compile")
            matcher = self._matchers[rid] = compiled.matcher.deep_copy()
        return FAILED + matcher.get_error() if matcher.is_error() else matcher

    def mask(self, logits: torch.Tensor, rows: Sequence[tuple[RequestId, Guide | None]]) -> dict[RequestId, str]:
        """Set logits of tokens each row's grammar forbids to -inf, in place; logits: [rows, vocab].
        Returns the rows whose grammar failed (left unmasked), by request id."""
        failures: dict[RequestId, str] = {}
        guided: list[tuple[int, RequestId, llguidance.LLMatcher]] = []
        for i, (rid, guide) in enumerate(rows):
            if guide is None:
                continue
            matcher = self._matcher(rid, guide)
            if isinstance(matcher, str):
                failures[rid] = matcher
            else:
                guided.append((i, rid, matcher))
        if not guided:
            return failures
        bitmask = llguidance.torch.allocate_token_bitmask(len(guided), self.vocab_size)  # [guided, words]
        error = guarded(lambda: self._fill(bitmask, [m for _, _, m in guided]), lambda e: e)
        ok = []
        for k, (i, rid, matcher) in enumerate(guided):
            if error is not None or matcher.is_error():
                failures[rid] = FAILED + (error or matcher.get_error())
            else:
                ok.append((k, i))
        if ok:
            apply_bitmask(logits, [i for _, i in ok], bitmask[[k for k, _ in ok]])
        return failures

    def _fill(self, bitmask: torch.Tensor, matchers: list[llguidance.LLMatcher]) -> None:
        """All rows' masks in one call on llguidance's pool (the GIL is dropped throughout)."""
        if len(matchers) == 1:
            llguidance.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._mask_threads)
        llguidance.torch.fill_next_token_bitmask_par(self._executor, [(m, k) for k, m in enumerate(matchers)],
                                                     bitmask)

    def accept(self, request_id: RequestId, token: int) -> str | None:
        """Advance the request's matcher by its sampled token; why it rejected it, or None."""
        matcher = self._matchers.get(request_id)
        if matcher is None or (matcher.consume_token(token) and not matcher.is_error()):
            return None
        return FAILED + (matcher.get_error() or f"token {token} is not allowed here")

    def release(self, request_ids: Iterable[RequestId]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """logits[rows[k], t] = -inf where bit t of bitmask[k] is 0; logits: [rows, vocab], bitmask:
    [len(rows), words] int32 on the CPU (bit j of word w is token 32*w + j). Plain tensor ops,
    so no first-call compile (llguidance's own applier is torch.compile'd: ~4 s on first use)."""
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = ((words[:, :, None] >> bits) & 1).bool().flatten(1)  # [len(rows), words*32]
    if allowed.shape[1] < vocab:  # ids past the tokenizer's table are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index).masked_fill_(~allowed[:, :vocab], float("-inf"))
    logits.index_copy_(0, index, masked)
