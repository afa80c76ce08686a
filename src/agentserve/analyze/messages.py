"""OpenAI-style messages and tools: checks before rendering, and what a server does to them.

Servers (vLLM, SGLang) flatten text content parts into one string, render a missing content as
"", and parse tool-call arguments from their JSON string into an object (key order kept) before
the chat template sees them; `server_messages` does the same so renderings match a server's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TypeAlias

JsonValue: TypeAlias = "str | int | float | bool | list[JsonValue] | dict[str, JsonValue] | None"
Message: TypeAlias = "dict[str, JsonValue]"

ROLES = ("system", "developer", "user", "assistant", "tool")


class MessageError(ValueError):
    """A message that cannot be rendered; `message_index` is 0-based in its request."""

    def __init__(self, message_index: int, text: str) -> None:
        super().__init__(text)
        self.message_index = message_index


def check_tools(tools: JsonValue) -> tuple[dict[str, JsonValue], ...] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError('"tools" must be a list of objects')
    return tuple(tools) if tools else None


def check_messages(messages: Sequence[JsonValue]) -> None:
    """Raise MessageError for the first message with an unknown role, a bad shape, or a tool
    result that answers no call."""
    open_calls: set[str] | None = None  # ids of the calls the latest tool-calling turn made
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise MessageError(index, f"message {index} is not an object")
        role = message.get("role")
        if role not in ROLES:
            raise MessageError(index, f"message {index} has unknown role {role!r}")
        _check_content(index, message)
        if role == "assistant":
            open_calls = _call_ids(index, message)
        elif role == "tool":
            _check_tool_result(index, message, open_calls)
        else:
            open_calls = None


def _check_content(index: int, message: dict[str, JsonValue]) -> None:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return
    raise MessageError(index, f"message {index}: content must be a string or a list of parts")


def _call_ids(index: int, message: dict[str, JsonValue]) -> set[str] | None:
    calls = message.get("tool_calls")
    if not calls:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise MessageError(index, f"message {index}: tool_calls must be a list of objects")
    for call in calls:
        function = call.get("function", call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise MessageError(index, f"message {index}: a tool call has no function name")
    return {str(c["id"]) for c in calls if c.get("id") is not None}


def _check_tool_result(
    index: int, message: dict[str, JsonValue], open_calls: set[str] | None
) -> None:
    if open_calls is None:
        raise MessageError(
            index, f"message {index} is a tool result with no preceding assistant tool call"
        )
    call_id = message.get("tool_call_id")
    if open_calls and call_id is not None and str(call_id) not in open_calls:
        raise MessageError(
            index, f"message {index}: tool_call_id {call_id!r} matches no preceding tool call"
        )


def server_messages(messages: Sequence[Message]) -> list[Message]:
    """Copies of `messages` as a server hands them to the chat template."""
    return [_server_message(m) for m in messages]


def _server_message(message: Message) -> Message:
    out = dict(message)
    out["content"] = content_text(message.get("content"))
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        out["tool_calls"] = [_server_call(c) for c in calls if isinstance(c, dict)]
    return out


def _server_call(call: dict[str, JsonValue]) -> dict[str, JsonValue]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def content_text(content: JsonValue) -> str:
    """The text of a message's content: a string, "" for none, text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return "\n".join(str(p.get("text", "")) for p in parts if isinstance(p, dict) and "text" in p)


def tool_names(tools: Sequence[Message] | None) -> list[str]:
    names = []
    for tool in tools or ():
        function = tool.get("function", tool)
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str):
            names.append(name)
    return names


def reasoning_text(message: Message) -> str:
    """`reasoning_content`, or the `<think>` part of the content (Qwen3 style)."""
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        return reasoning
    content = content_text(message.get("content"))
    if "</think>" not in content:
        return ""
    return content.split("</think>")[0].replace("<think>", "")
