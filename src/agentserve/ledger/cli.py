"""`agentserve ledger otel LEDGER [LEDGER...] (--json PATH | --endpoint URL)`: the ledger's
attempts as OpenTelemetry spans (task -> turn -> attempt), written as OTLP/JSON lines for the
Collector's otlpjsonfile receiver or sent to an OTLP/HTTP endpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_OK = 0
EXIT_PROBLEMS = 1  # exported, but some ledger lines were skipped (listed on stderr)
EXIT_FAILED = 2  # nothing exported: no usable ledger, a bad endpoint, an export that failed


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("ledger", help="the per-attempt ledger: export it",
                                   description="The per-attempt token and cost ledger.")
    commands = parser.add_subparsers(dest="ledger_command", required=True, metavar="SUBCOMMAND")
    otel = commands.add_parser("otel", help="export the ledger as OpenTelemetry spans",
                               description=__doc__)
    otel.add_argument("ledgers", nargs="+", type=Path, metavar="LEDGER",
                      help="ledger JSONL files (rotated PATH.1, PATH.2, ... are read too)")
    out = otel.add_mutually_exclusive_group(required=True)
    out.add_argument("--json", type=Path, metavar="PATH",
                     help="write OTLP/JSON lines (one ExportTraceServiceRequest per line)")
    out.add_argument("--endpoint", metavar="URL",
                     help="send OTLP/HTTP protobuf, e.g. http://localhost:4318 (/v1/traces added "
                          "when the URL has no path)")
    otel.add_argument("--model", metavar="NAME", help="recorded as gen_ai.request.model")
    otel.add_argument("--service-name", default="agentserve", metavar="NAME",
                      help="the resource's service.name (default: agentserve)")
    otel.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                      help="--endpoint: give up on a request after this long, retries included "
                           "(default 10)")
    otel.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agentserve.ledger.otel import OtelExportError, export_spans, traces_url
    from agentserve.ledger.reader import LedgerError, read_ledger

    try:
        url = None if args.endpoint is None else traces_url(args.endpoint)
        ledger = read_ledger(args.ledgers)
    except (LedgerError, ValueError) as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot read the ledger: {exc}")
    for problem in ledger.problems:
        print(f"agentserve ledger otel: {problem}", file=sys.stderr)
    try:
        n = export_spans(ledger.rows, json_path=args.json, endpoint=url, outcomes=ledger.outcomes,
                         model=args.model, service_name=args.service_name, timeout_s=args.timeout)
    except OtelExportError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot write {args.json}: {exc}")
    print(f"{n} spans from {len(ledger.rows)} attempts to {args.json or url}")
    return EXIT_PROBLEMS if ledger.problems else EXIT_OK


def _fail(text: str) -> int:
    print(f"agentserve ledger otel: {text}", file=sys.stderr)
    return EXIT_FAILED
