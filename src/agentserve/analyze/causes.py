"""Why two renderings stop agreeing: the rules, each confirmed by the renderings themselves.

`old` is the previous request's full sequence, `new` this request's prompt. Rules run in a fixed
order (tools, removed turns, dropped reasoning, volatile values, serialization, rewritten tool
results, system prompt, other edits) and the first that the texts confirm wins; the message
lists only say where to look. Nothing matching gives `unexplained`, never a guess.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from agentserve.analyze.messages import (
    Message,
    content_text,
    reasoning_text,
    server_messages,
    tool_names,
)
from agentserve.analyze.prefix import common_prefix
from agentserve.analyze.render import Renderer, Rendering
from agentserve.analyze.spans import MessageSpans, tools_region
from agentserve.analyze.volatile import volatile_change


class Cause(Enum):
    VOLATILE = "volatile_text"
    TOOLS_REORDERED = "tools_reordered"
    TOOLS_ADDED = "tools_added"
    TOOLS_REMOVED = "tools_removed"
    TOOLS_CHANGED = "tools_changed"
    SERIALIZATION = "serialization"  # JSON key order or whitespace
    REASONING_DROPPED = "reasoning_dropped"
    TOOL_RESULT_REWRITTEN = "tool_result_rewritten"
    TURN_REMOVED = "turn_removed"
    MESSAGE_EDITED = "message_edited"
    TEMPLATE_REWRITE = "template_rewrite"  # same message, rendered differently later
    SYSTEM_PROMPT_CHANGED = "system_prompt_changed"
    UNEXPLAINED = "unexplained"


@dataclass(frozen=True, slots=True)
class Side:
    """One of the two renderings compared, with what it was rendered from."""

    messages: tuple[Message, ...]
    tools: tuple[Message, ...] | None
    rendering: Rendering
    generation: bool

    @property
    def text(self) -> str:
        return self.rendering.text


@dataclass(frozen=True, slots=True)
class Finding:
    cause: Cause
    detail: str


@dataclass(frozen=True, slots=True)
class Comparison:
    """What a rule looks at: both sides, the first differing character, and message spans."""

    renderer: Renderer
    old: Side
    new: Side
    at: int
    old_spans: MessageSpans
    new_spans: MessageSpans
    index: int  # message of `old` holding `at`

    def both(self, index: int) -> tuple[Message, Message] | None:
        """Message `index` of both sides, when both have it."""
        if index < len(self.old.messages) and index < len(self.new.messages):
            return self.old.messages[index], self.new.messages[index]
        return None


def compare(renderer: Renderer, old: Side, new: Side) -> Comparison:
    at = common_prefix(old.text, new.text)
    old_spans = MessageSpans(renderer, old.messages, old.tools, old.text)
    new_spans = MessageSpans(renderer, new.messages, new.tools, new.text)
    return Comparison(renderer, old, new, at, old_spans, new_spans, old_spans.locate(at))


def classify(c: Comparison) -> Finding:
    if c.at >= min(len(c.old.text), len(c.new.text)):
        detail = "the texts agree; one ends inside a token of the other"
        return Finding(Cause.UNEXPLAINED, detail)
    for rule in _RULES:
        finding = rule(c)
        if finding is not None:
            return finding
    return Finding(Cause.UNEXPLAINED, "the renderings differ here for no recognised reason")


def _tools(c: Comparison) -> Finding | None:
    old_region = tools_region(
        c.renderer, c.old.messages, c.old.tools, c.old.text, generation=c.old.generation
    )
    new_region = tools_region(
        c.renderer, c.new.messages, c.new.tools, c.new.text, generation=c.new.generation
    )
    if not (_inside(old_region, c.at) or _inside(new_region, c.at)):
        return None
    names = list(dict.fromkeys(tool_names(c.old.tools) + tool_names(c.new.tools)))
    old_order = _rendered_order(names, c.old.text, old_region)
    new_order = _rendered_order(names, c.new.text, new_region)
    added = [n for n in new_order if n not in old_order]
    removed = [n for n in old_order if n not in new_order]
    if added and removed:
        detail = f"tools replaced: added {_names(added)}; removed {_names(removed)}"
        return Finding(Cause.TOOLS_CHANGED, detail)
    if added or removed:
        cause = Cause.TOOLS_ADDED if added else Cause.TOOLS_REMOVED
        return Finding(cause, f"tool {'added' if added else 'removed'}: {_names(added + removed)}")
    if old_order != new_order:
        detail = f"tool order {_names(old_order)} → {_names(new_order)}"
        return Finding(Cause.TOOLS_REORDERED, detail)
    old_text, new_text = _region_text(c.old.text, old_region), _region_text(c.new.text, new_region)
    if canonical(old_text) == canonical(new_text):
        return Finding(
            Cause.SERIALIZATION, "tool definitions: " + _how_serialized(old_text, new_text)
        )
    before = [n for n in old_order if _position(n, c.old.text, old_region) <= c.at]
    changed = before[-1] if before else (old_order[0] if old_order else "?")
    return Finding(Cause.TOOLS_CHANGED, f"definition of tool {changed!r} changed")


def _turn_removed(c: Comparison) -> Finding | None:
    """Cutting messages j.. out of the old rendering makes it agree with the new one past the
    next message: those turns were removed."""
    j = c.index
    for count in (1, 2, 3):
        if j + count >= len(c.old.messages):
            return None
        start, end = c.old_spans.span(j)[0], c.old_spans.span(j + count - 1)[1]
        next_end = c.old_spans.span(j + count)[1]
        agreed = common_prefix(c.old.text[:start] + c.old.text[end:], c.new.text)
        if agreed > c.at and agreed >= min(len(c.new.text), start + next_end - end):
            roles = ", ".join(str(m.get("role")) for m in c.old.messages[j : j + count])
            which = f"message {j}" if count == 1 else f"messages {j}-{j + count - 1}"
            return Finding(Cause.TURN_REMOVED, f"{which} ({roles}) of the previous request removed")
    return None


def _reasoning_dropped(c: Comparison) -> Finding | None:
    pair = c.both(c.index)
    if pair is None or pair[0].get("role") != "assistant":
        return None
    reasoning = reasoning_text(pair[0]).strip()
    start, end = c.old_spans.span(c.index)
    found = c.old.text.find(reasoning, start, end) if reasoning else -1
    if found < 0 or c.at > found + len(reasoning) or reasoning in c.new_spans.piece(c.index):
        return None
    by = "the template" if reasoning_text(pair[1]).strip() else "the harness"
    detail = f"{by} dropped the reasoning of message {c.index} ({len(reasoning)} characters)"
    return Finding(Cause.REASONING_DROPPED, detail)


def _volatile(c: Comparison) -> Finding | None:
    change = volatile_change(c.old.text, c.new.text, c.at)
    if change is None:
        return None
    return Finding(Cause.VOLATILE, f"{change.kind} {change.old!r} → {change.new!r}")


def _serialization(c: Comparison) -> Finding | None:
    if c.both(c.index) is None:
        return None
    old_piece, new_piece = c.old_spans.piece(c.index), c.new_spans.piece(c.index)
    if old_piece == new_piece or canonical(old_piece) != canonical(new_piece):
        return None
    detail = f"message {c.index}: {_how_serialized(old_piece, new_piece)}"
    return Finding(Cause.SERIALIZATION, detail)


def _tool_result(c: Comparison) -> Finding | None:
    pair = c.both(c.index)
    if pair is None or not all(m.get("role") == "tool" for m in pair):
        return None
    if c.old_spans.piece(c.index) == c.new_spans.piece(c.index):
        return None
    old, new = (content_text(m.get("content")) for m in pair)
    shorter = len(new) < len(old)
    how = (
        "truncated"
        if shorter and common_prefix(old, new) >= len(new) // 2
        else ("summarized" if shorter else "rewritten")
    )
    detail = f"tool result (message {c.index}) {how}: {len(old)} → {len(new)} characters"
    return Finding(Cause.TOOL_RESULT_REWRITTEN, detail)


def _system_prompt(c: Comparison) -> Finding | None:
    pair = c.both(c.index)
    roles = {m.get("role") for m in pair} if pair else set()
    if not roles & {"system", "developer"}:
        return None
    if len(roles) == 1:
        how = "changed"
    else:
        how = "added" if pair[1].get("role") in ("system", "developer") else "removed"
    return Finding(Cause.SYSTEM_PROMPT_CHANGED, f"system message {c.index} {how}")


def _history_edit(c: Comparison) -> Finding | None:
    pair = c.both(c.index)
    if pair is None:
        return None
    role = pair[1].get("role")
    if server_messages([pair[0]]) == server_messages([pair[1]]):
        detail = f"message {c.index} ({role}) is unchanged but the template renders it differently"
        return Finding(Cause.TEMPLATE_REWRITE, detail + " once later messages follow")
    if c.index == len(c.old.messages) - 1 and role == "assistant":
        detail = f"message {c.index} is not the reply the previous request generated"
        return Finding(Cause.MESSAGE_EDITED, detail)
    return Finding(Cause.MESSAGE_EDITED, f"message {c.index} ({role}) was changed")


_RULES: tuple[Callable[[Comparison], Finding | None], ...] = (
    _tools,
    _turn_removed,
    _reasoning_dropped,
    _volatile,
    _serialization,
    _tool_result,
    _system_prompt,
    _history_edit,
)


def canonical(text: str) -> str:
    """`text` with every JSON value re-serialized with sorted keys, and no whitespace."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i] in "{[":
            try:
                value, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                pass
            else:
                out.append(json.dumps(value, sort_keys=True, separators=(",", ":")))
                i = end
                continue
        out.append(text[i])
        i += 1
    return re.sub(r"\s+", "", "".join(out))


def _how_serialized(old: str, new: str) -> str:
    if re.sub(r"\s+", "", old) == re.sub(r"\s+", "", new):
        return "same text, different whitespace"
    return "same JSON, keys in a different order or spacing"


def _inside(region: tuple[int, int] | None, at: int) -> bool:
    return region is not None and region[0] <= at <= region[1]


def _region_text(text: str, region: tuple[int, int] | None) -> str:
    return text[region[0] : region[1]] if region else ""


def _position(name: str, text: str, region: tuple[int, int] | None) -> int:
    """Where tool `name` first appears as a whole word in the region; -1 if it does not."""
    if region is None:
        return -1
    match = re.compile(r"(?<![\w.\-])" + re.escape(name) + r"(?![\w\-])").search(
        text, region[0], region[1]
    )
    return match.start() if match else -1


def _rendered_order(names: list[str], text: str, region: tuple[int, int] | None) -> list[str]:
    found = [(p, n) for n in names if (p := _position(n, text, region)) >= 0]
    return [n for _, n in sorted(found)]


def _names(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … (+{len(names) - limit})" if len(names) > limit else "")
