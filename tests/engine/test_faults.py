"""A fault in one request ends that request alone; the others in the batch are unaffected."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from agentserve.config import SchedulerConfig
from agentserve.engine.engine import Engine, RunResult
from agentserve.engine.request import FinishReason, RequestId, SamplingParams
from agentserve.engine.scheduler import Batch, Scheduler
from agentserve.kv.block_pool import BlockPool

VOCAB = 1000


class Runner:
    """Samples (last token + 1) % VOCAB; fails `bad`'s row at its `fail_at`-th output."""

    def __init__(self, bad: set[str] = frozenset(), fail_at: int = 2) -> None:
        self.bad, self.fail_at = bad, fail_at

    def run(self, batch: Batch) -> RunResult:
        sampled, failed = {}, {}
        for c in batch.chunks:
            if not c.sample:
                continue
            if c.request_id in self.bad and c.output_index >= self.fail_at:
                failed[c.request_id] = "injected"
            else:
                sampled[c.request_id] = (c.token_ids[-1] + 1) % VOCAB
        return RunResult(sampled, failed)


class Letters:
    """Token t decodes to chr(97 + t % 26); raises on `poison`."""

    def __init__(self, poison: int | None = None) -> None:
        self.poison = poison

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.poison in token_ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return "".join(chr(97 + t % 26) for t in token_ids)


def engine(runner: Runner, detokenizer: Letters | None = None) -> Engine:
    cfg = SchedulerConfig(max_model_len=256, block_size=4, max_num_batched_tokens=32)
    return Engine(Scheduler(cfg, BlockPool(64, 4)), runner, "fake", VOCAB, detokenizer=detokenizer)


def drain(e: Engine) -> dict[RequestId, list]:
    outs: dict[RequestId, list] = {}
    while e.has_unfinished():
        for o in e.step():
            outs.setdefault(o.request_id, []).append(o)
        e.scheduler.pool.check()
    return outs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24], [30] * 9]


def test_a_request_whose_row_fails_ends_alone_with_its_error():
    clean = engine(Runner())
    ids = [clean.add(p, SamplingParams(max_tokens=8)) for p in PROMPTS]
    reference = drain(clean)
    faulty = engine(Runner(bad={"req-1"}))
    ids = [faulty.add(p, SamplingParams(max_tokens=8)) for p in PROMPTS]
    outs = drain(faulty)
    last = outs[ids[1]][-1]
    assert last.finished and last.finish_reason is FinishReason.ERROR and last.error == "injected"
    assert len(tokens(outs[ids[1]])) == 2
    for rid in (ids[0], ids[2]):
        assert tokens(outs[rid]) == tokens(reference[rid])
        assert outs[rid][-1].finish_reason is FinishReason.LENGTH
    assert faulty.scheduler.pool.stats().num_used == 0


def test_a_stop_string_check_that_raises_fails_its_request_only():
    e = engine(Runner(), Letters(poison=14))  # b reaches token 14 at its 8th output, a never
    a = e.add([100, 101], SamplingParams(max_tokens=6, stop=("zz",)))
    b = e.add([5, 6], SamplingParams(max_tokens=12, stop=("zz",)))
    outs = drain(e)
    assert outs[a][-1].finish_reason is FinishReason.LENGTH and len(tokens(outs[a])) == 6
    assert outs[b][-1].finish_reason is FinishReason.ERROR
    assert "stop-string check failed" in outs[b][-1].error


@pytest.mark.parametrize("stop", ["lmn", "n", "lmnopq", "mnopq"])
def test_stop_strings_found_incrementally_across_tokens(stop):
    e = engine(Runner(), Letters())
    rid = e.add([10], SamplingParams(max_tokens=20, stop=(stop, "zzz")))  # outputs l, m, n, ...
    out = drain(e)[rid]
    text = "".join(chr(97 + t % 26) for t in tokens(out))
    assert out[-1].finish_reason is FinishReason.STOP and out[-1].matched_stop == stop
    assert text.endswith(stop) and text.find(stop) == len(text) - len(stop)


def test_an_exception_escaping_the_runner_escapes_step():
    class Broken:
        def run(self, batch: Batch) -> RunResult:
            raise RuntimeError("device lost")

    e = engine(Broken())  # type: ignore[arg-type]
    e.add([1, 2, 3], SamplingParams())
    with pytest.raises(RuntimeError, match="device lost"):
        e.step()
