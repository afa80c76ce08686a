"""`agentserve demo`: a scripted agent session on the bundled Qwen2.5-Coder-0.5B, run with the
prefix cache on and then off, showing per request what was reused and what was computed."""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from agentserve.agent_session import continue_ids, render_ids
from agentserve.engine.request import SamplingParams

SYSTEM = ("You are a careful coding agent working in a Python repository. Use the tools to "
          "inspect files and run tests before answering. Keep answers short.")
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the repository root."}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite, or one test file, with pytest.",
        "parameters": {"type": "object", "properties": {
            "target": {"type": "string", "description": "A test file or node id; empty for all."}},
            "required": []}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "glob": {"type": "string"}}, "required": ["pattern"]}}},
]
QUESTION = "tests/test_dates.py::test_parse_iso fails. Find out why and tell me the fix."
FILE = '''"""Date helpers."""
from datetime import datetime


def parse_iso(text: str) -> datetime:
    """Parse an ISO-8601 timestamp such as 2026-11-30T15:20:00Z."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S")


def to_iso(value: datetime) -> str:
    return value.strftime("%Y-%m-%dT%H:%M:%SZ")
'''
TEST_OUTPUT = """============================= test session starts ==============================
tests/test_dates.py F                                                    [100%]
___________________________________ test_parse_iso ___________________________________
    def test_parse_iso():
>       assert parse_iso("2026-11-30T15:20:00Z") == datetime(2026, 11, 30, 15, 20)
E       ValueError: time data '2026-11-30T15:20:00Z' does not match format '%Y-%m-%d %H:%M:%S'
utils/dates.py:7: ValueError
=========================== 1 failed in 0.04s ==================================="""
FOLLOW_UP = "Good. Should to_iso change as well? Answer in one sentence."
TOOL_RESULTS = [FILE, TEST_OUTPUT]


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    prompt: int
    reused: int
    prefilled: int
    generated: int
    ttft_s: float
    latency_s: float
    appended: bool
    miss: str  # the ledger's reason for the first block not served from cache


def miss_text(row) -> str:
    m = row.miss
    if m is None:
        return "-"
    if m.reason == "diverged":
        return f"diverged@{m.token}"
    if m.reason == "evicted":
        return f"evicted:{m.cause}"
    return "cold, cache off" if m.cause == "prefix caching off" else m.reason


def run_session(llm, max_tokens: int) -> list[Row]:
    """Four requests: question, two tool results, a follow-up; each the previous prompt +
    reply + the new piece, as token ids."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    prompt, appended = render_ids(llm.tokenizer, messages, TOOLS), True
    pieces = [("tool", r) for r in TOOL_RESULTS] + [("user", FOLLOW_UP)]
    rows: list[Row] = []
    ledger: list = []  # the ledger's rows, one per request (docs/ledger.md)
    llm.ledger.on_row.append(ledger.append)
    for i, label in enumerate(["question", "tool result 1", "tool result 2", "follow-up"]):
        (out,) = llm.generate([prompt], sampling, trajectory_id="demo")
        row = next(r for r in reversed(ledger) if r.request_id == out.request_id)
        rows.append(Row(label, out.num_prompt_tokens, out.num_reused_tokens,
                        out.num_prefilled_tokens, out.num_generated_tokens,
                        out.time_to_first_token_s or 0.0, out.latency_s, appended, miss_text(row)))
        if i == len(pieces):
            break
        reply = [t for t in out.token_ids if t not in llm.model_config.eos_token_ids]
        reply_text = llm.tokenizer.decode(reply, skip_special_tokens=False)
        messages.append({"role": "assistant", "content": reply_text})
        role, content = pieces[i]
        messages.append({"role": role, "content": content} if role == "user" else
                        {"role": "tool", "content": content, "tool_call_id": f"call_{i}"})
        cont = continue_ids(llm.tokenizer, list(out.prompt_token_ids) + list(out.token_ids), messages, TOOLS)
        prompt, appended = cont.token_ids, cont.appended
    return rows


def table(title: str, rows: list[Row]) -> Table:
    t = Table(title=title)
    for col in ("request", "prompt", "reused", "prefilled", "generated", "TTFT s", "total s", "first miss"):
        t.add_column(col, justify="left" if col in ("request", "first miss") else "right")
    for r in rows:
        t.add_row(r.label + ("" if r.appended else " *"), str(r.prompt), str(r.reused),
                  str(r.prefilled), str(r.generated), f"{r.ttft_s:.2f}", f"{r.latency_s:.2f}", r.miss)
    t.add_row("total", *(str(sum(getattr(r, f) for r in rows)) for f in ("prompt", "reused", "prefilled", "generated")),
              f"{sum(r.ttft_s for r in rows):.2f}", f"{sum(r.latency_s for r in rows):.2f}", "")
    return t


def run(args: argparse.Namespace) -> int:
    from agentserve.api import LLM

    console = Console()
    results: dict[bool, list[Row]] = {}
    for caching in (True, False):
        start = time.perf_counter()
        llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=caching,
                  cache_root=args.cache_root)
        console.print(f"[dim]loaded {args.model} ({args.dtype}, {llm.device}) in "
                      f"{time.perf_counter() - start:.1f} s; prefix cache {'on' if caching else 'off'}[/dim]")
        results[caching] = run_session(llm, args.max_tokens)
        console.print(table(f"agent session, prefix cache {'on' if caching else 'off'}", results[caching]))
        del llm
        gc.collect()
    on, off = results[True], results[False]
    pre_on, pre_off = sum(r.prefilled for r in on), sum(r.prefilled for r in off)
    t_on, t_off = sum(r.latency_s for r in on), sum(r.latency_s for r in off)
    console.print(f"prefilled tokens, cache on / off: {pre_on} / {pre_off} = {pre_on / pre_off:.2f}")
    console.print(f"total time, cache on / off: {t_on:.2f} s / {t_off:.2f} s = {t_on / t_off:.2f}")
    if not all(r.appended for r in on):
        console.print("* the template re-rendered history: that request was re-tokenized")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="scripted agent session with the prefix cache on and off")
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.set_defaults(func=run)
