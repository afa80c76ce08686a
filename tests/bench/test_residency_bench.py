"""`agentserve bench residency`'s server command lines: every ablation gets the same RAM for KV,
and the admission rule asked for reaches every server (so `on` can be measured with and without
protective admission side by side)."""

from __future__ import annotations

import argparse
from pathlib import Path

from agentserve.bench.residency_bench import add_args, server_args
from agentserve.server.cli import register


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(list(argv))


def serve_parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser()
    register(top.add_subparsers())
    return top


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_the_admission_rule_reaches_every_server_and_serve_accepts_the_line(tmp_path: Path):
    args = _args("--admission", "eager", "--kv-cache-memory-gib", "0.04")
    for mode in ("off", "on", "B", "G"):
        cmd = server_args(args, mode, tmp_path)
        assert _flag(cmd, "--admission") == "eager"
        parsed = serve_parser().parse_args(["serve", *cmd])  # serve's own parser takes every flag as given
        assert parsed.admission == "eager"
    assert _flag(server_args(_args(), "on", tmp_path), "--admission") == "auto"


def test_ablations_share_one_kv_budget(tmp_path: Path):
    args = _args("--kv-cache-memory-gib", "0.04", "--kv-host-share", "0.25")
    b, g = server_args(args, "B", tmp_path), server_args(args, "G", tmp_path)
    assert float(_flag(b, "--kv-cache-memory-gib")) == 0.04
    assert float(_flag(g, "--kv-cache-memory-gib")) + float(_flag(g, "--kv-host-gib")) == 0.04
