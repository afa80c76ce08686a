"""A prefix break: where a request's prompt stops matching the previous request's full sequence,
the message it falls in, a window of old and new text, and the cause (see `causes`)."""

from __future__ import annotations

from dataclasses import dataclass

from agentserve.analyze.causes import Cause, Side, classify, compare
from agentserve.analyze.prefix import reappearing_tokens
from agentserve.analyze.render import Renderer

WINDOW_BEFORE = 30  # characters of context shown before the break
WINDOW_AFTER = 50


@dataclass(frozen=True, slots=True)
class Break:
    position: int  # token position of the first token that differs (= reusable tokens)
    char: int  # character offset where the two texts first differ
    message_index: int  # message of the new request; len(messages) = the generation prompt
    role: str | None
    cause: Cause
    detail: str
    old: str  # text of the previous full sequence around the break
    new: str  # text of this prompt around the break
    recoverable_tokens: int  # tokens after the break the prompt repeats: what a fix would reuse


def explain(renderer: Renderer, old: Side, new: Side, position: int) -> Break:
    """The break at token `position` between `old` (previous full sequence) and `new` (prompt)."""
    comparison = compare(renderer, old, new)
    finding = classify(comparison)
    at, index = comparison.at, comparison.new_spans.locate(comparison.at)
    role = new.messages[index].get("role") if index < len(new.messages) else None
    return Break(
        position=position,
        char=at,
        message_index=index,
        role=str(role) if role is not None else None,
        cause=finding.cause,
        detail=finding.detail,
        old=window(old.text, at),
        new=window(new.text, at),
        recoverable_tokens=reappearing_tokens(
            old.rendering.token_ids, new.rendering.token_ids, position
        ),
    )


def window(text: str, at: int) -> str:
    return text[max(0, at - WINDOW_BEFORE) : at + WINDOW_AFTER]
