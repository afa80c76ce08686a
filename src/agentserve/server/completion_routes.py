"""POST /v1/completions: a prompt as text or token ids, with vLLM's agent-benchmark extras."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from agentserve.server.generation import (
    DONE, FINISH, Generation, TextState, run_one_shot, sse, streaming, usage)
from agentserve.server.protocol import CompletionRequest

if TYPE_CHECKING:
    from agentserve.server.app import ServerState


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        state.check_model(body.model)
        if isinstance(body.prompt, str):
            prompt = state.tokenizer.encode(body.prompt)
        else:
            prompt = list(body.prompt)
        sampling = state.sampling(body, len(prompt), body.max_tokens or 16)
        rid = f"cmpl-{next(state.ids)}"
        session_id = state.session_of(body, request, rid)
        gen = await state.start(request, rid, prompt, sampling, body, "completions")
        text = TextState(state.tokenizer, sampling.stop)
        head = {"id": rid, "created": int(time.time()), "model": state.model_name}
        if body.stream:
            return streaming(_stream(state, body, prompt, gen, text, head, session_id), gen)
        if (gone := await run_one_shot(request, gen, text)) is not None:
            return gone
        assert text.last is not None
        state.finish(session_id, text.last, gen, (), body.agent_hints)
        choice: dict[str, Any] = {"index": 0, "text": text.text, "logprobs": None,
                                  "finish_reason": FINISH[text.last.finish_reason.value]}
        if body.return_token_ids:
            choice |= {"prompt_token_ids": prompt, "token_ids": text.token_ids}
        return {**head, "object": "text_completion", "choices": [choice], "usage": usage(
            text.last, session_id, gen.trajectory_id, await state.cache_receipt(body, gen))}


async def _stream(state: ServerState, body: CompletionRequest, prompt: list[int],
                  gen: Generation, text: TextState, head: dict[str, Any],
                  session_id: str | None) -> AsyncIterator[str]:
    async for out in gen.outputs():
        delta, ids = text.add(out)
        choice: dict[str, Any] = {"index": 0, "text": delta, "logprobs": None,
                                  "finish_reason": FINISH[out.finish_reason.value] if out.finished else None}
        if body.return_token_ids:
            choice["token_ids"] = ids
            if out.finished:
                choice["prompt_token_ids"] = prompt
        yield sse({**head, "object": "text_completion", "choices": [choice]})
    assert text.last is not None
    state.finish(session_id, text.last, gen, (), body.agent_hints)
    if body.stream_options and body.stream_options.include_usage:
        yield sse({**head, "object": "text_completion", "choices": [], "usage": usage(
            text.last, session_id, gen.trajectory_id, await state.cache_receipt(body, gen))})
    yield DONE
