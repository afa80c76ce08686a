"""Tool schemas at the door and forced-call grammars: compiled once, off the event loop and the
step thread, capped; any schema either compiles or is a 400 naming the tool, never a 500."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from agentserve.bench.tool_schemas import agent_tools
from agentserve.engine.request import RequestId
from agentserve.server.chat import _guide
from agentserve.server.errors import APIError
from agentserve.server.grammars import GrammarConfig, Grammars
from agentserve.server.protocol import ChatCompletionRequest, Tool
from tests.server.real_world_tools import real_world_tools
from tests.server.schema_strategy import tool_parameters

pytestmark = pytest.mark.slow
M = "smollm2-135m"


def tools_of(pairs) -> list[Tool]:
    return [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": p}}) for n, p in pairs]


def request(tools: list[Tool], choice="required") -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": M, "messages": [{"role": "user", "content": "go"}],
                                                 "tools": [t.model_dump() for t in tools], "tool_choice": choice})


@pytest.fixture
def grammars(smol_llm):
    def make(**config) -> Grammars:
        return Grammars(smol_llm.runner.guided.compiler, GrammarConfig(**config))
    return make


def prepare(g: Grammars, tools: list[Tool], choice="required") -> None:
    asyncio.run(g.prepare(tools, _guide(request(tools, choice)) if choice else None))


def test_every_agent_tool_compiles_and_is_checked_once(grammars, smol_llm):
    g, tools = grammars(), tools_of((t["function"]["name"], t["function"]["parameters"]) for t in agent_tools("_once"))
    compiler = smol_llm.runner.guided.compiler
    before = compiler.stats()
    start = time.perf_counter()
    prepare(g, tools)  # a forced call: its grammar's compile stands for the 40 checks
    first_s = time.perf_counter() - start
    mid = compiler.stats()
    assert (mid.num_checked - before.num_checked, mid.num_compiled - before.num_compiled) == (0, 1)
    start = time.perf_counter()
    prepare(g, tools)  # an agent's next turn: the same tools
    again_s = time.perf_counter() - start
    after = compiler.stats()
    assert (after.num_checked, after.num_compiled) == (mid.num_checked, mid.num_compiled)
    assert after.num_compile_hits == mid.num_compile_hits + 1
    assert again_s < first_s / 5, (first_s, again_s)
    prepare(g, tools, choice="auto")  # no grammar: each schema is checked, once
    prepare(g, tools, choice="auto")
    last = compiler.stats()
    assert last.num_checked - after.num_checked == 40 and last.num_check_hits - after.num_check_hits == 40


def test_a_forced_call_over_a_bad_schema_names_the_tool(grammars):
    bad = tools_of([("good", {"type": "object", "properties": {"a": {"type": "string"}}}),
                    ("broken", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})])
    with pytest.raises(APIError, match=r"tools\[1\]\.function\.parameters: function 'broken'") as err:
        prepare(grammars(), bad)
    assert err.value.param == "tools[1].function.parameters"


@pytest.mark.parametrize("name, params", real_world_tools(), ids=[n for n, _ in real_world_tools()])
def test_real_world_schemas_pass_the_door(grammars, name, params):
    prepare(grammars(), tools_of([(name, params)]), choice="auto")


ROOT_REFS = [(n, p) for n, p in real_world_tools() if "$defs" in p or "definitions" in p]


@pytest.mark.parametrize("name, params", ROOT_REFS, ids=[n for n, _ in ROOT_REFS])
def test_forced_calls_compile_for_schemas_with_root_refs(grammars, name, params):
    prepare(grammars(), tools_of([(name, params)]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(params=tool_parameters())
def test_any_valid_schema_compiles_or_is_a_400_naming_the_tool(grammars, smol_llm, params):
    g = grammars()
    tools = tools_of([("first", {"type": "object"}), ("fuzzed_tool", params)])
    guide = _guide(request(tools))
    try:
        asyncio.run(g.prepare(tools, guide))
    except APIError as exc:
        assert exc.status == 400, exc.message
        if exc.param == "tools[1].function.parameters":
            assert "'fuzzed_tool'" in exc.message
        else:
            assert exc.param == "tool_choice" and "'fuzzed_tool'" in exc.message, exc.message
        return
    guided = smol_llm.runner.guided  # compiled: a request can run on it
    logits = torch.zeros(1, guided.vocab_size)
    assert guided.mask(logits, [(RequestId("fuzz"), guide)]) == {}
    assert torch.isfinite(logits).any()
    guided.release([RequestId("fuzz")])


def test_tool_count_cap(grammars):
    with pytest.raises(APIError) as err:
        prepare(grammars(max_tools=3), tools_of([(f"t{i}", {"type": "object"}) for i in range(4)]), choice="auto")
    assert err.value.status == 400 and err.value.param == "tools" and "at most 3" in err.value.message


def test_compile_time_cap_is_a_400_naming_the_tool_and_never_blocks_the_loop(grammars, smol_llm, monkeypatch):
    compiler = smol_llm.runner.guided.compiler
    real = compiler.check_uncached

    def slow_for_one(guide):
        if "glacial" in guide.text:
            time.sleep(1.0)  # a compile that outruns the cap (the worker cannot be interrupted)
        return real(guide)

    monkeypatch.setattr(compiler, "check_uncached", slow_for_one)
    g = grammars(compile_timeout_s=0.2)
    tools = tools_of([("fine", {"type": "object"}),
                      ("slowpoke", {"type": "object", "properties": {"glacial": {"type": "string"}}})])

    async def go():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        start = time.perf_counter()
        with pytest.raises(APIError) as err:
            await g.prepare(tools, None)
        elapsed = time.perf_counter() - start
        t.cancel()
        return err.value, elapsed, ticks

    exc, elapsed, ticks = asyncio.run(go())
    assert exc.status == 400 and exc.param == "tools[1].function.parameters" and exc.code == "grammar_too_complex"
    assert "'slowpoke'" in exc.message and elapsed < 0.8
    assert ticks >= elapsed / 0.01 / 3  # the event loop kept running while the compile did
    time.sleep(1.0)
    prepare(g, tools, choice=None)  # it finished on its worker meanwhile: cached, accepted


def test_a_compiler_panic_is_a_400_and_the_server_keeps_serving(run_with_client, monkeypatch):
    class PanicException(BaseException):  # pyo3's, raised when llguidance's Rust code panics
        pass

    real = __import__("agentserve.model.grammar", fromlist=["grammar_text"]).grammar_text

    def panicky(guide):
        if "boom" in guide.text:
            raise PanicException("called `Option::unwrap()` on a `None` value")
        return real(guide)

    monkeypatch.setattr("agentserve.model.grammar.grammar_text", panicky)
    tool = {"type": "function", "function": {"name": "detonate", "parameters": {
        "type": "object", "properties": {"boom": {"type": "string"}}}}}

    async def go(c, state):
        body = {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [tool]}
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tools[0].function.parameters" and "'detonate'" in err["message"]
        assert "crashed" in err["message"]
        ok = await c.post("/v1/chat/completions", json={**body, "tools": []})
        assert ok.status_code == 200
    run_with_client(go)


@pytest.mark.parametrize("inline", [False, True])
def test_forced_call_over_forty_tools_compiles_off_the_step_thread(smol_llm, inline):
    """Worker mode: the step thread never compiles. Inline (the old behaviour): it does."""
    from tests.server.conftest import client_for

    tools = agent_tools(f"_route{int(inline)}")
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    compiler = smol_llm.runner.guided.compiler

    async def go():
        async with client_for(smol_llm) as (c, state):
            state.grammar_config = GrammarConfig(inline=inline)
            before = compiler.stats().num_step_thread_compiles
            body = {"model": M, "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
                    "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
                    "max_tokens": 120, "temperature": 0}
            r = (await c.post("/v1/chat/completions", json=body)).json()
            return r, compiler.stats().num_step_thread_compiles - before

    r, step_thread_compiles = asyncio.run(go())
    assert step_thread_compiles == (1 if inline else 0)
    # (SmolLM2's greedy call may run past max_tokens; test_forced_calls.py validates calls)
    if r["choices"][0]["finish_reason"] == "tool_calls":
        (call,) = r["choices"][0]["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), by_name[call["function"]["name"]])
    else:
        assert r["choices"][0]["finish_reason"] == "length", r


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread scheduling is Linux's")
def test_a_compile_that_runs_long_at_sched_idle_is_promoted_and_a_quick_one_is_not(grammars, smol_llm, monkeypatch):
    compiler = smol_llm.runner.guided.compiler
    real = compiler.check_uncached
    seen: dict[str, list[int]] = {}

    def timed(guide):
        key = "slow" if "sluggish" in guide.text else "quick"
        seen.setdefault(key, []).append(os.sched_getscheduler(0))
        if key == "slow":
            time.sleep(0.6)  # stands for a compile starved on a busy machine
        seen[key].append(os.sched_getscheduler(0))
        return real(guide)

    monkeypatch.setattr(compiler, "check_uncached", timed)
    g = grammars(promote_after_s=0.2)
    if not g.priority.idle:
        pytest.skip("this process may not leave SCHED_IDLE")
    prepare(g, tools_of([("quick", {"type": "object", "properties": {"brisk": {"type": "string"}}})]), choice=None)
    assert seen["quick"] == [os.SCHED_IDLE, os.SCHED_IDLE] and g.priority.num_promoted == 0
    prepare(g, tools_of([("slow", {"type": "object", "properties": {"sluggish": {"type": "string"}}})]), choice=None)
    assert seen["slow"] == [os.SCHED_IDLE, os.SCHED_OTHER] and g.priority.num_promoted == 1
