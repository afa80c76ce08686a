"""Tool schemas and forced-call grammars, checked and compiled before a request reaches the engine.

`Grammars.prepare` runs on the event loop but does its work on a small thread pool (at
SCHED_IDLE, see GrammarConfig): every
tool's parameters schema is checked (a 400 naming the tool if it does not compile) and the
request's Guide is compiled into a template the step thread then only copies. For a forced call
the Guide's compile stands for the checks (it embeds every schema); they run only if it fails,
to name the tool. Both are cached
per distinct schema (model/grammar.py), so an agent resending its tools costs a dict lookup.

Caps (GrammarConfig, from the CLI): tools per request, and compile time per schema counted from
the moment its compile starts (not while it waits for a worker). A compile over the time cap is
a 400 naming the tool; it keeps running on its worker (llguidance cannot be interrupted, and its
own LLParserLimits bound its work) and its result is cached for the next request that sends it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from agentserve.engine.request import Guide
from agentserve.model.grammar import CompiledGrammar, GrammarCheck, GrammarCompiler, Job
from agentserve.server.errors import APIError
from agentserve.server.protocol import Tool

log = logging.getLogger(__name__)
V = TypeVar("V", GrammarCheck, CompiledGrammar)


@dataclass(frozen=True, slots=True)
class GrammarConfig:
    max_tools: int = 256  # tools per request; more is a 400 (real agents send tens)
    compile_timeout_s: float = 10.0  # per schema; a 40-tool forced call compiles in ~0.1 s
    num_workers: int = 2
    # The compile threads' CPU priority (Linux: per thread). llguidance drops the GIL, but the
    # CPU is shared: on 2 cores a compile at equal priority doubled the step time beside it (53
    # -> 110 ms p50). They run at SCHED_IDLE (only on a core nothing else wants, preempted at
    # once when a step's thread wakes): the running streams' ITL p99 with a new 40-tool request
    # at the door fell from 92-106 to 81-89 ms against nice 10 (docs/benchmarks.md, run 14).
    # A compile still running after `promote_after_s` is raised to `worker_nice`, so a machine
    # busy for seconds cannot starve it; where leaving SCHED_IDLE is not permitted (no
    # CAP_SYS_NICE and RLIMIT_NICE below 20 - worker_nice) they run at `worker_nice` throughout.
    worker_idle: bool = True
    worker_nice: int = 10
    promote_after_s: float = 1.0
    # Compile on the step thread and check tools on the event loop, uncached: the behaviour
    # before issue 9, kept only so `agentserve bench grammar` can measure both side by side.
    inline: bool = False


def add_grammar_args(p: argparse.ArgumentParser) -> None:
    d = GrammarConfig()
    p.add_argument("--max-tools-per-request", type=int, default=d.max_tools)
    p.add_argument("--grammar-compile-timeout", type=float, default=d.compile_timeout_s,
                   help="seconds one tool schema or forced-call grammar may take to compile (then a 400)")
    p.add_argument("--grammar-inline", action="store_true",
                   help="compile grammars on the engine's step thread (the old behaviour; for bench grammar)")


def grammar_config(args: argparse.Namespace) -> GrammarConfig:
    if args.max_tools_per_request < 1 or args.grammar_compile_timeout <= 0:
        raise SystemExit("--max-tools-per-request must be >= 1 and --grammar-compile-timeout > 0")
    return GrammarConfig(max_tools=args.max_tools_per_request, compile_timeout_s=args.grammar_compile_timeout,
                         inline=args.grammar_inline)


def tool_guide(tool: Tool) -> Guide:
    """The tool's parameters as a Guide; keys sorted so one schema is one cache entry."""
    return Guide.json_schema(json.dumps(tool.function.parameters, sort_keys=True))


class WorkerPriority:
    """The compile threads' CPU priority: SCHED_IDLE while a job is young, `nice` once promoted.
    Linux only (there a thread id names one thread); elsewhere every call does nothing. Never
    raises: the scheduler is advice, and a failing worker initializer would break the pool.

    Invariant: a thread is promoted only while it is in `_busy` (running a job), and it lowers
    itself again, under the same lock, before it leaves `_busy`, so a promotion never outlives
    the job it was for."""

    def __init__(self, nice: int, idle: bool) -> None:
        self.nice = nice
        self.linux = sys.platform == "linux"
        self.idle = idle and self.linux and _can_leave_idle(nice)
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self.num_promoted = 0

    def run(self, fn: Callable[[], None]) -> None:
        """Run one job on the calling (worker) thread at the low priority."""
        tid = threading.get_native_id()
        with self._lock:
            self._lower(tid)
            self._busy.add(tid)
        try:
            fn()
        finally:
            with self._lock:
                self._lower(tid)
                self._busy.discard(tid)

    def promote(self) -> None:
        """Raise every thread now running a job to `nice`: one of them holds a job that has run
        too long at SCHED_IDLE (it cannot tell which; there are at most num_workers)."""
        if not self.idle:
            return
        with self._lock:
            for tid in self._busy:
                if _set_policy(tid, idle=False, nice=self.nice):
                    self.num_promoted += 1

    def _lower(self, tid: int) -> None:
        if self.linux:
            _set_policy(tid, idle=self.idle, nice=self.nice)


def _set_policy(tid: int, idle: bool, nice: int) -> bool:
    try:
        if idle:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except OSError:
        return False


def _can_leave_idle(nice: int) -> bool:
    """Whether a thread of this process may go from SCHED_IDLE back to SCHED_OTHER at `nice`
    (Linux asks for CAP_SYS_NICE or RLIMIT_NICE >= 20 - nice), tried on a throwaway thread."""
    result: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        result.append(_set_policy(tid, idle=True, nice=nice) and _set_policy(tid, idle=False, nice=nice))

    t = threading.Thread(target=probe, name="agentserve-sched-probe")
    t.start()
    t.join()
    return result == [True]


def _where(i: int) -> str:
    return f"tools[{i}].function.parameters"


class Grammars:
    def __init__(self, compiler: GrammarCompiler, config: GrammarConfig) -> None:
        self.compiler = compiler
        self.config = config
        self.priority = WorkerPriority(config.worker_nice, config.worker_idle)
        self._pool = ThreadPoolExecutor(config.num_workers, thread_name_prefix="agentserve-grammar")

    def _submit(self, fn: Callable[[], None]) -> object:
        return self._pool.submit(self.priority.run, fn)

    async def prepare(self, tools: list[Tool], guide: Guide | None) -> None:
        """Check every tool's schema and compile the guide; APIError 400 naming what fails."""
        if len(tools) > self.config.max_tools:
            raise APIError(400, f"tools: {len(tools)} tools in one request; this server takes at most "
                                f"{self.config.max_tools} (--max-tools-per-request)", param="tools")
        if self.config.inline:
            for i, tool in enumerate(tools):
                self._raise_for(i, tool, self.compiler.check_uncached(tool_guide(tool)))
            return
        if guide is None:
            await self._check_all(tools)
            return
        # A forced call's grammar embeds every tool's schema: when it compiles, each schema does,
        # and the per-tool checks (as much native work again) are skipped; when it does not, they
        # name the tool at fault.
        names = ", ".join(repr(t.function.name) for t in tools[:5]) + (f" and {len(tools) - 5} more" if len(tools) > 5 else "")
        compiled = await self._wait(self.compiler.compile(guide, self._submit)[0],
                                    f"tool_choice: the forced-call grammar over tools {names}", "tool_choice")
        if compiled.error is None:
            return
        await self._check_all(tools)
        raise APIError(400, f"tool_choice: the forced-call grammar over tools {names} does not compile: "
                            f"{compiled.error}", param="tool_choice")

    async def _check_all(self, tools: list[Tool]) -> None:
        """Every tool's schema checked (cached per distinct schema); a 400 naming the first bad one."""
        jobs = [self._check(t) for t in tools]
        checks = await asyncio.gather(*(self._wait(job, f"{_where(i)}: function {t.function.name!r}: schema", _where(i))
                                        for i, (t, job) in enumerate(zip(tools, jobs, strict=True))))
        for i, (tool, check) in enumerate(zip(tools, checks, strict=True)):
            self._raise_for(i, tool, check)

    def _check(self, tool: Tool) -> Job[GrammarCheck]:
        job, new = self.compiler.check(tool_guide(tool), self._submit)
        if new:  # once per distinct schema: say what a forced call will not enforce
            def report(done: Future[GrammarCheck]) -> None:
                if done.result().warnings:
                    log.info("tool %r: schema features not enforced in forced calls: %s",
                             tool.function.name, "; ".join(done.result().warnings))

            job.result.add_done_callback(report)
        return job

    def _raise_for(self, i: int, tool: Tool, check: GrammarCheck) -> None:
        if check.error is not None:
            raise APIError(400, f"{_where(i)}: function {tool.function.name!r}: invalid JSON schema: "
                                f"{check.error}", param=_where(i))

    async def _wait(self, job: Job[V], what: str, param: str) -> V:
        """The job's value, or a 400 once it has run compile_timeout_s (queueing not counted).
        Shielded: a waiter that gives up never cancels a computation others share."""
        if job.result.done():  # cached: however long ago it ran
            return job.result.result()
        started = await asyncio.shield(asyncio.wrap_future(job.started))
        result = asyncio.wrap_future(job.result)  # shielded at each wait: a timeout cancels only the wait
        young = started + min(self.config.promote_after_s, self.config.compile_timeout_s) - time.monotonic()
        if young > 0:
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(asyncio.shield(result), young)
        self.priority.promote()  # it has run long at SCHED_IDLE: a busy machine must not starve it
        left = started + self.config.compile_timeout_s - time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(result), max(left, 0.0))
        except TimeoutError:
            log.warning("%s: compile passed %.1f s", what, self.config.compile_timeout_s)
            raise APIError(400, f"{what} took longer than {self.config.compile_timeout_s:g} s to compile "
                                "(--grammar-compile-timeout); simplify it", param=param,
                           code="grammar_too_complex") from None
