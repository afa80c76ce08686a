"""The report as one self-contained HTML page: a bar per request (reused vs prefilled tokens,
for a prefix cache and for a hybrid model), the breaks, totals and advice. No scripts, no
external files."""

from __future__ import annotations

from html import escape

from agentserve.analyze.analysis import RequestRow
from agentserve.analyze.report import Report

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { padding: 2px 8px; text-align: right; border-bottom: 1px solid #eee; }
td.l, th.l { text-align: left; }
.bar { display: flex; width: 480px; height: 9px; background: #f4f4f4; margin: 1px 0; }
.reused { background: #3a9d5d; } .prefill { background: #e8833a; }
.hreused { background: #7fbf95; } .hprefill { background: #f2b787; }
.legend span { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 12px; }
pre { background: #f7f7f7; padding: 4px 8px; white-space: pre-wrap; margin: 2px 0; }
"""


_LEGEND = (
    "<p class='legend'><span class='reused'></span>reused <span class='prefill'></span>"
    "prefilled (prefix cache) <span class='hreused'></span>reused "
    "<span class='hprefill'></span>prefilled (hybrid model)</p>"
)
_HEADER = (
    "<table><tr><th class='l'>request</th><th>prompt</th><th>reused</th><th>prefill</th>"
    "<th>hybrid reused</th><th>gen</th><th class='l'>reused vs prefilled</th>"
    "<th class='l'>break</th></tr>"
)


def render_html(report: Report, title: str) -> str:
    widest = max((r.prompt_tokens for r in report.rows), default=1) or 1
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>Prefix stability: {escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>Prefix stability: {escape(title)}</h1>",
        f"<p>Tokenizer and template: <b>{escape(report.tokenizer)}</b></p>",
        _LEGEND,
        _HEADER,
    ]
    parts += [_row(row, widest, many=len(report.sessions) > 1) for row in report.rows]
    parts.append("</table>")
    parts += _breaks(report)
    parts += _totals(report)
    parts.append("</body></html>")
    return "\n".join(parts)


def _bar(reused: int, prefill: int, widest: int, kind: str) -> str:
    def width(n: int) -> str:
        return f"{100 * n / widest:.2f}%"

    return (
        f"<div class='bar' title='{reused} reused, {prefill} prefilled'>"
        f"<div class='{kind}reused' style='width:{width(reused)}'></div>"
        f"<div class='{kind}prefill' style='width:{width(prefill)}'></div></div>"
    )


def _row(row: RequestRow, widest: int, *, many: bool) -> str:
    label = f"{row.session} #{row.request}" if many else f"#{row.request}"
    brk = row.prefix_break
    cause = "" if brk is None else f"@{brk.position} msg {brk.message_index} {brk.cause.value}"
    bars = _bar(row.reusable_tokens, row.prefill_tokens, widest, "") + _bar(
        row.hybrid_reusable_tokens, row.hybrid_prefill_tokens, widest, "h"
    )
    cells = (
        row.prompt_tokens,
        row.reusable_tokens,
        row.prefill_tokens,
        row.hybrid_reusable_tokens,
        row.generated_tokens,
    )
    numbers = "".join(f"<td>{n}</td>" for n in cells)
    return (
        f"<tr><td class='l'>{escape(label)}</td>{numbers}<td class='l'>{bars}</td>"
        f"<td class='l'>{escape(cause)}</td></tr>"
    )


def _breaks(report: Report) -> list[str]:
    out = ["<h2>Breaks</h2>"] if report.breaks else []
    for row in report.rows:
        brk = row.prefix_break
        if brk is None:
            continue
        out.append(
            f"<p><b>{escape(row.session)} request {row.request}</b>: token {brk.position}, "
            f"message {brk.message_index} ({escape(brk.role or 'generation prompt')}): "
            f"<b>{escape(brk.cause.value)}</b> — {escape(brk.detail)}</p>"
            f"<pre>old: {escape(repr(brk.old))}</pre><pre>new: {escape(repr(brk.new))}</pre>"
        )
    return out


def _totals(report: Report) -> list[str]:
    t = report.totals
    lines = (
        ("prompt tokens (prefilled without a cache)", t.prompt_tokens),
        ("prefilled with a prefix cache", t.prefill_tokens),
        ("prefilled by a hybrid model", t.hybrid_prefill_tokens),
        ("generated tokens", t.generated_tokens),
    )
    out = ["<h2>Totals</h2><table>"]
    out += [f"<tr><td class='l'>{what}</td><td>{n}</td></tr>" for what, n in lines]
    out.append("</table>")
    for s in report.sharing:
        out.append(
            f"<p>Shared at the start by {escape(s.first)} and {escape(s.second)}: "
            f"{s.shared_tokens} tokens; with volatile values last: "
            f"{s.shared_tokens_volatile_last}</p>"
        )
    if report.advice:
        out.append("<h2>Advice</h2><ul>")
        out += [
            f"<li><b>saves {a.tokens_saved} tokens</b> ({a.breaks} break"
            f"{'s' if a.breaks > 1 else ''}: {escape(a.cause.value)}): {escape(a.text)}</li>"
            for a in report.advice
        ]
        out.append("</ul>")
    return out
