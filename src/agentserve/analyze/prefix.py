"""Prefix arithmetic on token and character sequences: what a prefix cache and a hybrid model
can reuse."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def common_prefix(a: Sequence[T], b: Sequence[T]) -> int:
    """Length of the longest common prefix of two sequences (str, tuple, list)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def common_suffix(a: Sequence[T], b: Sequence[T]) -> int:
    """Length of the longest common suffix."""
    return common_prefix(a[::-1], b[::-1])


def suffix_prefix_overlap(a: str, b: str) -> int:
    """Largest k with a[-k:] == b[:k] (k <= min(len(a), len(b))), by the KMP prefix function."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    s: list[str | None] = [*b[:m], None, *a[len(a) - m :]]  # None never matches a character
    pi = [0] * len(s)
    for i in range(1, len(s)):
        k = pi[i - 1]
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi[-1]


def hybrid_reusable(checkpoints: Sequence[int], common: int) -> int:
    """A hybrid (linear-attention) model resumes only from a saved state: the largest checkpoint
    not beyond the common prefix, or 0. `checkpoints` must be sorted."""
    i = bisect_right(checkpoints, common)
    return checkpoints[i - 1] if i else 0


def carried_checkpoints(
    checkpoints: Sequence[int], valid: int, prompt_end: int | None, full_end: int
) -> tuple[int, ...]:
    """Checkpoints on the new full sequence: the old ones still on it (position <= `valid`, the
    prefix shared with the old sequence) plus the end of the prompt and of the reply."""
    kept = list(checkpoints[: bisect_right(checkpoints, valid)])
    for position in (prompt_end, full_end):
        if position is not None and position > 0:
            i = bisect_left(kept, position)
            if i == len(kept) or kept[i] != position:
                kept.insert(i, position)
    return tuple(kept)


def reappearing_tokens(old: Sequence[int], new: Sequence[int], start: int, k: int = 8) -> int:
    """Tokens of `old` after `start` that `new` repeats unchanged and in order after `start`:
    runs of at least `k` tokens, matched greedily. What a fix at the break would make reusable."""
    index: dict[tuple[int, ...], list[int]] = {}
    for j in range(start, len(new) - k + 1):
        index.setdefault(tuple(new[j : j + k]), []).append(j)
    total, i, j = 0, start, start
    while i + k <= len(old):
        positions = index.get(tuple(old[i : i + k]))
        at = bisect_left(positions, j) if positions else 0
        if not positions or at == len(positions):
            i += 1
            continue
        j = positions[at]
        run = common_prefix(old[i:], new[j:])
        total, i, j = total + run, i + run, j + run
    return total
