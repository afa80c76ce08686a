"""Ending a tool loop that the model cannot end by itself.

Why it is needed: after a tool result, the bundled Qwen2.5-Coder-0.5B writes a call almost
always (first-token probability of `{"` 0.92-0.99 after two tool results over eight phrasings of
one conversation, system prompts asking for an answer included; transformers, fp32). With
nothing new to ask it asks again for the calls it has just had answered (an echo), often then
the next call, and it does not answer in prose on its own: agent frameworks run the same tools
until their turn limit. Its answer is there once it is out of call mode: with the tools not
rendered and a call ruled out, it answers from the tool results.

The rule (tool_choice "auto", unless the request sends `repeated_tool_calls: "keep"`):
1. A call equal to one the conversation already answered (same function, equal arguments, and
   a tool message answering its id) is dropped from the reply.
2. If a reply had calls and none is left, the model asked for nothing new: the tool loop is
   over. Text before the calls, if any, is the answer; otherwise the model is asked for its
   answer once more, from the same messages with the tools not rendered and `ANSWER_GRAMMAR`.

3. A reply that cycles (its calls so far, each on a line of its own, are all answered ones and
   one of them is there twice) is stopped at the end of that line: the model is echoing, and
   what follows would be more of the echo. Without this the echo ran to `max_tokens` (measured:
   five repeats in 100 tokens after two tool results), which cost that decode time and left the
   answer of rule 2 no room, so the reply was empty.

A tool whose result changes between equal calls (reading a file after writing it, a die) can
make rule 1 drop a call the agent meant; such agents send `repeated_tool_calls: "keep"`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from agentserve.engine.request import Guide, RequestOutput
from agentserve.server.protocol import Message
from agentserve.server.tool_parsers import ToolCall, ToolParser, extract

CallKey = tuple[str, str]  # function name, arguments as canonical JSON

# Prose: it begins with a letter or digit and holds no JSON object, code fence or call tag.
# Excluding only `{"name"` was not enough: the model wrote `{"name**: ...` to get its call out.
ANSWER_GRAMMAR = r"""start: ANSWER
ANSWER: /[\p{L}\p{N}](?s:.*)/ & ~/(?s:.*(\{\s*"|```|<tool_call>|<function=).*)/
"""


def answer_guide() -> Guide:
    return Guide.lark(ANSWER_GRAMMAR)


def _canonical(value: Any) -> Any:
    """Equal JSON values compare equal: 21 and 21.0 are one number, key order is ignored."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def call_key(name: str, arguments: str | dict[str, Any]) -> CallKey | None:
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return None
    return name, json.dumps(_canonical(args), sort_keys=True)


def answered_calls(messages: Sequence[Message]) -> frozenset[CallKey]:
    """Calls some earlier assistant message made and some tool message answered."""
    made: dict[str, CallKey] = {}
    answered: set[CallKey] = set()
    for m in messages:
        for c in m.tool_calls or []:
            key = call_key(c.function.name, c.function.arguments)
            if key is not None:
                made[c.id] = key
        if m.role == "tool" and m.tool_call_id in made:
            answered.add(made[m.tool_call_id])
    return frozenset(answered)


@dataclasses.dataclass(frozen=True, slots=True)
class LoopDecision:
    """What rule 1 and 2 made of a reply's calls; `dropped` names its inputs for the record."""

    calls: tuple[ToolCall, ...]  # the new ones, in the reply's order
    dropped: tuple[ToolCall, ...]  # already answered
    ask_answer: bool  # rule 2 with no text before the calls: generate the answer

    def record(self) -> dict[str, Any]:
        return {"dropped_repeated_calls": [{"name": c.name, "arguments": c.arguments} for c in self.dropped],
                "answered_without_tools": self.ask_answer}


def decide(calls: tuple[ToolCall, ...], content: str | None, answered: frozenset[CallKey]) -> LoopDecision:
    repeated = [call_key(c.name, c.arguments) in answered for c in calls]
    kept = tuple(c for c, r in zip(calls, repeated) if not r)
    dropped = tuple(c for c, r in zip(calls, repeated) if r)
    return LoopDecision(kept, dropped, ask_answer=bool(calls) and not kept and content is None)


@dataclasses.dataclass(slots=True)
class EchoWatch:
    """Rule 3 over a reply as it grows (the text so far after each output)."""

    parser: ToolParser
    tools: Any  # the offered tools by name, as the parser takes them
    answered: frozenset[CallKey]
    seen: int = 0  # the last line end already looked at

    def cut(self, text: str) -> int | None:
        """Where to end the reply, or None to go on. Only whole lines are parsed: a call that
        is still being written is not a call yet."""
        end = text.rfind("\n")
        if end <= self.seen:
            return None
        self.seen = end
        parsed = extract(self.parser, text[:end], self.tools)
        if parsed.content is not None or not parsed.calls:
            return None
        keys = [call_key(c.name, c.arguments) for c in parsed.calls]
        cycling = len(set(keys)) < len(keys) and all(k in self.answered for k in keys)
        return end if cycling else None


def merged(reply: RequestOutput, answer: RequestOutput) -> RequestOutput:
    """Usage of a turn that took two generations: the client's prompt once, every generated
    token, and the answer's prompt work counted as recomputed (work beyond the one prompt)."""
    return dataclasses.replace(
        answer, num_prompt_tokens=reply.num_prompt_tokens, num_reused_tokens=reply.num_reused_tokens,
        num_prefilled_tokens=reply.num_prefilled_tokens,
        num_generated_tokens=reply.num_generated_tokens + answer.num_generated_tokens,
        num_recomputed_tokens=(reply.num_recomputed_tokens + answer.num_recomputed_tokens
                               + answer.num_prefilled_tokens),
        arrival_time=reply.arrival_time, first_scheduled_time=reply.first_scheduled_time,
        first_token_time=reply.first_token_time)
