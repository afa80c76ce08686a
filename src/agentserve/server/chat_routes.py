"""POST /v1/chat/completions: rendering, generation, tool-call parsing, streaming."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from agentserve.server.chat import build_chat_prompt
from agentserve.server.generation import FINISH, TextState, outputs, sse, streaming, usage
from agentserve.server.protocol import ChatCompletionRequest
from agentserve.server.tool_parsers import StreamingToolParser, ToolCall, extract

if TYPE_CHECKING:
    from agentserve.server.app import ServerState


def _calls(request_id: str, calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    return [{"id": f"call_{request_id.removeprefix('chatcmpl-')}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]


def _finish_reason(reason: str, has_calls: bool) -> str:
    return "tool_calls" if has_calls else FINISH.get(reason, reason)


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
        queue = await state.start(rid, prompt.token_ids, sampling, body)
        outs = outputs(state.async_engine(), rid, queue, state.metrics, "chat", request.is_disconnected)
        text = TextState(state.tokenizer, sampling.stop)
        head = {"id": rid, "created": int(time.time()), "model": state.model_name}
        if body.stream:
            return streaming(_stream(state, body, prompt.tools, outs, text, head, session_id))
        async for out in outs:
            text.add(out)
        assert text.last is not None
        state.finish(session_id, text.last)
        parsed = extract(state.tool_parser, text.text, prompt.tools) if prompt.tools else None
        calls = parsed.calls if parsed else ()
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content if parsed else text.text}
        if calls:
            message["tool_calls"] = _calls(rid, calls)
        choice = {"index": 0, "message": message, "logprobs": None,
                  "finish_reason": _finish_reason(text.last.finish_reason.value, bool(calls))}
        return {**head, "object": "chat.completion", "choices": [choice], "usage": usage(text.last, session_id)}


async def _stream(state: ServerState, body: ChatCompletionRequest, tools: dict[str, Any],
                  outs: AsyncIterator[Any], text: TextState, head: dict[str, Any],
                  session_id: str | None) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return sse({**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    parser = StreamingToolParser(state.tool_parser, tools) if tools else None
    yield chunk({"role": "assistant", "content": ""})
    async for out in outs:
        delta, _ = text.add(out)
        shown = parser.feed(delta) if parser else delta
        if shown:
            yield chunk({"content": shown})
    assert text.last is not None
    calls: tuple[ToolCall, ...] = ()
    if parser is not None:
        rest, parsed = parser.finish()
        calls = parsed.calls
        if rest:
            yield chunk({"content": rest})
    for i, call in enumerate(_calls(head["id"], calls)):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    state.finish(session_id, text.last)
    yield chunk({}, _finish_reason(text.last.finish_reason.value, bool(calls)))
    if body.stream_options and body.stream_options.include_usage:
        yield sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(text.last, session_id)})
    yield "data: [DONE]\n\n"
