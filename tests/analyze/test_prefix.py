"""Prefix arithmetic against naive references, and the hybrid checkpoint rule."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agentserve.analyze.prefix import (
    carried_checkpoints,
    common_prefix,
    hybrid_reusable,
    reappearing_tokens,
    suffix_prefix_overlap,
)

small_lists = st.lists(st.integers(0, 3), max_size=40)


def _naive_common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(small_lists, small_lists)
def test_common_prefix_matches_naive(a: list[int], b: list[int]) -> None:
    assert common_prefix(a, b) == _naive_common_prefix(a, b)
    assert common_prefix(tuple(a), tuple(a + b)) == len(a)


@given(st.text("ab", max_size=30), st.text("ab", max_size=30))
def test_suffix_prefix_overlap_matches_naive(a: str, b: str) -> None:
    naive = max(k for k in range(min(len(a), len(b)) + 1) if a[len(a) - k :] == b[:k])
    assert suffix_prefix_overlap(a, b) == naive


def test_hybrid_resumes_from_the_largest_checkpoint_not_beyond_the_common_prefix() -> None:
    checkpoints = (100, 130)  # end of the previous prompt, end of its reply
    assert hybrid_reusable(checkpoints, 99) == 0  # break before the prompt-end checkpoint
    assert hybrid_reusable(checkpoints, 100) == 100  # break exactly on it
    assert hybrid_reusable(checkpoints, 129) == 100  # break inside the reply
    assert hybrid_reusable(checkpoints, 130) == 130  # no break: the whole sequence
    assert hybrid_reusable((), 50) == 0


@given(st.lists(st.integers(1, 60), max_size=8, unique=True), st.integers(0, 70))
def test_hybrid_matches_naive(points: list[int], common: int) -> None:
    checkpoints = sorted(points)
    assert hybrid_reusable(checkpoints, common) == max(
        [c for c in checkpoints if c <= common], default=0
    )


def test_checkpoints_carried_along_the_cached_path() -> None:
    assert carried_checkpoints((), 0, 10, 14) == (10, 14)
    # A later request that shares 12 tokens keeps 10 and adds its own prompt and reply ends.
    assert carried_checkpoints((10, 14), 12, 20, 25) == (10, 20, 25)
    # A break before every checkpoint leaves only the new ones; a prompt off the path adds none.
    assert carried_checkpoints((10, 14), 3, None, 25) == (25,)
    assert carried_checkpoints((10,), 10, 10, 10) == (10,)


def test_reappearing_tokens_counts_runs_after_the_break() -> None:
    old = list(range(100))
    new = [*old[:40], 999, *old[41:], 500, 501]  # one token changed at 40
    assert reappearing_tokens(old, new, 40, k=4) == 59
    moved = [*old[:40], *old[60:80], *old[40:60], *old[80:]]  # a block moved later
    assert 0 < reappearing_tokens(old, moved, 40, k=4) < 60
    assert reappearing_tokens(old, [7] * 100, 0, k=4) == 0
