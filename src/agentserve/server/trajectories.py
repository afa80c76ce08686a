"""Trajectories in the server: which one a request belongs to, its responses and lifecycle
events fed to the residency policy, and the views of both.

The policy (trajectory/) is torch-free and lives with the pool on the engine thread; this module
reaches it only through `AsyncEngine.call` / `submit` / add's `then` hook, so its state is
touched by one thread. Routes:
- POST /v1/trajectories/{id}/events   lifecycle events (trajectory/events.py)
- GET  /v1/trajectories/stats         per-class return statistics, policy cost
- GET  /v1/trajectories/{id}          state, advice and decision receipts

Identity, first that is present (docs/residency.md has the table): body `trajectory_id`; the
session (body `session_id` or `X-Session-Id`) and its trajectory; body `prompt_cache_key`;
the headers `X-Codex-Session-Id`, `Session-Id`/`session_id`, `Conversation-Id`; body `user`.
Without any, a prompt that extends a paused trajectory's last sequence is that trajectory's
return, and otherwise it starts an anonymous one. The tenant is the request's cache salt.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Path, Query
from fastapi.responses import JSONResponse

from agentserve.engine.request import FinishReason, RequestId, RequestOutput
from agentserve.server.async_engine import EngineUnavailable
from agentserve.server.door import engine_failed
from agentserve.server.errors import APIError
from agentserve.server.protocol import MAX_ID_CHARS, AgentHints, TrajectoryEventRequest
from agentserve.trajectory.events import Event, Outcome
from agentserve.trajectory.registry import State, TrajectoryKey
from agentserve.trajectory.residency import Residency

if TYPE_CHECKING:
    from agentserve.engine.engine import Engine
    from agentserve.server.app import ServerState
    from agentserve.server.metrics import Metrics

IDENTITY_HEADERS = ("x-codex-session-id", "session-id", "session_id", "conversation-id", "conversation_id")
MAX_EVENT_AGE_MS = 86_400_000  # an emitted_at older than a day is a client clock or unit error
MAX_EVENT_SKEW_MS = 60_000  # ... and one more than a minute ahead
EXPIRE_EVERY_S = 10.0
MAX_SESSIONS = 100_000


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    id: str | None  # None: anonymous, inferred from the prompt on the engine thread
    source: str
    parent: str | None = None
    session: str | None = None


def identity_of(body: Any, headers: Mapping[str, str], session_id: str | None,
                session_trajectory: str | None) -> Identity:
    tenant = body.cache_salt or ""
    hints: AgentHints | None = body.agent_hints
    parent = hints.parent_trajectory_id if hints is not None else None

    def ident(value: str, source: str) -> Identity:
        return Identity(tenant, value, source, parent, session_id)

    if body.trajectory_id:
        return ident(body.trajectory_id, "trajectory_id")
    if session_trajectory:
        return ident(session_trajectory, "session")
    if body.prompt_cache_key:
        return ident(body.prompt_cache_key, "prompt_cache_key")
    for name in IDENTITY_HEADERS:
        value = headers.get(name)
        if value and len(value) <= MAX_ID_CHARS:
            return ident(value, f"header {name}")
    if body.user:
        return ident(body.user, "user")
    return Identity(tenant, None, "prefix", parent, session_id)


class Trajectories:
    """The server's side of the residency policy (`--residency shadow | on`)."""

    def __init__(self, residency: Residency, mode: str, metrics: Metrics) -> None:
        self.residency = residency
        self.mode = mode
        self.metrics = metrics
        self.running: dict[TrajectoryKey, set[str]] = {}  # event loop: requests in flight
        self.by_session: OrderedDict[str, TrajectoryKey] = OrderedDict()
        residency.on_receipt = metrics.on_receipt  # engine thread; prometheus is thread-safe
        metrics.watch_residency(residency, mode)

    # engine thread -------------------------------------------------------------------
    def then(self, engine: Engine, ident: Identity):
        """add()'s hook: resolve the request's trajectory and tell the policy it returned."""
        def hook(rid: RequestId) -> TrajectoryKey:
            res = self.residency
            if ident.id is not None:
                key = TrajectoryKey(ident.tenant, ident.id)
            else:
                key = res.identify(engine.prompt_hashes(rid)) or res.anonymous(ident.tenant)
            parent = None if ident.parent is None else TrajectoryKey(ident.tenant, ident.parent)
            res.on_request(key, parent, ident.session)
            return key
        return hook

    def _respond(self, key: TrajectoryKey, out: RequestOutput, calls: Sequence[str],
                 hints: AgentHints | None) -> None:
        res = self.residency
        if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            res.on_abandoned(key)
            return
        expected = None if hints is None or hints.expected_duration_ms is None else hints.expected_duration_ms / 1e3
        if hints is not None and hints.last_turn:
            res.on_response(key, out.block_hashes, State.FINISHED, None)
            return
        prompt_blocks = out.num_prompt_tokens // res.config.block_size
        if calls:
            cls = hints.tool_class if hints is not None and hints.tool_class else calls[0]
            advice = res.on_response(key, out.block_hashes, State.PAUSED_TOOL, cls, expected, prompt_blocks)
        else:
            advice = res.on_response(key, out.block_hashes, State.WAITING_HUMAN, "human", expected,
                                     prompt_blocks)
        if advice is not None:
            self.metrics.on_advice(advice)

    # event loop ------------------------------------------------------------------------
    def started(self, key: TrajectoryKey, request_id: str, session_id: str | None) -> None:
        self.running.setdefault(key, set()).add(request_id)
        if session_id is not None:
            self.by_session[session_id] = key
            self.by_session.move_to_end(session_id)
            while len(self.by_session) > MAX_SESSIONS:
                self.by_session.popitem(last=False)

    def ended(self, key: TrajectoryKey, request_id: str) -> None:
        rids = self.running.get(key)
        if rids is not None:
            rids.discard(request_id)
            if not rids:
                del self.running[key]

    def responded(self, state: ServerState, key: TrajectoryKey, out: RequestOutput,
                  calls: Sequence[str], hints: AgentHints | None) -> None:
        state.async_engine().submit(lambda: self._respond(key, out, calls, hints))

    def abandoned(self, state: ServerState, key: TrajectoryKey) -> None:
        state.async_engine().submit(lambda: self.residency.on_abandoned(key))

    def session_closed(self, state: ServerState, session_id: str) -> None:
        key = self.by_session.pop(session_id, None)
        if key is not None:
            state.async_engine().submit(lambda: self.residency.on_end(key, State.FINISHED, "session_closed"))

    async def expire_forever(self, state: ServerState) -> None:
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            if state.engine is not None and state.engine.failure is None:
                state.async_engine().submit(self.residency.expire)


def _tenant_key(trajectory_id: str, cache_salt: str | None) -> TrajectoryKey:
    return TrajectoryKey(cache_salt or "", trajectory_id)


def _not_found(trajectory_id: str) -> APIError:
    return APIError(404, f"unknown trajectory {trajectory_id!r} (it never sent a request here, it expired, "
                         "or it belongs to another tenant: pass the cache_salt its requests carry)",
                    param="trajectory_id", code="trajectory_not_found")


def register(app: FastAPI, state: ServerState) -> None:
    TrajectoryId = Path(min_length=1, max_length=MAX_ID_CHARS)
    Salt = Query(default=None, min_length=1, max_length=MAX_ID_CHARS)

    async def on_engine(fn):
        try:
            return await state.async_engine().call(fn)
        except EngineUnavailable as exc:
            raise engine_failed(str(exc)) from exc

    def service() -> Trajectories:
        if state.trajectories is None:
            raise APIError(404, "trajectory tracking is off on this server; start it with "
                                "--residency shadow (advice and receipts only) or --residency on",
                           code="residency_off")
        return state.trajectories

    @app.get("/v1/trajectories/stats")
    async def trajectory_stats() -> JSONResponse:
        svc = service()
        stats = await on_engine(svc.residency.stats)
        return JSONResponse({"mode": svc.mode, **stats})

    @app.get("/v1/trajectories/{trajectory_id}")
    async def get_trajectory(trajectory_id: str = TrajectoryId, cache_salt: str | None = Salt) -> JSONResponse:
        svc = service()
        key = _tenant_key(trajectory_id, cache_salt)
        view = await on_engine(lambda: svc.residency.describe(key))
        if view is None:
            raise _not_found(trajectory_id)
        return JSONResponse({"mode": svc.mode, **view})

    async def outcome(key: TrajectoryKey, success: bool) -> bool:
        """The harness's verdict, into the ledger; False if the ledger never saw it."""
        ledger = state.ledger
        if ledger is None:
            return False
        try:
            await on_engine(lambda: ledger.ledger.outcome((key.tenant, key.id), success))
        except KeyError:
            return False
        return True

    @app.post("/v1/trajectories/{trajectory_id}/events")
    async def trajectory_event(body: TrajectoryEventRequest, trajectory_id: str = TrajectoryId) -> JSONResponse:
        if state.trajectories is None and body.success is not None and state.ledger is not None:
            # residency off: the ledger still takes the task's outcome
            if not await outcome(_tenant_key(trajectory_id, body.cache_salt), body.success):
                raise _not_found(trajectory_id)
            return JSONResponse({"trajectory_id": trajectory_id, "event": body.event, "outcome": "applied",
                                 "aborted_requests": 0, "success": body.success})
        svc = service()
        now_ms = time.time() * 1e3
        if body.emitted_at_ms is not None:
            if now_ms - body.emitted_at_ms > MAX_EVENT_AGE_MS:
                raise APIError(400, f"emitted_at_ms {body.emitted_at_ms:.0f} is more than a day old; send "
                                    "milliseconds since the Unix epoch", param="emitted_at_ms")
            if body.emitted_at_ms - now_ms > MAX_EVENT_SKEW_MS:
                raise APIError(400, f"emitted_at_ms {body.emitted_at_ms:.0f} is more than a minute in the "
                                    "future; send milliseconds since the Unix epoch", param="emitted_at_ms")
        key = _tenant_key(trajectory_id, body.cache_salt)
        event = Event(body.event)
        expected = None if body.expected_duration_ms is None else body.expected_duration_ms / 1e3
        recorded = body.success is not None and await outcome(key, body.success)
        try:
            result = await on_engine(lambda: svc.residency.on_event(key, event, body.tool_class, expected))
        except KeyError:
            if not recorded:
                raise _not_found(trajectory_id) from None
            result = Outcome.APPLIED  # the ledger knew it; the policy had let it expire
        state.metrics.on_event(event.value, result.value,
                               None if body.emitted_at_ms is None else (time.time() * 1e3 - body.emitted_at_ms) / 1e3)
        aborted = 0
        if event is Event.TRAJECTORY_CANCELLED and result is Outcome.APPLIED:
            for rid in list(svc.running.get(key, ())):
                gen = state.live.get(rid)
                if gen is not None:
                    gen.drop(f"its trajectory {trajectory_id!r} was cancelled")
                    aborted += 1
        reply = {"trajectory_id": trajectory_id, "event": event.value, "outcome": result.value,
                 "aborted_requests": aborted}
        if body.success is not None:
            reply["success"] = body.success
        return JSONResponse(reply)

