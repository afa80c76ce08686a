"""Volatile text: timestamps, dates, random ids and counters that differ between two renderings
that otherwise agree.

A difference counts as volatile only when the whole differing word on both sides looks like
such a value and the two texts agree again right after it; a changed sentence never does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_WORD_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-:.+/")
_EDGE_PUNCTUATION = ".:-/+_"
_RESYNC_CHARS = 12  # characters that must agree after the differing word

_NAMES = (
    "monday|tuesday|wednesday|thursday|friday|saturday|sunday|mon|tue|wed|thu|fri|sat|sun|"
    "january|february|march|april|may|june|july|august|september|october|november|december|"
    "jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec"
)
_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "timestamp",
        re.compile(
            r"\d{4}-\d{2}-\d{2}[T_]\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?"
            r"|\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?"
        ),
    ),
    (
        "date",
        re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,4}[/.]\d{1,2}[/.]\d{1,4}|" + _NAMES, re.IGNORECASE),
    ),
    (
        "id",
        re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE),
    ),
    ("counter", re.compile(r"\d+(\.\d+)?")),
    ("id", re.compile(r"(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[\w-]{6,}")),
)


@dataclass(frozen=True, slots=True)
class VolatileChange:
    """The differing word on each side and what kind of value it is."""

    kind: str  # "timestamp" | "date" | "id" | "counter"
    old: str
    new: str
    start: int  # character offset of the word in both texts (their prefixes agree)
    old_end: int
    new_end: int


def volatile_kind(word: str) -> str | None:
    """The kind of volatile value `word` is, or None."""
    for kind, pattern in _KINDS:
        if pattern.fullmatch(word):
            return kind
    return None


def volatile_change(old: str, new: str, at: int) -> VolatileChange | None:
    """The volatile value that makes `old` and `new` differ at character `at`, if that is all
    that differs there."""
    start = at
    while start > 0 and old[start - 1] in _WORD_CHARS:
        start -= 1
    old_end, new_end = _word_end(old, at), _word_end(new, at)
    old_word, new_word = _strip(old[start:old_end]), _strip(new[start:new_end])
    if not old_word or not new_word or old_word == new_word:
        return None
    old_kind, new_kind = volatile_kind(old_word), volatile_kind(new_word)
    if old_kind is None or new_kind is None:
        return None
    after = min(_RESYNC_CHARS, len(old) - old_end, len(new) - new_end)
    if old[old_end : old_end + after] != new[new_end : new_end + after]:
        return None
    if after < _RESYNC_CHARS and len(old) - old_end != len(new) - new_end:
        return None  # one text goes on where the other stops: not a value swap
    return VolatileChange(old_kind, old_word, new_word, start, old_end, new_end)


def _word_end(text: str, at: int) -> int:
    end = at
    while end < len(text) and text[end] in _WORD_CHARS:
        end += 1
    return end


def _strip(word: str) -> str:
    return word.strip(_EDGE_PUNCTUATION)
