"""Where each message, and the tool definitions, lie in one rendering.

Found from the template itself, never from guesses about its markup: the end of message i is
where a rendering of messages[:i+1] ends in the whole rendering. Usually the one is a prefix of
the other. Some templates render earlier messages differently once later ones exist (Qwen3
keeps reasoning only after the last user message); then the two are aligned line by line after
the point where they part, and the end of the prefix rendering is carried across.

Region convention: the template's preamble (BOS, a default system turn, tools) belongs to
message 0; text after the last message is the generation prompt, index len(messages).
"""

from __future__ import annotations

from collections.abc import Sequence
from difflib import SequenceMatcher

from agentserve.analyze.messages import Message, content_text
from agentserve.analyze.prefix import common_prefix, common_suffix, suffix_prefix_overlap
from agentserve.analyze.render import Renderer, TemplateError


class MessageSpans:
    """Message boundaries of `text` (the rendering of `messages`), computed lazily and memoized:
    locating one character costs O(log n) prefix renderings."""

    def __init__(
        self,
        renderer: Renderer,
        messages: Sequence[Message],
        tools: Sequence[Message] | None,
        text: str,
    ) -> None:
        self._renderer = renderer
        self.messages = tuple(messages)
        self._tools = tools
        self.text = text
        self._bounds: dict[int, int] = {}

    def bound(self, index: int) -> int:
        """End (exclusive) of message `index` in `text`."""
        if index not in self._bounds:
            self._bounds[index] = self._find_bound(index)
        return self._bounds[index]

    def span(self, index: int) -> tuple[int, int]:
        """[start, end) of message `index`; index len(messages) is the generation prompt."""
        n = len(self.messages)
        start = self.bound(index - 1) if index > 0 else 0
        end = self.bound(index) if index < n else len(self.text)
        return start, max(start, end)

    def piece(self, index: int) -> str:
        start, end = self.span(index)
        return self.text[start:end]

    def locate(self, char: int) -> int:
        """Index of the message holding character `char` (binary search over the bounds)."""
        lo, hi = 0, len(self.messages)  # answer in [lo, hi]; hi means the generation prompt
        while lo < hi:
            mid = (lo + hi) // 2
            if self.bound(mid) > char:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _find_bound(self, index: int) -> int:
        try:
            prefix = self._renderer.text(self.messages[: index + 1], self._tools, generation=False)
        except TemplateError:
            return self._bound_by_content(index)
        agreed = common_prefix(prefix, self.text)
        if agreed == len(prefix):
            return agreed
        return agreed + _aligned_end(prefix[agreed:], self.text[agreed:])

    def _bound_by_content(self, index: int) -> int:
        """Fallback when the template refuses a prefix: the end of the message's own text,
        searched after the previous bound (bounds filled oldest first: no deep recursion)."""
        start = 0
        for earlier in range(index):
            start = self.bound(earlier)
        content = content_text(self.messages[index].get("content"))
        found = self.text.find(content, start) if content else -1
        return found + len(content) if found >= 0 else start


def _aligned_end(tail: str, rest: str) -> int:
    """Where the end of `tail` falls in `rest`, two texts that differ from their first
    character: align them by lines; when the last line finds no partner, fall back to the
    longest end of `tail` that `rest` starts with."""
    tail_lines = tail.splitlines(keepends=True)
    rest_lines = rest.splitlines(keepends=True)
    matcher = SequenceMatcher(None, tail_lines, rest_lines, autojunk=False)
    blocks = [b for b in matcher.get_matching_blocks() if b.size]
    if blocks and blocks[-1].a + blocks[-1].size == len(tail_lines):
        return sum(len(line) for line in rest_lines[: blocks[-1].b + blocks[-1].size])
    return suffix_prefix_overlap(tail, rest[: len(tail)])


def tools_region(
    renderer: Renderer,
    messages: Sequence[Message],
    tools: Sequence[Message] | None,
    text: str,
    *,
    generation: bool,
) -> tuple[int, int] | None:
    """[start, end) of the text the tool definitions add to `text`, or None when the template
    renders no tools (SmolLM2's ignores them). Found by rendering once without tools."""
    if not tools:
        return None
    try:
        bare = renderer.text(messages, None, generation=generation)
    except TemplateError:
        return None
    start = common_prefix(text, bare)
    end = len(text) - common_suffix(text[start:], bare[start:])
    return (start, end) if end > start else None
