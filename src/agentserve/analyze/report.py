"""The analysis as a whole: totals, advice per detected cause, and its JSON form."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from agentserve.analyze.analysis import RequestRow, SessionAnalysis, analyze_session
from agentserve.analyze.breaks import Break
from agentserve.analyze.causes import Cause
from agentserve.analyze.messages import JsonValue
from agentserve.analyze.render import Renderer, TemplateError
from agentserve.analyze.sharing import Sharing, compare_sessions
from agentserve.analyze.transcript import Problem, Transcript

_STABLE = "Stable content first: "
_VOLATILE = "Volatile content last: "
_APPEND = "History appended, never rewritten: "
_DETERMINISTIC = "Deterministic serialization: "

ADVICE: dict[Cause, str] = {
    Cause.VOLATILE: _VOLATILE + "move timestamps, dates, ids and counters out of the system "
    "prompt and early messages to the end of the prompt (the newest message), or drop them.",
    Cause.TOOLS_REORDERED: _STABLE + "send the tool definitions in one fixed order (e.g. sorted "
    "by name) on every request.",
    Cause.TOOLS_ADDED: _STABLE + "declare every tool the session may use in its first request "
    "and keep the list fixed; refuse unavailable tools in the harness instead.",
    Cause.TOOLS_REMOVED: _STABLE + "keep the tool list fixed for the whole session; refuse "
    "unavailable tools in the harness instead of removing their definitions.",
    Cause.TOOLS_CHANGED: _STABLE + "keep tool definitions (names, descriptions, schemas) "
    "byte-identical for the whole session.",
    Cause.SERIALIZATION: _DETERMINISTIC + "build tool definitions, tool-call arguments and JSON "
    "content with one key order and fixed separators every time "
    "(json.dumps(..., sort_keys=True, separators=(',', ':'))).",
    Cause.REASONING_DROPPED: _APPEND + "keep earlier reasoning in the history (and a template "
    "that renders it), or expect the cache to restart at the first dropped reasoning after "
    "every new user message.",
    Cause.TOOL_RESULT_REWRITTEN: _APPEND + "do not summarize or truncate tool results after they "
    "were sent; shorten a result once, when it is first added.",
    Cause.TURN_REMOVED: _APPEND + "do not remove turns mid-session; if the context must shrink, "
    "compact rarely and all at once.",
    Cause.MESSAGE_EDITED: _APPEND + "send earlier messages, and the model's own replies, back "
    "exactly as they were.",
    Cause.TEMPLATE_REWRITE: _APPEND + "this chat template renders earlier messages differently "
    "as the conversation grows; use a template whose history rendering only appends.",
    Cause.SYSTEM_PROMPT_CHANGED: _STABLE + "keep the system prompt identical across requests; "
    "put per-request instructions in a later message.",
    Cause.UNEXPLAINED: "Look at the old and new text of these breaks: the renderings differ "
    "for a reason this analyzer does not recognise.",
}


@dataclass(frozen=True, slots=True)
class Totals:
    requests: int
    prompt_tokens: int  # also what is prefilled without a cache
    prefill_tokens: int  # with a prefix cache
    hybrid_prefill_tokens: int
    generated_tokens: int
    breaks: int


@dataclass(frozen=True, slots=True)
class Advice:
    cause: Cause
    text: str
    breaks: int
    tokens_saved: int  # prefill tokens a fix would save on this transcript


@dataclass(frozen=True, slots=True)
class Report:
    tokenizer: str
    template_kwargs: dict[str, JsonValue]
    sessions: tuple[SessionAnalysis, ...]
    sharing: tuple[Sharing, ...]
    problems: tuple[Problem, ...]

    @property
    def rows(self) -> tuple[RequestRow, ...]:
        return tuple(row for session in self.sessions for row in session.rows)

    @property
    def breaks(self) -> tuple[Break, ...]:
        return tuple(r.prefix_break for r in self.rows if r.prefix_break is not None)

    @property
    def totals(self) -> Totals:
        return totals(self.rows)

    @property
    def advice(self) -> tuple[Advice, ...]:
        return advise(self.breaks)


def build_report(
    renderer: Renderer,
    tokenizer: str,
    transcript: Transcript,
    other: Transcript | None = None,
    other_name: str = "other",
) -> Report:
    """Analyze every session; compare the first session's first request with every other
    session's (and with `other`'s first session, named `other_name`) for cross-session sharing."""
    sessions = tuple(analyze_session(renderer, s) for s in transcript.sessions)
    problems = [*transcript.problems, *(p for s in sessions for p in s.problems)]
    pairs = [(transcript.sessions[0], s) for s in transcript.sessions[1:]]
    if other is not None:
        problems += other.problems
        if transcript.sessions and other.sessions:
            pairs.append((transcript.sessions[0], replace(other.sessions[0], name=other_name)))
    sharing = []
    for first, second in pairs:
        try:
            sharing.append(compare_sessions(renderer, first, second))
        except TemplateError as exc:
            problems.append(Problem(second.requests[0].where, f"cross-session comparison: {exc}"))
    return Report(tokenizer, renderer.template_kwargs, sessions, tuple(sharing), tuple(problems))


def totals(rows: Sequence[RequestRow]) -> Totals:
    return Totals(
        requests=len(rows),
        prompt_tokens=sum(r.prompt_tokens for r in rows),
        prefill_tokens=sum(r.prefill_tokens for r in rows),
        hybrid_prefill_tokens=sum(r.hybrid_prefill_tokens for r in rows),
        generated_tokens=sum(r.generated_tokens for r in rows),
        breaks=sum(r.prefix_break is not None for r in rows),
    )


def advise(breaks: Sequence[Break]) -> tuple[Advice, ...]:
    """One piece of advice per detected cause, most tokens saved first. A fix saves the tokens
    after each break that the prompt repeats from the previous sequence."""
    by_cause: dict[Cause, list[Break]] = {}
    for brk in breaks:
        by_cause.setdefault(brk.cause, []).append(brk)
    advice = [
        Advice(cause, ADVICE[cause], len(found), sum(b.recoverable_tokens for b in found))
        for cause, found in by_cause.items()
    ]
    return tuple(sorted(advice, key=lambda a: (-a.tokens_saved, a.cause.value)))


def to_json(report: Report) -> dict[str, JsonValue]:
    """Machine-readable form: rows, totals, sharing, advice, problems."""
    t = report.totals
    return {
        "tokenizer": report.tokenizer,
        "template_kwargs": report.template_kwargs,
        "rows": [_row_json(r) for r in report.rows],
        "totals": {
            "requests": t.requests,
            "prompt_tokens": t.prompt_tokens,
            "prefill_tokens": t.prefill_tokens,
            "hybrid_prefill_tokens": t.hybrid_prefill_tokens,
            "no_cache_prefill_tokens": t.prompt_tokens,
            "generated_tokens": t.generated_tokens,
            "breaks": t.breaks,
        },
        "sharing": [_sharing_json(s) for s in report.sharing],
        "advice": [
            {
                "cause": a.cause.value,
                "advice": a.text,
                "breaks": a.breaks,
                "tokens_saved": a.tokens_saved,
            }
            for a in report.advice
        ],
        "problems": [{"where": p.where, "problem": p.text} for p in report.problems],
    }


def _row_json(row: RequestRow) -> dict[str, JsonValue]:
    brk = row.prefix_break
    return {
        "session": row.session,
        "request": row.request,
        "where": row.where,
        "prompt_tokens": row.prompt_tokens,
        "reusable_tokens": row.reusable_tokens,
        "prefill_tokens": row.prefill_tokens,
        "generated_tokens": row.generated_tokens,
        "hybrid_reusable_tokens": row.hybrid_reusable_tokens,
        "hybrid_prefill_tokens": row.hybrid_prefill_tokens,
        "break": None
        if brk is None
        else {
            "position": brk.position,
            "message_index": brk.message_index,
            "role": brk.role,
            "cause": brk.cause.value,
            "detail": brk.detail,
            "old": brk.old,
            "new": brk.new,
            "recoverable_tokens": brk.recoverable_tokens,
        },
    }


def _sharing_json(sharing: Sharing) -> dict[str, JsonValue]:
    return {
        "sessions": [sharing.first, sharing.second],
        "prompt_tokens": [sharing.first_prompt_tokens, sharing.second_prompt_tokens],
        "shared_tokens": sharing.shared_tokens,
        "shared_tokens_volatile_last": sharing.shared_tokens_volatile_last,
        "moved": list(sharing.moved),
    }
