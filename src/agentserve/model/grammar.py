"""Grammar compilation for constrained decoding, once per distinct Guide.

A Guide (a JSON schema or a Lark grammar) becomes an llguidance matcher *template*: compiled,
warmed by computing its first mask (that builds the lexer states every copy then shares), and
never advanced. Each request runs on a `deep_copy` of it. Templates and schema checks live in
bounded LRU caches (agents resend the same tools every turn, often from several sessions at
once, and a key asked for while it is being computed shares that computation).

Who compiles where: the server asks from a worker thread before the request reaches the engine
(server/grammars.py); the step thread only copies. It compiles itself only for a guide nobody
prepared (the offline API, the bench's inline baseline, or an entry evicted between preparation
and the request's first step), and counts those in `GrammarStats.num_step_thread_compiles`.

llguidance drops the GIL while it builds a matcher, validates a grammar and computes a mask
(measured: a Python thread spinning beside a 40-tool compile kept ~70% of its solo rate on a
loaded 2-core machine, against ~0% were the GIL held), so a worker's compile does not stop the
step thread's Python. Errors never escape as exceptions: a bad grammar, a resource limit or a
panic in the Rust code (pyo3's PanicException derives from BaseException) becomes `error`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import llguidance
import llguidance.torch

from agentserve.engine.request import Guide, GuideFormat

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# lenient: a keyword llguidance does not implement (uniqueItems, not, if/then) is ignored with a
# warning instead of failing the schema, so the grammar accepts a superset of the schema's values.
JSON_OPTIONS = {"whitespace_flexible": True, "lenient": True}
MAX_ERROR_CHARS = 400  # llguidance errors can quote the whole grammar


@dataclass(frozen=True, slots=True)
class GrammarCheck:
    error: str | None  # why the grammar does not compile; None if it does
    warnings: tuple[str, ...]  # features llguidance ignores (the grammar accepts more)


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    matcher: llguidance.LLMatcher | None  # warmed template, only ever deep-copied; None on error
    error: str | None
    warnings: tuple[str, ...]
    compile_s: float


@dataclass(frozen=True, slots=True)
class Job(Generic[V]):
    """One computation: `started` resolves to its monotonic start time, then `result` to its
    value. A compute function never raises (errors are part of the value)."""

    started: Future[float] = field(default_factory=Future)
    result: Future[V] = field(default_factory=Future)

    def run(self, compute: Callable[[], V]) -> None:
        if not self.result.set_running_or_notify_cancel():
            return
        self.started.set_result(time.monotonic())
        try:
            self.result.set_result(compute())
        except BaseException as exc:  # a broken contract: hand it to every waiter, not the pool
            self.result.set_exception(exc)


Submit = Callable[[Callable[[], None]], object]  # e.g. ThreadPoolExecutor.submit


class OnceCache(Generic[K, V]):
    """LRU of Jobs: at most `capacity` finished entries, least recently used evicted first.
    Entries still computing are never evicted (a waiter holds them), so the cache can briefly
    hold more than capacity."""

    def __init__(self, capacity: int) -> None:
        assert capacity >= 1
        self.capacity = capacity
        self._jobs: OrderedDict[K, Job[V]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, key: K, compute: Callable[[], V], submit: Submit | None = None) -> tuple[Job[V], bool]:
        """The job for key and whether it is new; a new one runs on `submit`, else right here."""
        with self._lock:
            job = self._jobs.get(key)
            if job is not None:
                self._jobs.move_to_end(key)
                self.num_hits += 1
                return job, False
            job = self._jobs[key] = Job()
            self.num_misses += 1
            self._evict()
        if submit is not None:
            try:
                submit(lambda: job.run(compute))
                return job, True
            except RuntimeError:  # the pool is shutting down: compute here rather than never
                pass
        job.run(compute)
        return job, True

    def _evict(self) -> None:
        """Drop the least recently used finished entries over capacity. Walks from the old end
        and stops once enough are found: a full scan on every miss (40 new tool schemas a
        request, 1,024 entries) held the GIL for ~20 ms and stalled the step thread."""
        excess = len(self._jobs) - self.capacity
        if excess <= 0:
            return
        victims = []
        for key, job in self._jobs.items():
            if job.result.done():
                victims.append(key)
                if len(victims) == excess:
                    break
        for key in victims:
            del self._jobs[key]


@dataclass(frozen=True, slots=True)
class GrammarStats:
    num_compiled: int  # grammars compiled (cache misses)
    num_compile_hits: int  # requests that found their grammar compiled or compiling
    num_checked: int  # schemas checked (misses)
    num_check_hits: int
    num_step_thread_compiles: int  # compiles the step thread did itself (nobody prepared them)


def grammar_text(guide: Guide) -> str:
    if guide.format is GuideFormat.LARK:
        return llguidance.LLMatcher.grammar_from_lark(guide.text)
    return llguidance.LLMatcher.grammar_from_json_schema(guide.text, defaults=JSON_OPTIONS)


def short(message: str) -> str:
    """First line of an llguidance message, bounded (its errors can carry parser state)."""
    line = message.strip().split("\n", 1)[0]
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS] + "..."


def _is_panic(exc: BaseException) -> bool:
    return not isinstance(exc, Exception) and type(exc).__name__ == "PanicException"


def guarded(fn: Callable[[], V], on_error: Callable[[str], V]) -> V:
    """fn(), or on_error(reason) if llguidance raised or panicked."""
    try:
        return fn()
    except Exception as exc:
        return on_error(short(f"{type(exc).__name__}: {exc}"))
    except BaseException as exc:
        if not _is_panic(exc):
            raise
        return on_error(short(f"the grammar compiler crashed: {exc}"))


class GrammarCompiler:
    """Compiled templates and schema checks on one tokenizer, each once per distinct Guide."""

    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer], vocab_size: int,
                 capacity: int = 128, limits: llguidance.LLParserLimits | None = None) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits or llguidance.LLParserLimits(verbose_errors=False)
        self._compiled: OnceCache[Guide, CompiledGrammar] = OnceCache(capacity)
        self._checked: OnceCache[Guide, GrammarCheck] = OnceCache(capacity * 8)  # small values
        self._num_step_thread_compiles = 0

    def compile(self, guide: Guide, submit: Submit | None = None) -> tuple[Job[CompiledGrammar], bool]:
        """The guide's compile job, and whether this call started it (on `submit`)."""
        return self._compiled.get(guide, lambda: self.compile_uncached(guide), submit)

    def check(self, guide: Guide, submit: Submit | None = None) -> tuple[Job[GrammarCheck], bool]:
        return self._checked.get(guide, lambda: self.check_uncached(guide), submit)

    def compiled_for_step(self, guide: Guide) -> CompiledGrammar:
        """For the step thread: the prepared template, waiting for it if it is compiling, or
        compiled here if nobody prepared it."""
        job, new = self._compiled.get(guide, lambda: self.compile_uncached(guide))
        if new:
            self._num_step_thread_compiles += 1
        return job.result.result()

    def compile_uncached(self, guide: Guide) -> CompiledGrammar:
        start = time.perf_counter()

        def failed(error: str) -> CompiledGrammar:
            return CompiledGrammar(None, error, (), time.perf_counter() - start)

        def build() -> CompiledGrammar:
            matcher = llguidance.LLMatcher(self._tokenizer(), grammar_text(guide), log_level=0, limits=self.limits)
            if not matcher.is_error():  # warm: the first mask builds the lexer states copies share
                bitmask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            if matcher.is_error():
                return failed(short(matcher.get_error()))
            warnings = tuple(short(w) for w in matcher.get_grammar_warnings())
            return CompiledGrammar(matcher, None, warnings, time.perf_counter() - start)

        return guarded(build, failed)

    def check_uncached(self, guide: Guide) -> GrammarCheck:
        def build() -> GrammarCheck:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar_text(guide), self._tokenizer(), limits=self.limits)
            if is_error:
                return GrammarCheck(short(messages[0]) if messages else "invalid grammar", ())
            return GrammarCheck(None, tuple(short(m) for m in messages))

        return guarded(build, lambda error: GrammarCheck(error, ()))

    def stats(self) -> GrammarStats:
        return GrammarStats(self._compiled.num_misses, self._compiled.num_hits, self._checked.num_misses,
                            self._checked.num_hits, self._num_step_thread_compiles)
