"""The workload model: an agent session is a chain of turns; a turn is one request and its reply.

Block hashes are stored as deltas: a turn keeps `shared_blocks` leading hashes of the previous
turn of its session and adds `new_hashes`. A trace's hash ids mean something only inside their
namespace (one per session file for local scope, one per trace file for global scope), so a
block's identity is (namespace, hash id); equal ids are equal tokens from the sequence start.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field


class InputType(enum.Enum):
    TEXT = "text"  # a human turn
    TOOL_RESULT = "tool_result"
    UNKNOWN = "unknown"


class StopReason(enum.Enum):
    TOOL_USE = "tool_use"
    END_TURN = "end_turn"
    NONE = ""  # the trace recorded none
    UNKNOWN = "unknown"


class Timing(enum.Enum):
    """When a session's next turn is sent."""

    THINK = "think"  # think_s after the previous response (and after awaited sub-agents)
    TRACE = "trace"  # at the session start + offset_s, but never before the previous response


class TraceError(ValueError):
    """Input that cannot be read; the message names the file and, where known, the record."""


@dataclass(frozen=True, slots=True)
class Turn:
    offset_s: float  # trace time from the session start
    think_s: float  # gap before this turn: after the previous response, or after awaited sub-agents
    prompt_tokens: int
    output_tokens: int
    shared_blocks: int  # leading block hashes equal to the previous turn's (0 for the first)
    new_hashes: tuple[int, ...]  # the following hashes of this prompt's full blocks
    input_type: InputType = InputType.UNKNOWN
    stop: StopReason = StopReason.UNKNOWN
    tool_class: str | None = None  # what the gap before this turn waited on, where known
    subagents: tuple[SubAgent, ...] = ()  # started after this turn's response

    @property
    def num_blocks(self) -> int:
        return self.shared_blocks + len(self.new_hashes)


@dataclass(frozen=True, slots=True)
class SubAgent:
    delay_s: float  # after the parent turn's response
    awaited: bool  # the parent's next turn waits for it to finish
    session: AgentSession


@dataclass(frozen=True, slots=True)
class AgentSession:
    session_id: str
    namespace: int
    turns: tuple[Turn, ...]
    timing: Timing = Timing.THINK
    start_s: float | None = None  # absolute start in the trace, if it has one
    agent_type: str | None = None  # sub-agent type ("Explore", ...) or None for a top session

    def block_hashes(self) -> Iterator[list[int]]:
        """Each turn's full list of prompt block hashes, in order."""
        prev: list[int] = []
        for t in self.turns:
            prev = prev[: t.shared_blocks] + list(t.new_hashes)
            yield prev

    def walk(self) -> Iterator[AgentSession]:
        """This session and its sub-agents, depth first."""
        yield self
        for t in self.turns:
            for s in t.subagents:
                yield from s.session.walk()


@dataclass(frozen=True, slots=True)
class SourceFile:
    path: str
    sha256: str


@dataclass(frozen=True, slots=True)
class Skipped:
    """A record left out of the workload, and why."""

    path: str
    record: str  # "line 12", "requests[3]", or "" for the whole file
    reason: str

    def __str__(self) -> str:
        return f"{self.path}{': ' + self.record if self.record else ''}: {self.reason}"


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    block_size: int  # tokens per trace block
    sessions: tuple[AgentSession, ...]  # top-level sessions (sub-agents hang off their turns)
    sources: tuple[SourceFile, ...] = ()
    skipped: tuple[Skipped, ...] = field(default=())

    def all_sessions(self) -> Iterator[AgentSession]:
        for s in self.sessions:
            yield from s.walk()

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.all_sessions())
