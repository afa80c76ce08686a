"""Read agent transcripts into requests: whole sessions, one request per line, or request logs.

Three shapes are accepted, told apart by content (`detect_format`):
- a session: one JSON document `{"tools": [...], "messages": [...]}` with the assistant replies
  inline, or `{"sessions": [...]}` / a JSON array of sessions. Each assistant message that follows
  a non-assistant message is the reply to one request whose prompt is everything before it; a
  run of user/tool messages (parallel tool results) therefore starts one request.
- requests: JSONL, one `{"tools", "messages"}` request per line, optionally with a `response`
  (an assistant message or a chat completion) and a `session` key to separate sessions.
- an OpenAI chat-completions request log: JSONL of `{"request": {...}, "response": {...}}`.

Problems are collected, never raised: everything before the first bad record is still analyzed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from agentserve.analyze.messages import (
    JsonValue,
    Message,
    MessageError,
    check_messages,
    check_tools,
)


@dataclass(frozen=True, slots=True)
class Problem:
    """Something the analyzer could not use, and where: `file:line` or `file: session, message`."""

    where: str
    text: str

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


@dataclass(frozen=True, slots=True)
class Request:
    """One request as a server sees it, and the reply it generated (None when not recorded)."""

    index: int  # 1-based within its session
    messages: tuple[Message, ...]
    tools: tuple[Message, ...] | None
    reply: Message | None
    where: str


@dataclass(frozen=True, slots=True)
class Session:
    name: str
    requests: tuple[Request, ...]


@dataclass(frozen=True, slots=True)
class Transcript:
    sessions: tuple[Session, ...]
    problems: tuple[Problem, ...]


# One per-request record: where, messages, tools, reply.
_Row: TypeAlias = "tuple[str, list[Message], tuple[Message, ...] | None, Message | None]"


class InputError(ValueError):
    """A record that cannot be used; `where` says which."""

    def __init__(self, where: str, text: str) -> None:
        super().__init__(f"{where}: {text}")
        self.problem = Problem(where, text)


def load_transcript(path: Path, fmt: str = "auto") -> Transcript:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return Transcript((), (Problem(str(path), f"cannot read: {exc}"),))
    return parse_transcript(text, str(path), fmt)


def parse_transcript(text: str, name: str, fmt: str = "auto") -> Transcript:
    """Parse `text` (from file `name`); fmt is "auto", "session" or "requests"."""
    fmt = detect_format(text) if fmt == "auto" else fmt
    if fmt == "requests":
        return _parse_lines(text, name)
    if fmt != "session":
        raise ValueError(f"unknown transcript format {fmt!r}")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"{name}:{exc.lineno}:{exc.colno}"
        return Transcript((), (Problem(where, f"malformed JSON: {exc.msg}"),))
    return _parse_document(document, name)


def detect_format(text: str) -> str:
    """JSONL when there are several non-empty lines and the first is a whole JSON object."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        return "session"
    try:
        first = json.loads(lines[0])
    except json.JSONDecodeError:
        return "session"
    return "requests" if isinstance(first, dict) else "session"


def _parse_document(document: JsonValue, name: str) -> Transcript:
    if isinstance(document, dict) and "sessions" in document:
        items = document["sessions"]
    elif isinstance(document, dict):
        items = [document]
    else:
        items = document
    if not isinstance(items, list) or not items:
        return Transcript((), (Problem(name, "expected a session object or a list of them"),))
    if all(isinstance(item, dict) and _is_log_entry(item) for item in items):
        records = [(f"{name}: entry {i + 1}", item) for i, item in enumerate(items)]
        return _group_requests(records)
    sessions: list[Session] = []
    problems: list[Problem] = []
    for number, item in enumerate(items, start=1):
        label = f"session {number}" if len(items) > 1 else "session"
        session, problem = _split_session(item, f"{name}: {label}", _session_name(item, number))
        if session is not None and session.requests:
            sessions.append(session)
        elif problem is None:
            problem = Problem(
                f"{name}: {label}", "no request: no message before an assistant reply"
            )
        if problem is not None:
            problems.append(problem)
    return Transcript(tuple(sessions), tuple(problems))


def _session_name(item: JsonValue, number: int) -> str:
    name = item.get("name") or item.get("session") if isinstance(item, dict) else None
    return str(name) if name else f"session {number}"


def _split_session(item: JsonValue, where: str, name: str) -> tuple[Session | None, Problem | None]:
    """Cut a whole session into requests; on a bad message keep the requests before it."""
    if not isinstance(item, dict) or not isinstance(item.get("messages"), list):
        return None, Problem(where, 'a session needs a "messages" list')
    messages: list[Message] = item["messages"]
    problem = None
    try:
        tools = check_tools(item.get("tools"))
    except ValueError as exc:
        return None, Problem(where, str(exc))
    try:
        check_messages(messages)
    except MessageError as exc:
        problem = Problem(where, str(exc))
        messages = messages[: exc.message_index]
    requests: list[Request] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and i > 0 and messages[i - 1]["role"] != "assistant":
            requests.append(Request(len(requests) + 1, tuple(messages[:i]), tools, message, where))
    if problem is None and messages and messages[-1]["role"] != "assistant":
        requests.append(Request(len(requests) + 1, tuple(messages), tools, None, where))
    return Session(name, tuple(requests)), problem


def _is_log_entry(item: dict[str, JsonValue]) -> bool:
    return isinstance(item.get("request"), dict)


def _parse_lines(text: str, name: str) -> Transcript:
    """JSONL: stop at the first bad line, keeping the requests before it."""
    records: list[tuple[str, dict[str, JsonValue]]] = []
    problem: Problem | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            problem = Problem(f"{where}:{exc.colno}", f"malformed JSON: {exc.msg}")
            break
        if not isinstance(record, dict):
            problem = Problem(where, "expected a JSON object")
            break
        records.append((where, record))
    transcript = _group_requests(records)
    extra = (problem,) if problem else ()
    return Transcript(transcript.sessions, transcript.problems + extra)


def _group_requests(records: list[tuple[str, dict[str, JsonValue]]]) -> Transcript:
    """Per-request records → sessions (by their `session` key, in order of first appearance)."""
    groups: dict[str, list[_Row]] = {}
    problem: Problem | None = None
    for where, record in records:
        try:
            body, response = _request_body(record, where)
            check_messages([*body["messages"], *([response] if response else [])])
            tools = check_tools(body.get("tools"))
        except InputError as exc:
            problem = exc.problem
            break
        except ValueError as exc:
            problem = Problem(where, str(exc))
            break
        key = str(record.get("session") or body.get("session_id") or "session 1")
        groups.setdefault(key, []).append((where, body["messages"], tools, response))
    sessions = tuple(_session_from_lines(key, rows) for key, rows in groups.items())
    return Transcript(sessions, (problem,) if problem else ())


def _request_body(
    record: dict[str, JsonValue], where: str
) -> tuple[dict[str, JsonValue], Message | None]:
    body = record["request"] if _is_log_entry(record) else record
    if not isinstance(body.get("messages"), list):
        raise InputError(where, 'a request needs a "messages" list')
    return body, _reply_from(record.get("response"), where)


def _reply_from(response: JsonValue, where: str) -> Message | None:
    """An assistant message, or the first choice's message of a chat completion."""
    if response is None:
        return None
    if isinstance(response, dict) and isinstance(response.get("choices"), list):
        choices = response["choices"]
        response = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
    if not isinstance(response, dict) or response.get("role", "assistant") != "assistant":
        raise InputError(where, "response is not an assistant message or chat completion")
    return {"role": "assistant", **response}


def _session_from_lines(key: str, rows: list[_Row]) -> Session:
    """A missing reply is the assistant message the next request carries right after this one's."""
    requests: list[Request] = []
    for i, (where, messages, tools, reply) in enumerate(rows):
        if reply is None and i + 1 < len(rows):
            following = rows[i + 1][1]
            if len(following) > len(messages) and following[len(messages)]["role"] == "assistant":
                reply = following[len(messages)]
        requests.append(Request(i + 1, tuple(messages), tools, reply, where))
    return Session(key, tuple(requests))
