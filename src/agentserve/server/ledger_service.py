"""The ledger in the server: each request's tag (trajectory, session, parent, route, the
decision that applied), the JSONL writer, outcomes, and the route

    GET /v1/trajectories/{id}/ledger[?cache_salt=...&children=true]

with the trajectory's rows (and its sub-agents'), roll-ups and costs under the server's price
table (`--prices`). The ledger itself lives on the engine thread (ledger/ledger.py); this module
reaches it through `AsyncEngine.call` and add's `then` hook.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Path as PathParam, Query
from fastapi.responses import JSONResponse

from agentserve.analyze.breaks import window
from agentserve.ledger.cost import row_cost, summarize
from agentserve.ledger.ledger import Ledger, Tag, Where
from agentserve.ledger.prices import PriceTable, load_prices
from agentserve.ledger.receipts import identity_digest
from agentserve.ledger.rows import Decision
from agentserve.ledger.writer import LedgerWriter
from agentserve.server.async_engine import EngineUnavailable
from agentserve.server.door import engine_failed
from agentserve.server.errors import APIError
from agentserve.server.protocol import MAX_ID_CHARS
from agentserve.trajectory.registry import TrajectoryKey

if TYPE_CHECKING:
    from agentserve.server.app import ServerState
    from agentserve.server.generation import Generation
    from agentserve.server.trajectories import Identity

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LedgerOptions:
    path: Path | None = None  # --ledger: the JSONL file (None: in memory only)
    max_bytes: int = 64 << 20
    backups: int = 5
    prices: PriceTable = field(default_factory=lambda: load_prices(None))  # ledger/prices.py
    text_window: bool = False  # put a window of old/new text of a divergence in the rows


class LedgerService:
    def __init__(self, ledger: Ledger, options: LedgerOptions, tokenizer: Any) -> None:
        self.ledger = ledger
        self.options = options
        self.prices: PriceTable = options.prices
        self.tokenizer = tokenizer
        self.writer = None if options.path is None else LedgerWriter(options.path, options.max_bytes,
                                                                      options.backups)
        template = getattr(tokenizer, "chat_template", None) or ""
        # what the KV of a receipt's objects depends on besides its tokens
        ledger.identity = identity_digest(ledger.model_id, getattr(tokenizer, "name_or_path", ""),
                                          hashlib.sha256(str(template).encode()).hexdigest(),
                                          f"agentserve {_version()}", f"block {ledger.block_size}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def hook(self, state: ServerState, then: Callable[[Any], object] | None, ident: Identity | None, body: Any,
             prompt: Sequence[int], route: str, within: Generation | None) -> Callable[[Any], object]:
        """add()'s hook (engine thread): the trajectory's hook first, then the request's tag."""
        engine = state.llm.engine
        messages = getattr(body, "messages", None)

        def hook(rid: Any) -> object:
            key = None
            if then is not None:
                try:
                    key = then(rid)
                except Exception:  # the trajectory's bookkeeping only: the row is still made
                    log.exception("%s: after-add hook failed", rid)
            if within is not None:  # the tool loop's second generation joins its turn
                tag = self.tag(within.ledger_key, within.session_id, None, route + ":answer", None, None, prompt,
                               same_turn=True)
            else:
                traj = key if isinstance(key, TrajectoryKey) else None
                lkey = (traj.tenant, traj.id) if traj is not None else \
                    (ident.tenant, ident.id) if ident is not None and ident.id is not None else None
                tag = self.tag(lkey, ident.session if ident else None, ident.parent if ident else None, route,
                               self.decision_of(state, traj), messages, prompt,
                               receipt=bool(getattr(body, "cache_receipt", False)))
            self.ledger.bind(engine.scheduler.requests[rid], tag)
            return key
        return hook

    def tag(self, key: tuple[str, str] | None, session_id: str | None, parent_id: str | None, route: str,
            decision: Decision | None, messages: Sequence[Any] | None, prompt: Sequence[int],
            same_turn: bool = False, receipt: bool = False) -> Tag:
        describe = None if messages is None else self._describer(messages, prompt)
        return Tag(key, session_id, parent_id, route, decision, describe, same_turn, receipt)

    def _describer(self, messages: Sequence[Any], prompt: Sequence[int]
                   ) -> Callable[[int, Sequence[int] | None], Where]:
        """Where token k of this prompt falls (engine thread, only for a divergence): the
        message whose rendered content the text before k reaches, and with the opt-in flag a
        window of the old and new text."""
        tok, show_text = self.tokenizer, self.options.text_window

        def describe(k: int, old: Sequence[int] | None) -> Where:
            text = tok.decode(list(prompt), skip_special_tokens=False)
            at = len(tok.decode(list(prompt[:k]), skip_special_tokens=False))
            index = message_at(text, messages, at)
            role = getattr(messages[index], "role", None) if index is not None and index < len(messages) else None
            if not show_text:
                return Where(index, role)
            old_text = None
            if old is not None:  # the analyzer's window, around the same token of the old sequence
                o = tok.decode(list(old[max(0, k - 64) : k + 64]), skip_special_tokens=False)
                old_text = window(o, len(tok.decode(list(old[max(0, k - 64) : k]), skip_special_tokens=False)))
            return Where(index, role, old_text, window(text, at))

        return describe

    def decision_of(self, state: ServerState, key: TrajectoryKey | None) -> Decision | None:
        """The advice given at the trajectory's latest pause (engine thread)."""
        svc = state.trajectories
        if key is None or svc is None:
            return None
        t = svc.residency.registry.get(key)
        a = None if t is None else t.advice
        if a is None:
            return None
        return Decision(a.action, round(a.p_return, 4), a.pause_class, a.reason, a.policy_version)

    def view(self, key: tuple[str, str], children: bool) -> dict[str, Any] | None:
        """Engine thread: the trajectory's rows and roll-ups, None if the ledger has none."""
        got = self.ledger.rows_of(key, with_children=children)
        if got is None:
            return None
        rows, outcomes = got
        summary = summarize(rows, outcomes, self.prices)
        own = summary.trajectories.get((rows[0].tenant, key[1])) if rows else None
        return {"trajectory_id": key[1], "rows": [{**r.as_dict(), "cost": round(row_cost(r, self.prices).total, 9)}
                                                  for r in rows],
                "trajectory": None if own is None else own.as_dict(),
                "summary": summary.as_dict()}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentserve")
    except PackageNotFoundError:
        return "dev"


def message_at(text: str, messages: Sequence[Any], at: int) -> int | None:
    """The index of the message whose rendered content starts at or before character `at` (each
    message's text is found in the rendered prompt in order; one not found keeps the cursor)."""
    cursor, index = 0, None
    for i, m in enumerate(messages):
        content = getattr(m, "content", None)
        if isinstance(content, list):
            content = "".join(getattr(p, "text", "") or "" for p in content)
        if not isinstance(content, str) or not content:
            continue
        pos = text.find(content[:64], cursor)
        if pos < 0:
            continue
        if pos > at:
            break
        index, cursor = i, pos + 1
    return index if index is not None else (0 if messages else None)


def register(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/trajectories/{trajectory_id}/ledger")
    async def trajectory_ledger(trajectory_id: str = PathParam(min_length=1, max_length=MAX_ID_CHARS),
                                cache_salt: str | None = Query(default=None, min_length=1, max_length=MAX_ID_CHARS),
                                children: bool = True) -> JSONResponse:
        svc = state.ledger
        if svc is None:
            raise APIError(404, "the ledger is off on this server", code="ledger_off")
        key = (cache_salt or "", trajectory_id)
        try:
            view = await state.async_engine().call(lambda: svc.view(key, children))
        except EngineUnavailable as exc:
            raise engine_failed(str(exc)) from exc
        if view is None:
            raise APIError(404, f"unknown trajectory {trajectory_id!r} in the ledger (it sent no request here, "
                                "it aged out, or it belongs to another tenant: pass the cache_salt its "
                                "requests carry)", param="trajectory_id", code="trajectory_not_found")
        return JSONResponse(view)
