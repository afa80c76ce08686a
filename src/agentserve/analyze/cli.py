"""`agentserve analyze TRANSCRIPT (--model NAME | --tokenizer DIR)`: how much of each request a
prefix cache can reuse, where the prefix breaks and why, from a tokenizer and its chat template
alone (no model weights)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agentserve import QWEN_CODER, SMOLLM2
from agentserve.analyze.html import render_html
from agentserve.analyze.render import (
    HFChatTokenizer,
    Renderer,
    TokenizerError,
    load_model_tokenizer,
    load_tokenizer_dir,
)
from agentserve.analyze.report import Report, build_report, to_json
from agentserve.analyze.transcript import load_transcript

EXIT_OK = 0
EXIT_PROBLEMS = 1  # bad input: reported what could be analyzed


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="prefix-stability analysis of agent transcripts with a real chat template",
        description=__doc__,
    )
    parser.add_argument(
        "transcript",
        type=Path,
        metavar="TRANSCRIPT",
        help="session JSON, requests JSONL, or a chat-completions request log",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model",
        metavar="NAME",
        help=f"a bundled model's tokenizer and template: {SMOLLM2}, {QWEN_CODER}",
    )
    source.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="a Hugging Face tokenizer directory with a chat template",
    )
    _add_options(parser)
    parser.set_defaults(func=run)


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--template-kwargs",
        default="{}",
        metavar="JSON",
        help="options for the template, e.g. '{\"enable_thinking\": true}'",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        metavar="OTHER",
        help="another session: how much its first request shares with ours",
    )
    parser.add_argument(
        "--format",
        choices=("auto", "session", "requests"),
        default="auto",
        help="input shape (default: detected)",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--html", type=Path, metavar="OUT", help="also write an HTML page")


def run(args: argparse.Namespace) -> int:
    try:
        template_kwargs = json.loads(args.template_kwargs)
    except ValueError as exc:
        return _fail(f"--template-kwargs: {exc}")
    if not isinstance(template_kwargs, dict):
        return _fail("--template-kwargs: expected a JSON object")
    try:
        tokenizer, name = _tokenizer(args)
    except (TokenizerError, LookupError, OSError, ValueError) as exc:  # ModelLoadError: ValueError
        return _fail(str(exc))
    transcript = load_transcript(args.transcript, args.format)
    other = load_transcript(args.compare, args.format) if args.compare else None
    renderer = Renderer(tokenizer, template_kwargs)
    report = build_report(renderer, name, transcript, other, str(args.compare))
    try:
        _output(report, args)
    except OSError as exc:
        return _fail(f"cannot write {args.html}: {exc}")
    for problem in report.problems:
        print(f"agentserve analyze: {problem}", file=sys.stderr)
    return EXIT_PROBLEMS if report.problems else EXIT_OK


def _tokenizer(args: argparse.Namespace) -> tuple[HFChatTokenizer, str]:
    if args.tokenizer is not None:
        return load_tokenizer_dir(args.tokenizer), str(args.tokenizer)
    return load_model_tokenizer(args.model, args.cache_root), args.model


def _output(report: Report, args: argparse.Namespace) -> None:
    from rich.console import Console  # imported on use: `agentserve --help` stays fast

    from agentserve.analyze.table import print_report

    if args.json:
        print(json.dumps(to_json(report), indent=2, ensure_ascii=False))
    elif report.rows:  # with nothing analyzed, the problems on stderr say it all
        console = Console(width=None if sys.stdout.isatty() else 140, highlight=False)
        print_report(report, console, str(args.transcript))
    if args.html is not None:
        args.html.write_text(render_html(report, str(args.transcript)), encoding="utf-8")


def _fail(text: str) -> int:
    print(f"agentserve analyze: {text}", file=sys.stderr)
    return EXIT_PROBLEMS
