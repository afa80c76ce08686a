"""A request's tokens as a count: the simulator knows lengths and block hashes, not values."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload


class VirtualTokens(Sequence[int]):
    """`length` tokens, every one reading as `fill`. Slices are new VirtualTokens (O(1)), so the
    scheduler's chunks never materialize a 100k-token prompt."""

    __slots__ = ("_length", "_fill")

    def __init__(self, length: int, fill: int = 0) -> None:
        assert length >= 0
        self._length = length
        self._fill = fill

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> VirtualTokens: ...
    def __getitem__(self, index: int | slice) -> int | VirtualTokens:
        if isinstance(index, slice):
            return VirtualTokens(len(range(self._length)[index]), self._fill)
        range(self._length)[index]  # raises IndexError like a list
        return self._fill

    def __iter__(self) -> Iterator[int]:
        for _ in range(self._length):
            yield self._fill

    def append(self, token_id: int) -> None:
        self._length += 1

    def extend(self, token_ids: Sequence[int]) -> None:
        self._length += len(token_ids)

    def __repr__(self) -> str:
        return f"VirtualTokens({self._length})"
