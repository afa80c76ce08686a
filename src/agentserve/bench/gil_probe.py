"""Does llguidance hold the GIL while it compiles a grammar or computes masks? A Python thread
counts loop iterations beside the work; were the GIL held, it would stall for the whole call."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agentserve.engine.request import Guide, RequestId
from agentserve.model.guided import GuidedDecoding


@dataclass(frozen=True, slots=True)
class GilProbe:
    what: str
    alone_ms: float  # wall time of the work by itself
    beside_ms: float  # the same beside the spinner (its Python glue waits for the GIL: up to 5 ms a hand-off)
    rate_vs_solo: float  # spinner iterations per second beside the work / alone (0 if the GIL were held)
    longest_stall_ms: float  # the spinner's longest gap between two iterations


def _spin_beside(work: Callable[[], None]) -> tuple[float, float, float]:
    """(work seconds, spinner iterations/s, longest gap s) with work on a second thread."""
    done = threading.Event()

    def run() -> None:
        work()
        done.set()

    thread = threading.Thread(target=run)
    n, longest = 0, 0.0
    start = last = time.perf_counter()
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        longest, last, n = max(longest, now - last), now, n + 1
    elapsed = time.perf_counter() - start
    thread.join()
    return elapsed, n / elapsed, longest


def _solo_rate(seconds: float) -> float:
    return _spin_beside(lambda: time.sleep(seconds))[1]


def _measure(what: str, work: Callable[[], None], solo_rate: float) -> GilProbe:
    start = time.perf_counter()
    work()
    alone = time.perf_counter() - start
    beside, rate, longest = _spin_beside(work)
    return GilProbe(what, alone * 1000, beside * 1000, rate / solo_rate, longest * 1000)


def probe(tokenizer: Any, vocab_size: int, guides: Callable[[str], Guide]) -> list[GilProbe]:
    """Compile three fresh grammars (twice: alone, then beside the spinner), then 200 steps of
    masks for 8 rows of one grammar."""
    guided = GuidedDecoding(tokenizer, vocab_size)
    guided.warm()
    solo = _solo_rate(0.3)
    salts = iter(range(1_000_000))

    def compile_three() -> None:
        for _ in range(3):
            guided.compiler.compile_uncached(guides(f"_gil{next(salts)}"))

    guide = guides("_gilmask")
    rows = [(RequestId(f"r{i}"), guide) for i in range(8)]
    logits = torch.zeros(len(rows), vocab_size)
    guided.mask(logits, rows)
    return [_measure("compile 3 new 40-tool grammars", compile_three, solo),
            _measure("200 mask steps x 8 rows", lambda: [guided.mask(logits, rows) for _ in range(200)], solo)]
