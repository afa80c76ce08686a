"""A KV pool smaller than the model's context: max_model_len is lowered to what the pool holds
(logged, and shown in /v1/models), and every request finishes — alone, or several at once
outgrowing the pool together (they preempt one another instead of waiting forever)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agentserve.api import LLM
from agentserve.engine.request import FinishReason, SamplingParams
from tests.server.conftest import client_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_llm():
    return LLM("smollm2-135m", dtype="float32", num_kv_blocks=8)  # 8 blocks of 16: 128 tokens


def test_max_model_len_is_lowered_to_the_pool_and_said(caplog):
    with caplog.at_level(logging.WARNING, logger="agentserve.api"):
        llm = LLM("smollm2-135m", dtype="float32", num_kv_blocks=8)
    assert llm.scheduler_config.max_model_len == 128
    assert "max_model_len lowered from 8192 to 128" in caplog.text
    assert llm.max_model_len_note and "8192" in llm.max_model_len_note


def test_generate_outgrowing_the_pool_together_finishes(small_llm):
    prompts = [f"Tell me about the number {i}." for i in range(4)]
    outs = small_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    for o in outs:
        assert o.finish_reason is FinishReason.LENGTH and o.num_prompt_tokens + o.num_generated_tokens == 128
    alone = small_llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    assert alone[0].token_ids == outs[0].token_ids  # preemption and recompute change nothing
    assert sum(o.num_recomputed_tokens for o in outs) > 0  # they did preempt one another


def test_server_on_a_small_pool_says_so_and_serves_default_max_tokens(small_llm):
    async def go():
        async with client_for(small_llm) as (c, state):
            card = (await c.get("/v1/models")).json()["data"][0]
            assert card["max_model_len"] == 128 and "lowered from 8192 to 128" in card["max_model_len_note"]
            body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Count slowly."}],
                    "temperature": 0, "ignore_eos": True}  # max_tokens: the rest of the context
            before = small_llm.ledger.totals.recomputed, small_llm.ledger.totals.prompt
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(3)))
            for r in rs:
                assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
                assert r.json()["usage"]["total_tokens"] == 128
            # they preempted one another: the ledger's recompute equals the responses' exactly
            usages = [r.json()["usage"] for r in rs]
            recomputed = sum(u["agentserve"]["recomputed_tokens"] for u in usages)
            assert recomputed > 0
            assert small_llm.ledger.totals.recomputed - before[0] == recomputed
            assert small_llm.ledger.totals.prompt - before[1] == sum(u["prompt_tokens"] for u in usages)
    asyncio.run(go())
