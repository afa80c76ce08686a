"""Token-level agent turns: each request is the previous request's prompt, its generated reply,
and the newly rendered piece (tool result or user message), all as token ids.

This is what a harness that appends (and never re-renders) produces, and what a prefix cache
can reuse fully. The new piece is cut from the chat template's own rendering of the whole
conversation, so the ids are exactly what the template would give.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True, slots=True)
class Continuation:
    token_ids: list[int]  # the next request's prompt
    appended: bool  # False: the rendering did not extend the previous ids, so it was re-tokenized


def render_ids(tok: ChatTokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
               ) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def continue_ids(tok: ChatTokenizer, previous_ids: list[int], messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None) -> Continuation:
    """The next prompt: previous_ids (last prompt + its reply) + the rendering of what the
    conversation `messages` adds after them."""
    full = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    done = tok.decode(previous_ids, skip_special_tokens=False)
    if not full.startswith(done):
        return Continuation(tok.encode(full, add_special_tokens=False), appended=False)
    return Continuation(previous_ids + tok.encode(full[len(done):], add_special_tokens=False), True)
