"""`agentserve serve`: the OpenAI-compatible server on one model."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import time
from typing import Any

from agentserve import allocator
from agentserve.config import ADMISSIONS, ServerConfig, TierConfig
from agentserve.ledger.prices import PriceError
from agentserve.model.precision import CHOICES as PRECISION_CHOICES
from agentserve.server.grammars import add_grammar_args, grammar_config
from agentserve.server.thread_binding import bind_team, describe
from agentserve.server.tool_parsers import get_parser

log = logging.getLogger("agentserve.serve")


def build_state(args: argparse.Namespace):
    from agentserve.api import LLM
    from agentserve.server.app import ServerState

    try:
        ledger = ledger_options(args)  # a bad price table fails now, before the model loads
    except PriceError as exc:
        raise SystemExit(f"--prices: {exc}") from None

    from agentserve.model.model_cache import ModelLoadError

    try:
        llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=not args.no_prefix_caching,
                  block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_memory_gib=args.kv_cache_memory_gib, max_model_len=args.max_model_len,
                  device=args.device, cache_root=args.cache_root, cpu_kernels=not args.no_cpu_kernels,
                  residency=args.residency, tiers=tier_config(args), ledger=not args.no_ledger,
                  compute_dtype=args.compute_dtype, admission=args.admission,
                  join_rows=args.join_rows)
    except ModelLoadError as exc:  # an unknown name or a broken directory: the message says what is expected
        raise SystemExit(f"agentserve serve: --model: {exc}") from None
    if llm.runner.guided is not None:
        llm.runner.guided.warm()  # constrained decoding's token table: built now, not on a request
    # Start-up's ~450k objects (tokenizer tables, modules) leave the collector's view: a full
    # collection over them held the GIL 0.3-0.6 s, a stall in every stream whenever a request's
    # allocations triggered one.
    gc.collect()
    gc.freeze()
    try:
        return ServerState(llm=llm, model_name=args.served_model_name or args.model,
                           tool_parser=get_parser(args.tool_parser), config=server_config(args),
                           grammar_config=grammar_config(args), ledger_options=ledger)
    except OSError as exc:
        raise SystemExit(f"--ledger {args.ledger}: {exc}") from None


def ledger_options(args: argparse.Namespace):
    from pathlib import Path

    from agentserve.ledger.prices import load_prices
    from agentserve.server.ledger_service import LedgerOptions

    if args.ledger_max_mib <= 0 or args.ledger_backups < 0:
        raise SystemExit("--ledger-max-mib must be > 0 and --ledger-backups >= 0")
    return LedgerOptions(path=None if args.ledger is None else Path(args.ledger),
                         max_bytes=max(4096, int(args.ledger_max_mib * 2**20)), backups=args.ledger_backups,
                         prices=load_prices(args.prices), text_window=args.ledger_text_window)


def _non_negative(text: str) -> int:
    """An argparse type: an int >= 0 (a bad value is a usage error naming the flag, not a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def tier_config(args: argparse.Namespace) -> TierConfig:
    """The lower KV tiers from the flags; the key from --kv-key, else AGENTSERVE_KV_KEY, else
    the generated key file (outside the store directory)."""
    from pathlib import Path

    from agentserve.kv.sealing import parse_key

    text = args.kv_key or os.environ.get("AGENTSERVE_KV_KEY")
    try:
        key = None if not text else parse_key(text)
    except ValueError as exc:
        raise SystemExit(f"--kv-key / AGENTSERVE_KV_KEY: {exc}") from None
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return TierConfig(
        host_bytes=int(args.kv_host_gib * 2**30),
        disk_dir=None if args.kv_disk_dir is None else Path(args.kv_disk_dir),
        disk_bytes=int(args.kv_disk_gib * 2**30) if args.kv_disk_dir is not None else 0,
        key=key, key_path=Path(args.kv_key_file) if args.kv_key_file else config_home / "agentserve" / "kv.key",
        encrypt=args.kv_encrypt, disk_page_cache=not args.kv_disk_no_page_cache)


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        max_queued_requests=args.max_queued_requests,
        max_queued_prompt_tokens=args.max_queued_prompt_tokens,
        max_request_body_bytes=args.max_request_body_bytes,
        stream_stall_timeout_s=args.stream_stall_timeout,
        engine_stall_timeout_s=args.engine_stall_timeout)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("memory allocator: %s", allocator.describe(os.environ))
    return serve(build_state(args), args.host, args.port, bind_threads=args.bind_threads == "auto")


def serve(state: Any, host: str, port: int, bind_threads: bool = False) -> int:
    """HTTP on a second thread, the engine's step loop on the main thread (faster there); with
    bind_threads, the step's compute threads pinned one per core once that thread has started
    (server/thread_binding.py: a thread the main thread starts later would inherit its CPU).
    Returns the exit status: 0 after a signal, 1 after an unrecoverable engine failure (once
    every failed request got its error, or failure_grace_s passed) so a supervisor restarts it."""
    import signal
    import threading

    import uvicorn

    from agentserve.server.app import build_app
    from agentserve.server.async_engine import AsyncEngine

    engine = state.engine = AsyncEngine(state.llm.engine, on_step=state.metrics.on_step)
    server = uvicorn.Server(uvicorn.Config(build_app(state), host=host, port=port,
                                           log_level="info", timeout_graceful_shutdown=5))
    http = threading.Thread(target=server.run, name="agentserve-http", daemon=True)

    def stop(*_: object) -> None:
        server.should_exit = True
        engine.shutdown()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    http.start()
    if bind_threads:
        runner = state.llm.runner
        log.info("%s", describe(bind_team(runner.bind_threads, runner.intraop_threads(), os.environ)))
    try:
        engine.run_here(alive=http.is_alive)
        if engine.failure is not None:
            _drain(state, state.config.failure_grace_s)
            log.error("exiting with status 1 after an unrecoverable engine failure: %s", engine.failure)
            return 1
    finally:
        server.should_exit = True
        http.join(timeout=15)
        state.llm.close()  # queued disk writes finish: the next start finds this run's KV
    return 0


def _drain(state: Any, grace_s: float) -> None:
    """Give the requests failed by the engine a moment to send their errors."""
    deadline = time.monotonic() + grace_s
    while state.live and time.monotonic() < deadline:
        time.sleep(0.05)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the weights' and KV cache's dtype")
    p.add_argument("--compute-dtype", default="auto", choices=list(PRECISION_CHOICES),
                   help="the arithmetic's dtype: auto = fp32 for a bf16 model on a CPU without a bf16 "
                        "dot product (AVX512-BF16 or AMX), else --dtype (docs/architecture.md, precision)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-cpu-kernels", action="store_true",
                   help="use torch's SDPA for CPU decode attention instead of the C++ kernel")
    p.add_argument("--residency", default="shadow", choices=["off", "shadow", "on"],
                   help="agent-aware KV residency (docs/residency.md): off = plain LRU; shadow = LRU, "
                        "with advice and receipts to check predictions; on = evict by expected value")
    p.add_argument("--admission", default="auto", choices=ADMISSIONS,
                   help="waiting requests after the earliest: eager = admitted while free blocks last; "
                        "protective = only into blocks whose taking evicts no protected trajectory's "
                        "prefix; auto = protective with --residency on, else eager")
    p.add_argument("--join-rows", type=_non_negative, default=None, metavar="N",
                   help="while requests decode, a short prompt remainder (up to 16 tokens) computes at most N "
                        "tokens a step, so the streams' step grows by N rows (0: all at once; default: 2 where "
                        "a bf16 model is computed in fp32, else 0)")
    p.add_argument("--bind-threads", choices=("auto", "off"), default="auto",
                   help="auto: pin the step's compute threads one per physical core, every other thread on any "
                        "allowed CPU (not done where OMP_PROC_BIND/OMP_PLACES/GOMP_CPU_AFFINITY/KMP_AFFINITY is "
                        "set or fewer CPUs are allowed than threads); off: leave them to the kernel")
    t = p.add_argument_group("KV tiers (docs/tiers.md)")
    t.add_argument("--kv-host-gib", type=float, default=0.0,
                   help="host-memory tier for blocks evicted from the pool (0: none)")
    t.add_argument("--kv-disk-dir", default=None, help="disk tier directory (kept across restarts)")
    t.add_argument("--kv-disk-gib", type=float, default=16.0, help="the disk tier's bound")
    t.add_argument("--kv-key", default=None,
                   help="store key, 64 hex digits or base64 (default: $AGENTSERVE_KV_KEY, else a key "
                        "generated into --kv-key-file)")
    t.add_argument("--kv-key-file", default=None,
                   help="where the generated key lives (default: ~/.config/agentserve/kv.key)")
    t.add_argument("--kv-encrypt", action="store_true", help="AES-GCM on disk (HMAC-SHA256 always)")
    t.add_argument("--kv-disk-no-page-cache", action="store_true",
                   help="sync and drop block files from the OS page cache (reads come from the disk)")
    p.add_argument("--tool-parser", default="auto", choices=["auto", "hermes", "json", "qwen3_xml"])
    lg = p.add_argument_group("ledger (docs/ledger.md)")
    lg.add_argument("--ledger", default=None, metavar="PATH",
                    help="write a JSON line per attempt here (rotated; `agentserve report PATH` draws it)")
    lg.add_argument("--ledger-max-mib", type=float, default=64.0, help="rotate the ledger file past this size")
    lg.add_argument("--ledger-backups", type=int, default=5, help="rotated ledger files kept")
    lg.add_argument("--ledger-text-window", action="store_true",
                    help="put a short window of old and new text around a prompt's divergence in the "
                         "ledger (off by default: the file then holds no prompt text)")
    lg.add_argument("--prices", default=None, metavar="PRESET|YAML",
                    help="price table for costs (presets: cached-half, cached-tenth, cache-write-premium, "
                         "self-hosted; default cached-tenth)")
    lg.add_argument("--no-ledger", action="store_true", help="keep no ledger (no rows, no ledger metrics)")
    d = ServerConfig()
    g = p.add_argument_group("bounds (docs/reliability.md)")
    g.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="requests accepted but not yet producing tokens; past it: 429")
    g.add_argument("--max-queued-prompt-tokens", type=int, default=d.max_queued_prompt_tokens,
                   help="their prompt tokens; past it: 429 (a request alone is always accepted)")
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="a larger body: 413")
    g.add_argument("--stream-stall-timeout", type=float, default=d.stream_stall_timeout_s,
                   metavar="SECONDS", help="drop a streaming client that reads nothing this long")
    g.add_argument("--engine-stall-timeout", type=float, default=d.engine_stall_timeout_s,
                   metavar="SECONDS", help="/health is 503 while one engine step runs this long")
    add_grammar_args(p)
    p.set_defaults(func=run)
