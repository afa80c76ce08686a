"""POST /v1/chat/completions: rendering, generation, tool-call parsing, streaming."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from agentserve.engine.request import RequestOutput
from agentserve.server.chat import ChatPrompt, build_chat_prompt
from agentserve.server.generation import (
    DONE, FINISH, Generation, TextState, run_one_shot, sse, streaming, usage)
from agentserve.server.protocol import ChatCompletionRequest
from agentserve.server.tool_loop import (CallKey, EchoWatch, LoopDecision, answer_guide, answered_calls, decide,
                                        merged)
from agentserve.server.tool_parsers import (ParsedOutput, StreamingToolParser, ToolCall, ToolParser, extract,
                                            get_parser)

if TYPE_CHECKING:
    from agentserve.server.app import ServerState


def _calls(request_id: str, calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    return [{"id": f"call_{request_id.removeprefix('chatcmpl-')}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]


def _tool_parser(state: ServerState, prompt: ChatPrompt) -> ToolParser:
    """A forced reply is in the grammar's format (bare JSON, one call per line), whatever the
    server's parser is."""
    return get_parser("json") if prompt.guide is not None else state.tool_parser


def _finish_reason(reason: str, has_calls: bool) -> str:
    return "tool_calls" if has_calls else FINISH.get(reason, reason)


@dataclass(frozen=True, slots=True)
class _Turn:
    """A chat turn's context for what follows its generation: which calls to report, and the
    second generation that ends a tool loop (server/tool_loop.py)."""

    state: ServerState
    body: ChatCompletionRequest
    request: Request
    request_id: str
    answered: frozenset[CallKey] | None  # None: the loop rule is off (forced call, "keep", no tools)

    @staticmethod
    def of(state: ServerState, body: ChatCompletionRequest, request: Request, request_id: str,
           prompt: ChatPrompt) -> _Turn:
        on = bool(prompt.tools) and prompt.guide is None and body.repeated_tool_calls == "drop"
        return _Turn(state, body, request, request_id, answered_calls(body.messages) if on else None)

    def watch(self, parser: StreamingToolParser | None) -> EchoWatch | None:
        """Rule 3's watch over the reply, where the loop rule is on."""
        if self.answered is None or parser is None:
            return None
        return EchoWatch(parser.parser, parser.tools, self.answered)

    def decide(self, parsed: ParsedOutput) -> LoopDecision:
        if self.answered is None:
            decision = LoopDecision(parsed.calls, (), ask_answer=False)
        else:
            decision = decide(parsed.calls, parsed.content, self.answered)
        if not self.body.parallel_tool_calls:  # the first (new) call only
            decision = LoopDecision(decision.calls[:1], decision.dropped, decision.ask_answer)
        return decision

    async def answer(self, reply: RequestOutput, first: Generation) -> tuple[Generation, TextState] | None:
        """The model's answer without tools, as a second request with a queue slot of its own
        (the caller closes it); None when max_tokens leaves no room for it."""
        limit = self.body.max_completion_tokens or self.body.max_tokens
        left = None if limit is None else limit - reply.num_generated_tokens
        if left is not None and left < 1:
            return None
        state, body = self.state, self.body.model_copy(update={"tool_choice": "none", "min_tokens": 0})
        prompt = build_chat_prompt(body, state.tokenizer)
        guide = answer_guide()
        await state.grammars.prepare([], guide)
        sampling = state.sampling(body, len(prompt.token_ids), left, guide)
        rid = f"{self.request_id}-answer"
        gen = await state.start(self.request, rid, prompt.token_ids, sampling, body, "chat",
                                slot=state.enter(), track=False, within=first)
        return gen, TextState(state.tokenizer, sampling.stop)


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        state.check_model(body.model)
        prompt = build_chat_prompt(body, state.tokenizer)
        await state.grammars.prepare(body.tools or [], prompt.guide)
        sampling = state.sampling(body, len(prompt.token_ids), body.max_completion_tokens or body.max_tokens,
                                  prompt.guide)
        rid = f"chatcmpl-{next(state.ids)}"
        session_id = state.session_of(body, request, rid)
        gen = await state.start(request, rid, prompt.token_ids, sampling, body, "chat")
        text = TextState(state.tokenizer, sampling.stop)
        head = {"id": rid, "created": int(time.time()), "model": state.model_name}
        turn = _Turn.of(state, body, request, rid, prompt)
        parser = StreamingToolParser(_tool_parser(state, prompt), prompt.tools) if prompt.tools else None
        if body.stream:
            return streaming(_stream(turn, parser, gen, text, head, session_id), gen)
        if (gone := await run_one_shot(request, gen, text, turn.watch(parser))) is not None:
            return gone
        assert text.last is not None
        parsed = extract(parser.parser, text.text, prompt.tools) if parser else ParsedOutput(text.text, ())
        decision, content, last = turn.decide(parsed), parsed.content, text.last
        if decision.ask_answer and (started := await turn.answer(last, gen)) is not None:
            answer_gen, answer = started
            if (gone := await run_one_shot(request, answer_gen, answer)) is not None:
                return gone
            assert answer.last is not None
            content, last = answer.text, merged(last, answer.last)
        state.finish(session_id, last, gen, [c.name for c in decision.calls], body.agent_hints)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if decision.calls:
            message["tool_calls"] = _calls(rid, decision.calls)
        choice = {"index": 0, "message": message, "logprobs": None,
                  "finish_reason": _finish_reason(last.finish_reason.value, bool(decision.calls))}
        if decision.dropped:
            choice["agentserve"] = decision.record()
        return {**head, "object": "chat.completion", "choices": [choice], "usage": usage(last, session_id, gen.trajectory_id,
                                                                              await state.cache_receipt(body, gen))}


async def _stream(turn: _Turn, parser: StreamingToolParser | None, gen: Generation, text: TextState,
                  head: dict[str, Any], session_id: str | None) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return sse({**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}]})

    yield chunk({"role": "assistant", "content": ""})
    watch = turn.watch(parser)
    async for out in gen.outputs():
        delta, _ = text.add(out)
        shown = parser.feed(delta) if parser else delta
        if shown:
            yield chunk({"content": shown})
        if watch is not None and parser is not None and not out.finished \
                and (end := watch.cut(parser.text)) is not None:
            parser.cut(end)  # rule 3: the model is echoing answered calls
            text.cut(text.emitted)
            gen.end()
            break
    assert text.last is not None
    last, decision = text.last, LoopDecision((), (), ask_answer=False)
    if parser is not None:
        rest, parsed = parser.finish()
        decision = turn.decide(parsed)
        if rest:
            yield chunk({"content": rest})
    if decision.ask_answer and (started := await turn.answer(last, gen)) is not None:
        answer_gen, answer = started  # nothing was shown: the reply opened with its calls
        try:
            async for out in answer_gen.outputs():
                delta, _ = answer.add(out)
                if delta:
                    yield chunk({"content": delta})
        finally:
            answer_gen.close()
        assert answer.last is not None
        last = merged(last, answer.last)
    for i, call in enumerate(_calls(head["id"], decision.calls)):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    turn.state.finish(session_id, last, gen, [c.name for c in decision.calls], turn.body.agent_hints)
    record = {"agentserve": decision.record()} if decision.dropped else {}
    yield chunk({}, _finish_reason(last.finish_reason.value, bool(decision.calls)), **record)
    if turn.body.stream_options and turn.body.stream_options.include_usage:
        yield sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(
            last, session_id, gen.trajectory_id, await turn.state.cache_receipt(turn.body, gen))})
    yield DONE
