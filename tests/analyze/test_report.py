"""Totals and advice from rows: exact sums, one piece of advice per cause."""

from __future__ import annotations

from agentserve.analyze.analysis import RequestRow, SessionAnalysis
from agentserve.analyze.breaks import Break
from agentserve.analyze.causes import Cause
from agentserve.analyze.report import ADVICE, Report, advise, to_json, totals


def _break(cause: Cause, recoverable: int) -> Break:
    return Break(
        position=10,
        char=40,
        message_index=0,
        role="system",
        cause=cause,
        detail="d",
        old="a",
        new="b",
        recoverable_tokens=recoverable,
    )


def _row(request: int, prompt: int, reused: int, hybrid: int, brk: Break | None) -> RequestRow:
    return RequestRow(
        session="s",
        request=request,
        where="f:1",
        prompt_tokens=prompt,
        reusable_tokens=reused,
        generated_tokens=5,
        hybrid_reusable_tokens=hybrid,
        prefix_break=brk,
    )


ROWS = (
    _row(1, 100, 0, 0, None),
    _row(2, 150, 10, 0, _break(Cause.VOLATILE, 120)),
    _row(3, 200, 160, 150, None),
    _row(4, 260, 30, 0, _break(Cause.TOOLS_REORDERED, 200)),
    _row(5, 300, 12, 0, _break(Cause.VOLATILE, 270)),
)


def test_totals_are_exact_sums() -> None:
    t = totals(ROWS)
    assert (t.requests, t.prompt_tokens, t.generated_tokens, t.breaks) == (5, 1010, 25, 3)
    assert t.prefill_tokens == 1010 - (0 + 10 + 160 + 30 + 12)
    assert t.hybrid_prefill_tokens == 1010 - 150


def test_one_advice_per_cause_ordered_by_tokens_saved() -> None:
    advice = advise([r.prefix_break for r in ROWS if r.prefix_break])
    assert [(a.cause, a.breaks, a.tokens_saved) for a in advice] == [
        (Cause.VOLATILE, 2, 390),
        (Cause.TOOLS_REORDERED, 1, 200),
    ]
    assert advice[0].text.startswith("Volatile content last")
    assert set(ADVICE) == set(Cause)  # every cause has advice


def test_json_has_a_row_per_request_and_null_breaks() -> None:
    report = Report("tok", {}, (SessionAnalysis("s", ROWS, ()),), (), ())
    data = to_json(report)
    assert [r["request"] for r in data["rows"]] == [1, 2, 3, 4, 5]
    assert data["rows"][0]["break"] is None
    assert data["rows"][1]["break"]["cause"] == "volatile_text"
    assert data["rows"][2]["hybrid_prefill_tokens"] == 50
    assert data["totals"]["breaks"] == 3
