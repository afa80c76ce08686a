"""Per request of a session: what a prefix cache and a hybrid model can reuse from the previous
request, and why the rest breaks.

The cached sequence after a request is its full sequence: the prompt followed by the reply it
generated, rendered without a generation prompt. The next prompt reuses the longest common token
prefix with it. A hybrid model (linear-attention layers) can resume only from saved states,
assumed at the end of each request's prompt and of its reply: it reuses the largest such
checkpoint on the cached path not beyond the common prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentserve.analyze.breaks import Break, explain
from agentserve.analyze.causes import Side
from agentserve.analyze.prefix import carried_checkpoints, common_prefix, hybrid_reusable
from agentserve.analyze.render import Renderer, TemplateError
from agentserve.analyze.transcript import Problem, Request, Session


@dataclass(frozen=True, slots=True)
class RequestRow:
    session: str
    request: int  # 1-based within the session
    where: str
    prompt_tokens: int
    reusable_tokens: int  # longest common token prefix with the previous full sequence
    generated_tokens: int
    hybrid_reusable_tokens: int
    prefix_break: Break | None  # None when the previous full sequence is reused whole

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.reusable_tokens

    @property
    def hybrid_prefill_tokens(self) -> int:
        return self.prompt_tokens - self.hybrid_reusable_tokens


@dataclass(frozen=True, slots=True)
class SessionAnalysis:
    name: str
    rows: tuple[RequestRow, ...]
    problems: tuple[Problem, ...]


@dataclass(frozen=True, slots=True)
class _Cached:
    """What the previous request left in the cache: its full sequence and the checkpoints on
    it (sorted token positions)."""

    full: Side
    checkpoints: tuple[int, ...]


def analyze_session(renderer: Renderer, session: Session) -> SessionAnalysis:
    """Rows for the session's requests; stops at the first request the template cannot render."""
    rows: list[RequestRow] = []
    problems: list[Problem] = []
    cached: _Cached | None = None
    for request in session.requests:
        try:
            prompt, full = render_request(renderer, request)
        except TemplateError as exc:
            problems.append(Problem(f"{request.where}, request {request.index}", str(exc)))
            break
        row, cached = _step(renderer, session.name, request, prompt, full, cached)
        rows.append(row)
    return SessionAnalysis(session.name, tuple(rows), tuple(problems))


def render_request(renderer: Renderer, request: Request) -> tuple[Side, Side]:
    """The prompt (with the generation prompt) and the full sequence (prompt + reply, without);
    with no recorded reply the full sequence is the prompt."""
    messages, tools = request.messages, request.tools
    prompt = Side(messages, tools, renderer.rendering(messages, tools, generation=True), True)
    if request.reply is None:
        return prompt, prompt
    whole = (*messages, request.reply)
    full = Side(whole, tools, renderer.rendering(whole, tools, generation=False), False)
    return prompt, full


def _step(
    renderer: Renderer,
    session: str,
    request: Request,
    prompt: Side,
    full: Side,
    cached: _Cached | None,
) -> tuple[RequestRow, _Cached]:
    prompt_ids, full_ids = prompt.rendering.token_ids, full.rendering.token_ids
    on_path = common_prefix(prompt_ids, full_ids)  # the prompt's part that the reply extends
    common, hybrid, brk, checkpoints = 0, 0, None, ()
    if cached is not None:
        old_ids = cached.full.rendering.token_ids
        common = common_prefix(prompt_ids, old_ids)
        hybrid = hybrid_reusable(cached.checkpoints, common)
        if common < len(old_ids) and common < len(prompt_ids):
            brk = explain(renderer, cached.full, prompt, common)
        checkpoints = cached.checkpoints
    prompt_end = len(prompt_ids) if on_path == len(prompt_ids) else None
    row = RequestRow(
        session=session,
        request=request.index,
        where=request.where,
        prompt_tokens=len(prompt_ids),
        reusable_tokens=common,
        generated_tokens=len(full_ids) - on_path,
        hybrid_reusable_tokens=hybrid,
        prefix_break=brk,
    )
    carried = carried_checkpoints(checkpoints, min(common, on_path), prompt_end, len(full_ids))
    return row, _Cached(full, carried)
