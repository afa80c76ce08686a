"""Chat requests to prompt token ids with the model's own chat template; tool choice to a guide."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import jinja2

from agentserve.engine.request import Guide
from agentserve.server.errors import APIError
from agentserve.server.protocol import ChatCompletionRequest, Message, NamedToolChoice, Tool, check_json

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    token_ids: list[int]
    tools: dict[str, dict[str, Any]]  # offered tools by name: parse calls to these
    guide: Guide | None  # set for tool_choice "required" or a named function


def call_schema(tool: Tool) -> dict[str, Any]:
    """JSON schema of one call to `tool`, in the bare form the bundled model writes. The
    parameters move under `arguments`, so their local `$ref`s are rebased to point there."""
    arguments = _rebased(tool.function.parameters, "#/properties/arguments")
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": tool.function.name}, "arguments": arguments}}


_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA = frozenset({"const", "enum", "default", "examples"})  # values, not schemas: left as they are


def _rebased(schema: Any, base: str) -> Any:
    """The schema with its local `$ref`s ("#/...") pointing under `base`."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict) or "$id" in schema:
        return schema  # `$id` starts a resource of its own: its "#/..." refs are relative to it
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names to schemas: a name is no keyword
            out[key] = {name: _rebased(s, base) for name, s in value.items()}
        else:
            out[key] = value if key in _DATA else _rebased(value, base)
    return out


# JSON as json.dumps writes it (and the model does): whitespace is fixed, so a call cannot run
# on in blank space and the newline between calls is the only one.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


def calls_grammar(tools: list[Tool], parallel: bool) -> str:
    """Lark grammar (llguidance's dialect) of a forced reply: one call to one of `tools`, or
    with `parallel` one or more, one per line. Each tool's call is its own `%json` document,
    so every schema's `$ref`s resolve inside it."""
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    names = [f"call_{i}" for i in range(len(tools))]
    rules = [f"{n}: %json {json.dumps({**call_schema(t), 'x-guidance': _COMPACT})}" for n, t in zip(names, tools)]
    return "\n".join([start, "call: " + " | ".join(names), *rules]) + "\n"


def _check_tools(tools: list[Tool]) -> None:
    """The cheap checks, on the event loop; whether each schema compiles is checked off it, by
    server/grammars.py (cached per schema)."""
    names: set[str] = set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}].function.parameters"
        if tool.function.parameters.get("type", "object") not in ("object", ["object"]):
            raise APIError(400, f"{param}: function {tool.function.name!r}: must be a JSON schema of type object",
                           param=param)
        if tool.function.name in names:
            raise APIError(400, f"tools[{i}]: duplicate function name {tool.function.name!r}", param=f"tools[{i}]")
        names.add(tool.function.name)


def _guide(req: ChatCompletionRequest) -> Guide | None:
    """`required`: one or more calls (exactly one without parallel_tool_calls); a named
    function: exactly one call to it."""
    choice, tools = req.tool_choice, req.tools or []
    if choice in (None, "auto", "none"):
        return None
    if not tools:
        raise APIError(400, f"tool_choice {choice if isinstance(choice, str) else 'function'} needs tools",
                       param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name")
        chosen = [t for t in tools if t.function.name == name]
        if not chosen:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return Guide.lark(calls_grammar(chosen[:1], parallel=False))
    return Guide.lark(calls_grammar(tools, parallel=req.parallel_tool_calls))


def _arguments(raw: str | dict[str, Any], where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"{where}: arguments are not valid JSON: {exc.msg}", param=where) from exc
    except (ValueError, RecursionError) as exc:  # a number too long to convert, nesting too deep
        raise APIError(400, f"{where}: arguments are not valid JSON: {exc}", param=where) from exc
    if not isinstance(value, dict):
        raise APIError(400, f"{where}: arguments must be a JSON object", param=where)
    try:
        return check_json(value)
    except ValueError as exc:
        raise APIError(400, f"{where}: arguments {exc}", param=where) from exc


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them; checks that every tool result answers a call."""
    out: list[dict[str, Any]] = []
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.role == "assistant":
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
            calls = []
            for j, c in enumerate(m.tool_calls or []):
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments, where)}})
                open_calls.add(c.id)
            if calls:
                d["tool_calls"] = calls
        elif m.role == "tool":
            if m.tool_call_id is None or m.tool_call_id not in open_calls:
                raise APIError(400, f"messages[{i}]: tool message with tool_call_id {m.tool_call_id!r} "
                                    "answers no earlier assistant tool call", param=f"messages[{i}].tool_call_id")
            open_calls.discard(m.tool_call_id)
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
    """Prompt token ids. The template is the model's own Jinja code: on messages it did not
    expect it may raise anything (TemplateError from raise_exception, TypeError or KeyError from
    its expressions), and so may the tokenizer on what the template wrote. These are the
    request's fault and a 400, never a 500 (pydantic has already checked every field's type)."""
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as exc:
        log.info("chat template rejected a request: %r", exc)
        raise APIError(400, f"the model's chat template rejected these messages: {_reason(exc)}",
                       param="messages") from exc
    if not isinstance(text, str):
        raise APIError(400, "the model's chat template rendered no text for these messages",
                       param="messages")
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except Exception as exc:
        log.info("tokenizer rejected a rendered prompt: %r", exc)
        raise APIError(400, f"the tokenizer rejected the rendered messages: {_reason(exc)}",
                       param="messages") from exc


def _reason(exc: Exception) -> str:
    if isinstance(exc, jinja2.TemplateError):
        return str(exc)
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def build_chat_prompt(req: ChatCompletionRequest, tokenizer: Any) -> ChatPrompt:
    tools = req.tools or []
    _check_tools(tools)
    guide = _guide(req)
    offered = [] if req.tool_choice == "none" else tools
    messages = template_messages(req.messages)
    ids = _render(tokenizer, messages, [t.model_dump(exclude_none=True) for t in offered])
    return ChatPrompt(ids, {t.function.name: t.function.model_dump() for t in offered}, guide)
