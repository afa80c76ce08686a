"""Grammar compilation and guided masks: the LRU of compile jobs, template copies, per-request
failures, the GIL, and masks checked against llguidance's own per-token logit bias."""

from __future__ import annotations

import json
import threading
import time

import llguidance
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.bench.tool_schemas import agent_tools
from agentserve.engine.request import Guide, RequestId
from agentserve.model.grammar import OnceCache
from agentserve.model.guided import GuidedDecoding, apply_bitmask

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"], "additionalProperties": False}


@pytest.fixture(scope="module")
def guided(smollm2_dir) -> GuidedDecoding:
    from agentserve.model.loader import load_model_config, load_tokenizer

    g = GuidedDecoding(load_tokenizer(smollm2_dir), load_model_config(smollm2_dir).vocab_size, cache_capacity=8)
    g.warm()
    return g


def schema(s: dict) -> Guide:
    return Guide.json_schema(json.dumps(s))


def forty_tools_guide(salt: str) -> Guide:
    return schema({"anyOf": [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                              "properties": {"name": {"const": t["function"]["name"]},
                                             "arguments": t["function"]["parameters"]}}
                             for t in agent_tools(salt)]})


def test_once_cache_evicts_least_recently_used_finished_entries():
    cache: OnceCache[str, int] = OnceCache(2)
    calls: list[str] = []

    def value(key: str):
        return lambda: calls.append(key) or len(calls)

    for key in ("a", "b", "a", "c"):  # "a" used again, so "b" is the one evicted
        cache.get(key, value(key))
    assert calls == ["a", "b", "c"] and len(cache) == 2
    cache.get("b", value("b"))
    assert calls == ["a", "b", "c", "b"]  # recomputed: it was evicted
    assert (cache.num_hits, cache.num_misses) == (1, 4)
    pending: list = []
    for key in ("x", "y", "z"):  # never run: still computing, so never evicted
        cache.get(key, value(key), submit=pending.append)
    assert len(cache) == 3 and len(pending) == 3  # over capacity: the finished ones went first
    assert all(not new for _, new in (cache.get(k, value(k)) for k in ("x", "y", "z")))


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 5),
       ops=st.lists(st.tuples(st.sampled_from(["get", "get_pending", "finish"]), st.integers(0, 9)), max_size=60))
def test_once_cache_matches_a_naive_lru(capacity: int, ops: list[tuple[str, int]]):
    """Against a naive model: keys in use order; after a miss, the least recently used
    finished keys go until at most `capacity` remain or only computing ones are left over."""
    cache: OnceCache[int, int] = OnceCache(capacity)
    pending: dict[int, object] = {}
    order: list[int] = []  # the model, least recently used first
    done: set[int] = set()
    for op, key in ops:
        if op == "finish":
            if pending:
                k = sorted(pending)[key % len(pending)]
                pending.pop(k)()  # type: ignore[operator]
                done.add(k)
            continue
        _, new = cache.get(key, lambda: 0, submit=(lambda fn, k=key: pending.__setitem__(k, fn))
                           if op == "get_pending" else None)
        assert new == (key not in order)
        if key in order:
            order.remove(key)
        else:
            done.add(key) if op == "get" else None
            excess = len(order) + 1 - capacity
            for k in [k for k in order if k in done][:max(0, excess)]:
                order.remove(k)
                done.discard(k)
        order.append(key)
        assert list(cache._jobs) == order


def test_once_cache_shares_one_computation_between_concurrent_askers():
    cache: OnceCache[str, int] = OnceCache(4)
    gate = threading.Event()
    runs: list[int] = []

    def slow() -> int:
        gate.wait(5)
        runs.append(1)
        return 7

    threads = [threading.Thread(target=lambda: cache.get("k", slow, submit=lambda fn: threading.Thread(target=fn).start()))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    job, new = cache.get("k", slow)
    gate.set()
    assert not new and job.result.result(timeout=5) == 7 and runs == [1]


def allowed_by_llguidance(tokenizer: llguidance.LLTokenizer, guide: Guide, tokens: list[int], vocab: int
                          ) -> torch.Tensor:
    """Reference: a fresh matcher, advanced token by token, asked for its logit bias."""
    from agentserve.model.grammar import grammar_text

    matcher = llguidance.LLMatcher(tokenizer, grammar_text(guide), log_level=0)
    assert matcher.consume_tokens(tokens) if tokens else True
    bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
    out = torch.zeros(vocab, dtype=torch.bool)
    out[: len(bias)] = bias > 0
    return out


def test_masks_match_llguidance_and_rows_stay_independent(guided):
    vocab = guided.vocab_size
    weather, tools = schema(WEATHER), forty_tools_guide("_m")
    # rows: unguided, weather, unguided, forty tools, weather again (a second copy of one template)
    rows = [(RequestId("u0"), None), (RequestId("w1"), weather), (RequestId("u2"), None),
            (RequestId("t3"), tools), (RequestId("w4"), weather)]
    prefix = guided._hf_tokenizer.encode('{"city": "Par', add_special_tokens=False)
    steps = {RequestId("w1"): prefix, RequestId("w4"): [], RequestId("t3"): []}
    for rid, toks in steps.items():
        logits = torch.zeros(len(rows), vocab)
        assert guided.mask(logits, rows) == {}
        assert all(guided.accept(rid, t) is None for t in toks)
    logits = torch.randn(len(rows), vocab)
    before = logits.clone()
    assert guided.mask(logits, rows) == {}
    for i, (rid, guide) in enumerate(rows):
        if guide is None:
            assert torch.equal(logits[i], before[i])
            continue
        expected = allowed_by_llguidance(guided.tokenizer(), guide, steps[rid], vocab)
        assert torch.equal(torch.isfinite(logits[i]), expected), rid
        assert torch.equal(logits[i][expected], before[i][expected])
    guided.release([r for r, _ in rows])


def test_a_failing_grammar_fails_only_its_request(guided):
    good, bad = schema(WEATHER), schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    rows = [(RequestId("good"), good), (RequestId("bad"), bad)]
    logits = torch.zeros(2, guided.vocab_size)
    failures = guided.mask(logits, rows)
    assert list(failures) == ["bad"] and "nowhere" in failures["bad"]
    assert torch.isinf(logits[0]).any() and not torch.isinf(logits[1]).any()  # the bad row left unmasked
    digit = guided._hf_tokenizer.encode("7", add_special_tokens=False)[0]  # a weather call starts with "{"
    brace = guided._hf_tokenizer.encode("{", add_special_tokens=False)[0]
    rows2 = [(RequestId("good"), good), (RequestId("other"), good)]
    guided.mask(torch.zeros(2, guided.vocab_size), rows2)
    assert guided.accept(RequestId("good"), brace) is None
    assert guided.accept(RequestId("other"), digit).startswith("constrained decoding failed: ")
    assert guided.mask(torch.zeros(1, guided.vocab_size), [(RequestId("good"), good)]) == {}
    guided.release(["good", "bad", "other"])


def test_step_thread_copies_prepared_templates(guided):
    guide = forty_tools_guide("_prepared")
    before = guided.compiler.stats()
    job, new = guided.compiler.compile(guide, submit=lambda fn: threading.Thread(target=fn).start())
    compiled = job.result.result(timeout=60)
    assert new and compiled.error is None and compiled.matcher is not None
    guided.mask(torch.zeros(1, guided.vocab_size), [(RequestId("p"), guide)])
    after = guided.compiler.stats()
    assert after.num_step_thread_compiles == before.num_step_thread_compiles
    assert after.num_compile_hits == before.num_compile_hits + 1
    unprepared = forty_tools_guide("_unprepared")
    guided.mask(torch.zeros(1, guided.vocab_size), [(RequestId("q"), unprepared)])
    assert guided.compiler.stats().num_step_thread_compiles == before.num_step_thread_compiles + 1
    guided.release(["p", "q"])


def test_compile_errors_and_panics_are_values(guided, monkeypatch):
    compiler = guided.compiler
    assert compiler.check_uncached(schema({"type": "object", "properties": {"a": {"type": "strin"}}})).error
    lenient = compiler.check_uncached(schema({"type": "object", "properties": {"a": {"type": "array",
                                                                                    "uniqueItems": True}}}))
    assert lenient.error is None and any("uniqueItems" in w for w in lenient.warnings)

    class PanicException(BaseException):  # what pyo3 raises when Rust code panics
        pass

    def panic(guide):
        raise PanicException("index out of bounds")

    monkeypatch.setattr("agentserve.model.grammar.grammar_text", panic)
    assert "crashed: index out of bounds" in compiler.check_uncached(schema(WEATHER)).error
    assert "crashed" in compiler.compile_uncached(schema(WEATHER)).error

    def interrupt(guide):
        raise KeyboardInterrupt

    monkeypatch.setattr("agentserve.model.grammar.grammar_text", interrupt)
    with pytest.raises(KeyboardInterrupt):  # only panics are caught, not every BaseException
        compiler.check_uncached(schema(WEATHER))


def test_compiling_releases_the_gil(guided):
    """The design rests on this: a compile on a worker must not stop the step thread's Python.
    Were the GIL held through a compile, this loop would stall for a whole compile each time."""
    done = threading.Event()
    compile_s: list[float] = []

    def compile_many():
        for k in range(3):
            compile_s.append(guided.compiler.compile_uncached(forty_tools_guide(f"_gil{k}")).compile_s)
        done.set()

    gaps, last = [], time.perf_counter()
    worker = threading.Thread(target=compile_many)
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    third_longest = sorted(gaps)[-3]  # robust to an OS hiccup or two on a loaded machine
    assert third_longest < 0.5 * min(compile_s), (third_longest, compile_s)


def test_apply_bitmask_masks_ids_past_the_tokenizer_table():
    logits = torch.zeros(3, 70)
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)  # 64 ids allowed, ids 64..69 not covered
    bitmask[0, 0] = 0b101
    apply_bitmask(logits, [1], bitmask)
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 2, *range(32, 64)]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()

