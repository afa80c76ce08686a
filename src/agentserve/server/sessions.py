"""Which session and trajectory each request belongs to. Carried and recorded here; how
sessions change eviction is the residency policy's business."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class SessionClosedError(ValueError):
    pass


@dataclass(slots=True)
class Session:
    session_id: str
    trajectory_id: str
    created: float
    last_request: float
    closed: float | None = None
    request_ids: list[str] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_reused_tokens: int = 0
    num_generated_tokens: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "id": self.session_id, "trajectory_id": self.trajectory_id, "created": self.created,
            "last_request": self.last_request, "closed": self.closed,
            "num_requests": len(self.request_ids), "prompt_tokens": self.num_prompt_tokens,
            "reused_tokens": self.num_reused_tokens, "generated_tokens": self.num_generated_tokens,
        }


class SessionRegistry:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._sessions: dict[str, Session] = {}

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def record_request(self, session_id: str, trajectory_id: str | None, request_id: str) -> Session:
        """Attach a request to its session, opening the session on first sight."""
        now = self.clock()
        s = self._sessions.get(session_id)
        if s is None:
            s = self._sessions[session_id] = Session(session_id, trajectory_id or session_id, now, now)
        elif s.closed is not None:
            raise SessionClosedError(f"session {session_id!r} was closed; start a new session id")
        elif trajectory_id is not None and trajectory_id != s.trajectory_id:
            raise ValueError(f"session {session_id!r} belongs to trajectory {s.trajectory_id!r}, "
                             f"not {trajectory_id!r}")
        s.last_request = now
        s.request_ids.append(request_id)
        return s

    def record_usage(self, session_id: str, prompt: int, reused: int, generated: int) -> None:
        s = self._sessions.get(session_id)
        if s is not None:
            s.num_prompt_tokens += prompt
            s.num_reused_tokens += reused
            s.num_generated_tokens += generated

    def close(self, session_id: str) -> Session | None:
        s = self._sessions.get(session_id)
        if s is not None and s.closed is None:
            s.closed = self.clock()
        return s
