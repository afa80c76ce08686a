"""Cross-session sharing: how many tokens two unrelated sessions' first prompts share at the
start (what one shared cache serves to everyone), and how many they would share if the volatile
values that split them were moved to the end of the prompt."""

from __future__ import annotations

from dataclasses import dataclass

from agentserve.analyze.messages import Message, content_text
from agentserve.analyze.prefix import common_prefix
from agentserve.analyze.render import Renderer
from agentserve.analyze.transcript import Request, Session
from agentserve.analyze.volatile import volatile_change

MAX_MOVES = 8  # volatile values moved before giving up
_STOPS = (". ", "! ", "? ")


@dataclass(frozen=True, slots=True)
class Sharing:
    first: str  # session names
    second: str
    first_prompt_tokens: int
    second_prompt_tokens: int
    shared_tokens: int
    shared_tokens_volatile_last: int  # with the splitting volatile lines moved to the end
    moved: tuple[str, ...]  # the volatile values moved, "old → new"


def compare_sessions(renderer: Renderer, first: Session, second: Session) -> Sharing:
    """Raises TemplateError if a first request cannot be rendered."""
    a, b = first.requests[0], second.requests[0]
    ids_a = renderer.rendering(a.messages, a.tools, generation=True).token_ids
    ids_b = renderer.rendering(b.messages, b.tools, generation=True).token_ids
    moved_a, moved_b, moved = _move_volatile(renderer, a, b)
    after_a = renderer.rendering(moved_a, a.tools, generation=True).token_ids
    after_b = renderer.rendering(moved_b, b.tools, generation=True).token_ids
    return Sharing(
        first=first.name,
        second=second.name,
        first_prompt_tokens=len(ids_a),
        second_prompt_tokens=len(ids_b),
        shared_tokens=common_prefix(ids_a, ids_b),
        shared_tokens_volatile_last=common_prefix(after_a, after_b),
        moved=tuple(moved),
    )


def _move_volatile(
    renderer: Renderer, a: Request, b: Request
) -> tuple[list[Message], list[Message], list[str]]:
    """While the two renderings first differ at a volatile value, move the sentence holding it,
    in each request, to the end of that request's last message."""
    messages_a, messages_b, moved = list(a.messages), list(b.messages), []
    for _ in range(MAX_MOVES):
        text_a = renderer.text(messages_a, a.tools, generation=True)
        text_b = renderer.text(messages_b, b.tools, generation=True)
        change = volatile_change(text_a, text_b, common_prefix(text_a, text_b))
        if change is None:
            break
        next_a = move_sentence(messages_a, change.old)
        next_b = move_sentence(messages_b, change.new)
        if next_a is None or next_b is None:
            break  # the value is not in a message's text (a tool, or the template itself)
        moved_a = renderer.text(next_a, a.tools, generation=True)
        moved_b = renderer.text(next_b, b.tools, generation=True)
        if common_prefix(moved_a, moved_b) <= common_prefix(text_a, text_b):
            break  # moving it shares nothing more
        messages_a, messages_b = next_a, next_b
        moved.append(f"{change.old} → {change.new}")
    return messages_a, messages_b, moved


def move_sentence(messages: list[Message], value: str) -> list[Message] | None:
    """Copies of `messages` with the first sentence (or line) containing `value` moved to the
    end of the last message; None when no message text contains it."""
    for index, message in enumerate(messages):
        text = content_text(message.get("content"))
        at = text.find(value)
        if at < 0:
            continue
        start, end = _sentence(text, at, at + len(value))
        out = [dict(m) for m in messages]
        out[index]["content"] = text[:start] + text[end:].lstrip(" ")
        last = content_text(out[-1].get("content")).rstrip("\n")
        sentence = text[start:end].strip()
        out[-1]["content"] = f"{last}\n{sentence}" if last else sentence
        return out
    return None


def _sentence(text: str, start: int, end: int) -> tuple[int, int]:
    """The sentence around text[start:end]: from after the previous ". " or line break to the
    next sentence end or line break."""
    before = max(text.rfind("\n", 0, start), *(text.rfind(p, 0, start) + 1 for p in _STOPS))
    stops = [i for i in (text.find(p, end) for p in (*_STOPS, ".\n")) if i >= 0]
    newline = text.find("\n", end)
    line_end = newline + 1 if newline >= 0 else len(text)  # a whole line takes its line break
    return before + 1, min([*(i + 1 for i in stops), line_end])
