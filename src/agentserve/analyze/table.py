"""The report as rich tables for a terminal."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from agentserve.analyze.analysis import RequestRow
from agentserve.analyze.breaks import Break
from agentserve.analyze.report import Report


def print_report(report: Report, console: Console, title: str) -> None:
    console.print(Text(f"Prefix stability of {title} · tokenizer {report.tokenizer}", style="bold"))
    console.print(_rows_table(report))
    breaks = [(r, r.prefix_break) for r in report.rows if r.prefix_break is not None]
    if breaks:
        console.print(Text("Breaks", style="bold"))
        for row, brk in breaks:
            _print_break(console, row, brk, many=len(report.sessions) > 1)
    console.print(_totals_table(report))
    for sharing in report.sharing:
        line = (
            f"Shared at the start by {sharing.first!r} and {sharing.second!r}: "
            f"{sharing.shared_tokens} tokens of {sharing.first_prompt_tokens}/"
            f"{sharing.second_prompt_tokens}; with volatile values last: "
            f"{sharing.shared_tokens_volatile_last}"
        )
        moved = f" (moved {', '.join(sharing.moved)})" if sharing.moved else ""
        console.print(Text(line + moved))
    if report.advice:
        console.print(Text("Advice", style="bold"))
        for advice in report.advice:
            count = f"{advice.breaks} break{'s' if advice.breaks > 1 else ''}"
            saved = f"saves {advice.tokens_saved} tokens ({count}: {advice.cause.value})"
            console.print(Text("• ") + Text(saved, style="green") + Text(f": {advice.text}"))


def _rows_table(report: Report) -> Table:
    many = len(report.sessions) > 1
    table = Table(show_edge=False, pad_edge=False)
    if many:
        table.add_column("session")
    table.add_column("req", justify="right")
    for name in ("prompt", "reused", "prefill", "gen", "hybrid reused", "hybrid prefill"):
        table.add_column(name, justify="right")
    table.add_column("break")
    for row in report.rows:
        cells = [row.session] if many else []
        cells += [
            str(v)
            for v in (
                row.request,
                row.prompt_tokens,
                row.reusable_tokens,
                row.prefill_tokens,
                row.generated_tokens,
                row.hybrid_reusable_tokens,
                row.hybrid_prefill_tokens,
            )
        ]
        brk = row.prefix_break
        cells.append(
            "" if brk is None else f"@{brk.position} msg {brk.message_index} {brk.cause.value}"
        )
        table.add_row(*cells)
    return table


def _print_break(console: Console, row: RequestRow, brk: Break, *, many: bool) -> None:
    who = f"{row.session}, request {row.request}" if many else f"request {row.request}"
    role = f" ({brk.role})" if brk.role else " (generation prompt)"
    head = Text(f"{who}: token {brk.position}, message {brk.message_index}{role}: ")
    head.append(brk.cause.value, style="yellow")
    head.append(f" — {brk.detail}")
    console.print(head)
    console.print(Text("    old: ", style="dim") + Text(repr(brk.old)))
    console.print(Text("    new: ", style="dim") + Text(repr(brk.new)))


def _totals_table(report: Report) -> Table:
    t = report.totals
    table = Table(title="Totals", show_header=False, show_edge=False, title_justify="left")
    table.add_column("what")
    table.add_column("tokens", justify="right")
    table.add_column("share", justify="right")

    def share(n: int) -> str:
        return f"{100 * n / t.prompt_tokens:.1f}%" if t.prompt_tokens else "-"

    table.add_row("requests", str(t.requests), "")
    table.add_row(
        "prompt tokens (prefilled without a cache)", str(t.prompt_tokens), share(t.prompt_tokens)
    )
    table.add_row("prefilled with a prefix cache", str(t.prefill_tokens), share(t.prefill_tokens))
    table.add_row(
        "prefilled by a hybrid model", str(t.hybrid_prefill_tokens), share(t.hybrid_prefill_tokens)
    )
    table.add_row("generated tokens", str(t.generated_tokens), "")
    table.add_row("prefix breaks", str(t.breaks), "")
    return table
