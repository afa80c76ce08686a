"""`agentserve` command line: one subcommand per module, each owning its own arguments.

Each subcommand module exposes `register(subparsers)` which adds its parser and sets
`func=run` where `run(args) -> int` is the exit status. Environment variables are read here
and nowhere else.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from agentserve import allocator, omp_env

# Subcommand modules, imported lazily so `agentserve analyze` never pays for torch.
_COMMANDS: dict[str, str] = {
    "demo": "agentserve.demo",
    "serve": "agentserve.server.cli",
    "bench": "agentserve.bench.cli",
    "analyze": "agentserve.analyze.cli",
    "sim": "agentserve.sim.cli",
    "replay": "agentserve.bench.replay_cli",
    "ledger": "agentserve.ledger.cli",
    "report": "agentserve.ledger.report",
}


def cache_root() -> Path:
    """Where converted models live: $AGENTSERVE_CACHE or ~/.cache/agentserve."""
    env = os.environ.get("AGENTSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "agentserve"


def _command(argv: list[str]) -> str | None:
    """The subcommand named in argv (its first non-option word)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = _command(argv)
    for name, module_name in _COMMANDS.items():
        if wanted is not None and name != wanted:
            subparsers.add_parser(name)  # listed in --help; its own arguments load on use
            continue
        module = importlib.import_module(module_name)
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else argv
    # tcmalloc for the commands that run the model, loaded before anything allocates: they
    # re-execute once with it preloaded (allocator.py has the measured reasons); never when
    # called in-process (a test's main([...]) must not replace the test runner)
    env = allocator.reexec_env(os.environ, _command(argv)) if from_command_line else None
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "agentserve.cli", *argv], env)
    # OpenMP's wait: `serve` spins briefly, offline commands sleep (omp_env.py has the measured
    # reasons); the user's OMP_WAIT_POLICY / GOMP_SPINCOUNT wins. Must precede importing torch.
    omp_env.apply(os.environ, serving=_command(argv) == "serve")
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    args.cache_root = cache_root()
    func = getattr(args, "func", None)
    if func is None:
        parser.error(f"{args.command}: not available")
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
