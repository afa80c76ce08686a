"""The OpenAI-compatible HTTP API: chat and text completions, models, health, metrics, sessions."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from agentserve.config import ServerConfig
from agentserve.engine.request import RequestOutput, SamplingParams
from agentserve.server import chat_routes, completion_routes, trajectories
from agentserve.server.admission import Admission, Overloaded, Slot
from agentserve.server.async_engine import AsyncEngine, EngineUnavailable, RequestStream
from agentserve.server.door import Door, engine_failed, overloaded, slot_of
from agentserve.server.errors import APIError, install_handlers
from agentserve.server.generation import Generation
from agentserve.server.grammars import GrammarConfig, Grammars
from agentserve.server.metrics import Metrics
from agentserve.server.protocol import _Sampling
from agentserve.server.sessions import Session, SessionClosedError, SessionRegistry
from agentserve.trajectory.registry import TrajectoryKey
from agentserve.server.protocol import AgentHints
from agentserve.server.tool_parsers import ToolParser
from agentserve.server.trajectories import Identity, Trajectories, identity_of
from agentserve.server import ledger_service
from agentserve.server.ledger_service import LedgerOptions, LedgerService


@dataclass
class ServerState:
    llm: Any  # agentserve.api.LLM: tokenizer, engine, model config
    model_name: str
    tool_parser: ToolParser
    config: ServerConfig = field(default_factory=ServerConfig)
    metrics: Metrics = field(default_factory=Metrics)
    sessions: SessionRegistry = field(default_factory=lambda: SessionRegistry(time.time))
    engine: AsyncEngine | None = None
    ids: itertools.count = field(default_factory=itertools.count)
    grammar_config: GrammarConfig = field(default_factory=GrammarConfig)
    admission: Admission = field(init=False)
    live: dict[str, Generation] = field(default_factory=dict)  # accepted, not yet closed
    trajectories: Trajectories | None = field(init=False, default=None)  # None: --residency off
    ledger_options: LedgerOptions = field(default_factory=LedgerOptions)
    ledger: LedgerService | None = field(init=False, default=None)  # None: the LLM keeps no ledger

    def __post_init__(self) -> None:
        self.admission = Admission(self.config)
        residency = getattr(self.llm, "residency", None)
        mode = getattr(self.llm, "residency_mode", "off")
        if residency is not None:
            self.trajectories = Trajectories(residency, mode, self.metrics)
        else:
            self.metrics.watch_residency(None, mode)
        ledger = getattr(self.llm, "ledger", None)
        if ledger is not None:
            from agentserve.server.ledger_metrics import LedgerCollector, LedgerHistograms

            self.ledger = LedgerService(ledger, self.ledger_options, self.llm.tokenizer)
            hist = LedgerHistograms(self.metrics.registry)
            # this server's handlers replace any earlier server's on the same LLM
            ledger.on_row = [hist.on_row] + ([self.ledger.writer.put] if self.ledger.writer else [])
            self.metrics.registry.register(LedgerCollector(ledger, self.ledger.writer))
        tiers = getattr(self.llm, "tiers", None)
        if tiers is not None:
            from agentserve.server.tier_metrics import TierCollector

            self.metrics.registry.register(TierCollector(tiers))

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

    def engine_failure(self) -> str | None:
        return None if self.engine is None else self.engine.failure

    def health_problem(self) -> tuple[str, str] | None:
        """(status, reason) when this server should not get traffic, else None."""
        engine = self.engine
        if engine is None:
            return "starting", "the engine is not running yet"
        if engine.failure is not None:
            return "failed", engine.failure
        if not engine.thread_alive:
            return "failed", "the engine's step loop has exited"
        started = engine.step_started
        if started is not None and time.monotonic() - started > self.config.engine_stall_timeout_s:
            return "stalled", f"one engine step has run for {time.monotonic() - started:.0f} s"
        return None

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
        if guide is not None and body.min_tokens:
            raise APIError(400, "min_tokens cannot be combined with a forced tool call (tool_choice "
                                "required or named): the call ends when its JSON is complete",
                           param="min_tokens")
        try:
            return SamplingParams(
                temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                max_tokens=min(max_tokens or room, room), min_tokens=min(body.min_tokens, max_tokens or room, room),
                stop=body.stop_list(), ignore_eos=body.ignore_eos, seed=body.seed, guide=guide)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def enter(self) -> Slot:
        """A queue slot for a request the server makes itself (a second generation)."""
        try:
            return self.admission.enter()
        except Overloaded as exc:
            raise overloaded(exc) from exc

    async def start(self, request: Request, request_id: str, prompt: list[int],
                    sampling: SamplingParams, body: _Sampling, route: str,
                    slot: Slot | None = None, track: bool = True, within: Generation | None = None
                    ) -> Generation:
        """Admit a request (with its queue slot: taken at the door, or given) and hand it to
        the engine. The caller owns the returned Generation and must close it (generation.py).
        track: the request is a turn of its trajectory (False for a generation the server makes
        itself inside a turn: `within`, whose trajectory and turn its ledger row joins)."""
        slot = slot or slot_of(request.scope)
        if slot is None:
            raise RuntimeError(f"{route}: a generation route was reached without the door")
        ident = self._identity(body, request) if track else None
        try:  # until the Generation owns it, the slot is given back on every way out
            stream = await self._add(slot, request_id, prompt, sampling, body, ident, route, within)
        except BaseException:
            slot.release()
            raise
        generation = Generation(self.async_engine(), request_id, stream, slot, self.metrics, route, self._closed)
        generation.session_id = ident.session if ident else None
        if ident is not None and ident.id is not None:
            generation.ledger_key = (ident.tenant, ident.id)
        if isinstance(stream.context, TrajectoryKey) and self.trajectories is not None:
            generation.trajectory = stream.context
            generation.ledger_key = (stream.context.tenant, stream.context.id)
            self.trajectories.started(stream.context, request_id, ident.session if ident else None)
        self.live[request_id] = generation
        return generation

    def _identity(self, body: _Sampling, request: Request) -> Identity | None:
        if self.trajectories is None and self.ledger is None:
            return None
        sid = body.session_id or request.headers.get("x-session-id")
        session = self.sessions.get(sid) if sid else None
        return identity_of(body, request.headers, sid, session.trajectory_id if session else None)

    def _closed(self, g: Generation) -> None:
        self.live.pop(g.request_id, None)
        if g.trajectory is not None and self.trajectories is not None:
            self.trajectories.ended(g.trajectory, g.request_id)
            if not g.responded:  # failed, aborted or its client left before a response
                self.trajectories.abandoned(self, g.trajectory)

    async def _add(self, slot: Slot, request_id: str, prompt: list[int], sampling: SamplingParams,
                   body: _Sampling, ident: Identity | None, route: str = "chat",
                   within: Generation | None = None) -> RequestStream:
        try:
            self.admission.admit(slot, len(prompt))
        except Overloaded as exc:
            raise overloaded(exc) from exc
        then = None
        if ident is not None and self.trajectories is not None:
            then = self.trajectories.then(self.llm.engine, ident)
        if self.ledger is not None:
            then = self.ledger.hook(self, then, ident, body, prompt, route, within)
        try:
            return await self.async_engine().add(prompt, sampling, request_id, body.cache_salt, then)
        except ValueError as exc:
            code = "context_length_exceeded" if "context" in str(exc) else "invalid_value"
            raise APIError(400, str(exc), code=code) from exc
        except EngineUnavailable as exc:
            raise engine_failed(str(exc)) from exc

    async def reap_stalled(self) -> None:
        """Drop streaming readers that took nothing for stream_stall_timeout_s (their
        requests are aborted): a client that stops reading cannot hold KV or memory."""
        timeout = self.config.stream_stall_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for g in list(self.live.values()):
                since = g.stream.pending_since
                if since is not None and now - since > timeout:
                    g.drop(f"its client took no output for {now - since:.0f} s")

    async def cache_receipt(self, body: _Sampling, gen: Generation) -> dict[str, Any] | None:
        """The request's cache receipt when it asked for one (its row is made before its last
        output is delivered, so the receipt is there)."""
        if not body.cache_receipt or self.ledger is None:
            return None
        ledger = self.ledger.ledger
        try:
            return await self.async_engine().call(lambda: ledger.receipt(gen.request_id))
        except EngineUnavailable:
            return None

    def finish(self, session_id: str | None, out: RequestOutput, gen: Generation,
               calls: Sequence[str] = (), hints: AgentHints | None = None) -> None:
        """A turn's response is complete (calls: the tool names it called)."""
        if gen.trajectory is not None and self.trajectories is not None and not gen.responded:
            gen.responded = True
            self.trajectories.responded(self, gen.trajectory, out, calls, hints)
        if session_id is not None:
            self.sessions.record_usage(session_id, out.num_prompt_tokens, out.num_reused_tokens,
                                       out.num_generated_tokens)


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        reaper = asyncio.create_task(state.reap_stalled())
        expirer = None if state.trajectories is None else asyncio.create_task(state.trajectories.expire_forever(state))
        own_engine = state.engine is None  # else the CLI runs the step loop on the main thread
        if own_engine:
            state.engine = AsyncEngine(state.llm.engine, on_step=state.metrics.on_step)
            state.engine.start(loop)
        else:
            state.async_engine().bind(loop)
        try:
            yield
        finally:
            reaper.cancel()
            if expirer is not None:
                expirer.cancel()
            if own_engine:
                state.async_engine().shutdown()
            if state.ledger is not None:
                state.ledger.close()

    app = FastAPI(title="agentserve", lifespan=lifespan)
    app.state.agentserve = state
    app.add_middleware(Door, state=state)
    install_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        problem = state.health_problem()
        if problem is not None:
            return JSONResponse({"status": problem[0], "reason": problem[1]}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "agentserve",
                "max_model_len": state.max_model_len}
        if state.llm.max_model_len_note:
            card["max_model_len_note"] = state.llm.max_model_len_note
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def session_json(session_id: str, session: Session | None) -> JSONResponse:
        if session is None:
            raise APIError(404, f"unknown session {session_id!r}", param="session_id", code="session_not_found")
        return JSONResponse(session.as_dict())

    @app.post("/v1/sessions/{session_id}/close")
    async def close_session(session_id: str) -> JSONResponse:
        closed = state.sessions.close(session_id)
        if closed is not None and state.trajectories is not None:  # its protection ends now
            state.trajectories.session_closed(state, session_id)
        return session_json(session_id, closed)

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str) -> JSONResponse:
        return session_json(session_id, state.sessions.get(session_id))

    chat_routes.register(app, state)
    completion_routes.register(app, state)
    trajectories.register(app, state)
    ledger_service.register(app, state)
    return app
