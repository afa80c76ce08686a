"""Incremental detokenization: the text of a growing list of token ids, in O(new ids) per step.

As vLLM does it: each call decodes only the ids from `_prefix` on, and the new text is what
decoding them adds to decoding ids[_prefix:_read]. Starting both decodes at the same id keeps
tokenizers that drop a leading space at a sequence start exact; decoding the whole output
every step cost O(n) per token. The engine (stop strings) and the server (streamed text) both
use it, so both see the same text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class IncrementalDecoder:
    """Invariant: `text` is the decoded output without an incomplete UTF-8 tail (which decodes
    to U+FFFD until the ids that complete it arrive)."""

    __slots__ = ("_decode", "token_ids", "text", "_prefix", "_read")

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def add(self, token_ids: Sequence[int], flush: bool = False) -> str:
        """Append ids; return the text they complete (all of it when flush: the output ended)."""
        self.token_ids.extend(token_ids)
        ids = self.token_ids
        before = self._decode(ids[self._prefix : self._read])
        after = self._decode(ids[self._prefix :])
        if len(after) > len(before) and (flush or not after.endswith("\ufffd")):
            new = after[len(before) :]
            self.text += new
            self._prefix, self._read = self._read, len(ids)
            return new
        return ""
