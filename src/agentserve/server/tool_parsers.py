"""Tool-call parsers: one per output format, behind one interface.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call or
  several objects in one block (closing tag optional at the end)
- json: the reply is `{"name": ..., "arguments": ...}` objects, one per line (blank lines
  allowed), or lists of them, optionally in ```json fences: what Qwen2.5-Coder-0.5B writes
- qwen3_xml: `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`, repeated

Every call a reply holds is reported, in order; parallel_tool_calls is the route's business.
A parser reports calls only when they are clearly calls, and only to tools the request offered:
- json: a reply is calls only if it is nothing but JSON values (and fences). Prose anywhere,
  before, between or after call lines, makes the whole reply content: "I would call
  {"name": ...}" is an answer, not a call. Values that are not calls to offered tools (a tool
  result the model imagines after its call, an unknown tool) and a value cut off at the end
  (max_tokens) are left out when there are calls; a reply without calls is content as written.
- hermes / qwen3_xml: text before the first tag is content (a model may think aloud first);
  text between or after the blocks is dropped. Calls to tools not offered are left out as
  above; a hermes block that is not JSON makes the whole reply content.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None
    calls: tuple[ToolCall, ...]


class ToolParser(Protocol):
    # Where a call may begin, for streaming to hold text back: `markers` anywhere in the reply,
    # `start_markers` only as its first non-blank text.
    markers: tuple[str, ...]
    start_markers: tuple[str, ...]

    def parse(self, text: str, tools: Mapping[str, dict[str, Any]]) -> ParsedOutput | None:
        """The calls in text, or None when this format does not apply."""
        ...


def _call_from_obj(obj: Any, tools: Mapping[str, dict[str, Any]]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in tools:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_FENCE_OPEN = re.compile(r"```(?:json)?(?=\s|[{\[]|$)")  # ```python and the like do not match


def _json_values(text: str) -> list[Any] | None:
    """The JSON values in text, separated only by whitespace and ```json fences; None if
    anything else is there. The text may end inside a fence, or inside a value (max_tokens
    cut it off): that unfinished value is left out."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    i, fenced = 0, False
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return values
        if text.startswith("```", i):
            if fenced:
                i, fenced = i + 3, False
                continue
            fence = _FENCE_OPEN.match(text, i)
            if fence is None:
                return None
            i, fenced = fence.end(), True
            continue
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return values if _unfinished(text[i:]) else None
        values.append(value)


def _unfinished(tail: str) -> bool:
    """Whether tail is a JSON object or array cut off: opened, never closed, nothing mismatched."""
    if tail[:1] not in ("{", "["):
        return False
    stack: list[str] = []
    in_string = escaped = False
    for ch in tail:
        if in_string:
            in_string, escaped = (True, False) if escaped else (ch != '"', ch == "\\")
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack or stack.pop() != ch or not stack:
                return False  # mismatched, or a complete value (that did not parse)
    return True


def _calls_from_json(text: str, tools: Mapping[str, dict[str, Any]]) -> list[ToolCall] | None:
    """The calls among the JSON values that make up text (call objects, or lists of them, to
    offered tools); None if text is not only JSON. Other values next to calls (a tool result
    the model imagines after its call) are not calls and are left out."""
    values = _json_values(text)
    if values is None:
        return None
    calls: list[ToolCall] = []
    for value in values:
        found = [_call_from_obj(o, tools) for o in (value if isinstance(value, list) else [value])]
        if found and all(c is not None for c in found):
            calls.extend(found)  # type: ignore[arg-type]
    return calls


def _content(text: str) -> str | None:
    """Text before a call; trailing whitespace dropped (streaming holds it back too)."""
    text = text.rstrip()
    return text or None


class HermesParser:
    markers = ("<tool_call>",)
    start_markers = ()
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, tools: Mapping[str, dict[str, Any]]) -> ParsedOutput | None:
        """Text before the first block is content; text between or after blocks is dropped."""
        start = text.find("<tool_call>")
        if start < 0:
            return None
        calls: list[ToolCall] = []
        for body in self._block.findall(text, start):
            if body.lstrip().startswith("<function="):
                return None  # the XML form, not ours
            found = _calls_from_json(body, tools)
            if found is None:
                return None
            calls.extend(found)
        return ParsedOutput(_content(text[:start]), tuple(calls)) if calls else None


class JsonParser:
    markers = ()
    start_markers = ("{", "[", "```")

    def parse(self, text: str, tools: Mapping[str, dict[str, Any]]) -> ParsedOutput | None:
        calls = _calls_from_json(text, tools)
        return ParsedOutput(None, tuple(calls)) if calls else None


class Qwen3XmlParser:
    markers = ("<tool_call>", "<function=")
    start_markers = ()
    _function = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.DOTALL)
    _param = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

    def parse(self, text: str, tools: Mapping[str, dict[str, Any]]) -> ParsedOutput | None:
        start = text.find("<function=")
        if start < 0:
            return None
        tag = text.rfind("<tool_call>", 0, start)
        content_end = tag if tag >= 0 else start
        calls = []
        for name, body in self._function.findall(text, start):
            if name not in tools:
                continue
            props = tools[name].get("parameters", {}).get("properties", {})
            args = {p: _xml_value(v, props.get(p, {})) for p, v in self._param.findall(body)}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return ParsedOutput(_content(text[:content_end]), tuple(calls)) if calls else None


def _xml_value(raw: str, schema: Mapping[str, Any]) -> Any:
    """Parameter text to a JSON value: strings stay text, other declared types parse as JSON."""
    if schema.get("type", "string") == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw



def get_parser(name: str) -> ToolParser:
    parsers = {"hermes": HermesParser(), "json": JsonParser(), "qwen3_xml": Qwen3XmlParser()}
    if name == "auto":
        return AnyParser(tuple(parsers.values()))
    if name not in parsers:
        raise ValueError(f"unknown tool parser {name!r}; choose one of auto, {', '.join(parsers)}")
    return parsers[name]


class AnyParser:
    """Tries each format in turn: the first that finds calls wins."""

    def __init__(self, parsers: Sequence[ToolParser]) -> None:
        self.parsers = tuple(parsers)
        self.markers = tuple(dict.fromkeys(m for p in parsers for m in p.markers))
        self.start_markers = tuple(dict.fromkeys(m for p in parsers for m in p.start_markers))

    def parse(self, text: str, tools: Mapping[str, dict[str, Any]]) -> ParsedOutput | None:
        for p in self.parsers:
            out = p.parse(text, tools)
            if out is not None:
                return out
        return None


def extract(parser: ToolParser, text: str, tools: Mapping[str, dict[str, Any]]) -> ParsedOutput:
    """Content and calls of a whole reply; a reply with no calls is all content. A parser
    that fails on odd text (deep nesting: RecursionError) leaves it all content: a reply is
    never lost to its parser."""
    try:
        parsed = parser.parse(text, tools)
    except Exception:
        log.exception("tool-call parser %s failed; the reply stays content", type(parser).__name__)
        parsed = None
    return parsed or ParsedOutput(text if text else None, ())


class StreamingToolParser:
    """Text deltas in, content deltas out; calls at the end.

    Invariant: the content emitted so far is always a prefix of the final content, so a
    streamed reply and the same reply parsed at once give the same content and calls. Text
    that may still turn out to be a call is held back: all of it once the reply opens with a
    start marker, else from the first marker (or a suffix that could grow into one), and
    trailing whitespace."""

    def __init__(self, parser: ToolParser, tools: Mapping[str, dict[str, Any]]) -> None:
        self.parser = parser
        self.tools = tools
        self.text = ""
        self.emitted = 0

    def feed(self, delta: str) -> str:
        self.text += delta
        end = max(self.emitted, self._safe_end())
        out, self.emitted = self.text[self.emitted : end], end
        return out

    def cut(self, end: int) -> None:
        """The reply ends at `end` (the server stopped it there; nothing after it was shown)."""
        assert self.emitted <= end <= len(self.text)
        self.text = self.text[:end]

    def finish(self) -> tuple[str, ParsedOutput]:
        """The content not yet emitted, and the whole parsed reply."""
        parsed = extract(self.parser, self.text, self.tools)
        content = parsed.content or ""
        rest = content[self.emitted :] if content.startswith(self.text[: self.emitted]) else ""
        self.emitted = len(self.text)
        return rest, parsed

    def _safe_end(self) -> int:
        s = self.text
        body = s.lstrip()
        if not body or any(m.startswith(body[: len(m)]) for m in self.parser.start_markers):
            return 0
        end = len(s.rstrip())
        for m in self.parser.markers:
            i = s.find(m)
            if i >= 0:
                end = min(end, i)
            for k in range(min(len(m) - 1, len(s)), 0, -1):  # a marker may be starting
                if s.endswith(m[:k]):
                    end = min(end, len(s) - k)
                    break
        return len(s[:end].rstrip())
