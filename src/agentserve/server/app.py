"""The OpenAI-compatible HTTP API: chat and text completions, models, health, metrics, sessions."""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from agentserve.engine.request import RequestOutput, SamplingParams
from agentserve.server import chat_routes, completion_routes
from agentserve.server.async_engine import AsyncEngine
from agentserve.server.errors import APIError, install_handlers
from agentserve.server.grammars import GrammarConfig, Grammars
from agentserve.server.metrics import Metrics
from agentserve.server.protocol import _Sampling
from agentserve.server.sessions import Session, SessionClosedError, SessionRegistry
from agentserve.server.tool_parsers import ToolParser


@dataclass
class ServerState:
    llm: Any  # agentserve.api.LLM: tokenizer, engine, model config
    model_name: str
    tool_parser: ToolParser
    metrics: Metrics = field(default_factory=Metrics)
    sessions: SessionRegistry = field(default_factory=lambda: SessionRegistry(time.time))
    engine: AsyncEngine | None = None
    ids: itertools.count = field(default_factory=itertools.count)
    grammar_config: GrammarConfig = field(default_factory=GrammarConfig)

    @functools.cached_property
    def grammars(self) -> Grammars:
        return Grammars(self.llm.runner.guided.compiler, self.grammar_config)

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.scheduler_config.max_model_len

    def async_engine(self) -> AsyncEngine:
        assert self.engine is not None, "the engine thread starts with the app"
        return self.engine

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} is not served here; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", param="model", code="model_not_found")

    def session_of(self, body: _Sampling, request: Request, request_id: str) -> str | None:
        session_id = body.session_id or request.headers.get("x-session-id")
        if session_id is None:
            return None
        try:
            self.sessions.record_request(session_id, body.trajectory_id, request_id)
        except SessionClosedError as exc:
            raise APIError(409, str(exc), param="session_id", code="session_closed") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), param="trajectory_id") from exc
        return session_id

    def sampling(self, body: _Sampling, prompt_len: int, max_tokens: int | None, guide: Any = None
                 ) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"prompt has {prompt_len} tokens; the model's context is "
                                f"{self.max_model_len} (prompt + at least 1 generated)",
                           param="messages", code="context_length_exceeded")
        try:
            return SamplingParams(
                temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                max_tokens=min(max_tokens or room, room), min_tokens=min(body.min_tokens, max_tokens or room, room),
                stop=body.stop_list(), ignore_eos=body.ignore_eos, seed=body.seed, guide=guide)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    async def start(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                    body: _Sampling) -> Any:
        try:
            return await self.async_engine().add(prompt, sampling, request_id, body.cache_salt)
        except ValueError as exc:
            code = "context_length_exceeded" if "context" in str(exc) else "invalid_value"
            raise APIError(400, str(exc), code=code) from exc

    def finish(self, session_id: str | None, out: RequestOutput) -> None:
        if session_id is not None:
            self.sessions.record_usage(session_id, out.num_prompt_tokens, out.num_reused_tokens,
                                       out.num_generated_tokens)


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import asyncio

        loop = asyncio.get_running_loop()
        if state.engine is not None:  # the CLI runs the step loop on the main thread
            state.engine.bind(loop)
            yield
            return
        state.engine = AsyncEngine(state.llm.engine, on_step=state.metrics.on_step)
        state.engine.start(loop)
        try:
            yield
        finally:
            state.engine.shutdown()

    app = FastAPI(title="agentserve", lifespan=lifespan)
    app.state.agentserve = state
    install_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "agentserve", "max_model_len": state.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def session_json(session_id: str, session: Session | None) -> JSONResponse:
        if session is None:
            raise APIError(404, f"unknown session {session_id!r}", param="session_id", code="session_not_found")
        return JSONResponse(session.as_dict())

    @app.post("/v1/sessions/{session_id}/close")
    async def close_session(session_id: str) -> JSONResponse:
        return session_json(session_id, state.sessions.close(session_id))

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str) -> JSONResponse:
        return session_json(session_id, state.sessions.get(session_id))

    chat_routes.register(app, state)
    completion_routes.register(app, state)
    return app
