"""Chat requests to prompt token ids with the model's own chat template; tool choice to a guide."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jinja2

from agentserve.engine.request import Guide
from agentserve.server.errors import APIError
from agentserve.server.protocol import ChatCompletionRequest, Message, NamedToolChoice, Tool


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    token_ids: list[int]
    tools: dict[str, dict[str, Any]]  # offered tools by name: parse calls to these
    guide: Guide | None  # set for tool_choice "required" or a named function


def call_schema(tool: Tool) -> dict[str, Any]:
    """JSON schema of one call to `tool`, in the bare form the bundled model writes."""
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": tool.function.name}, "arguments": tool.function.parameters}}


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
        return Guide.json_schema(json.dumps(call_schema(chosen[0])))
    return Guide.json_schema(json.dumps({"anyOf": [call_schema(t) for t in tools]}))


def _arguments(raw: str | dict[str, Any], where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"{where}: arguments are not valid JSON: {exc.msg}", param=where) from exc
    if not isinstance(value, dict):
        raise APIError(400, f"{where}: arguments must be a JSON object", param=where)
    return value


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


def build_chat_prompt(req: ChatCompletionRequest, tokenizer: Any) -> ChatPrompt:
    tools = req.tools or []
    _check_tools(tools)
    guide = _guide(req)
    offered = [] if req.tool_choice == "none" else tools
    messages = template_messages(req.messages)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=[t.model_dump(exclude_none=True) for t in offered] or None,
            add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as exc:
        raise APIError(400, f"the model's chat template rejected these messages: {exc}", param="messages") from exc
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ChatPrompt(ids, {t.function.name: t.function.model_dump() for t in offered}, guide)
