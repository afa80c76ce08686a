"""End to end on the real SmolLM2-135M: logits against transformers, and a 4-turn agent session
whose every turn reuses exactly the full blocks of the previous turn's prompt + reply."""

from __future__ import annotations

import pytest
import torch
import transformers

from agentserve.api import LLM
from agentserve.engine.request import FinishReason, SamplingParams
from agentserve.model.loader import load_model_config, load_weights
from agentserve.model.transformer import ChunkLayout, PagedKV, Transformer

pytestmark = pytest.mark.slow
BS = 16


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", dtype="float32", num_kv_blocks=256)


def test_logits_match_transformers(llm):
    cfg = load_model_config(llm.model_dir)
    ours = Transformer(cfg, load_weights(llm.model_dir, torch.float32))
    hf = transformers.AutoModelForCausalLM.from_pretrained(llm.model_dir, dtype=torch.float32).eval()
    ids = llm.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return", add_special_tokens=False)
    ids = (ids * 3)[:40]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    kv = PagedKV(cfg, 4, BS, torch.float32, torch.device("cpu"))
    blocks = torch.tensor([3, 0, 2])
    def slots(a, b):
        p = torch.arange(a, b)
        return blocks[p // BS] * BS + p % BS
    def chunk(a, b):
        ctx = slots(0, b)
        return ours.forward(torch.tensor(ids[a:b]), torch.arange(a, b), ctx[a:], [ChunkLayout(0, b - a, a, ctx)], kv, torch.arange(b - a))
    tol = 2e-3  # fp32, 30 layers; observed ~1e-4
    assert (chunk(0, 20) - ref[:20]).abs().max() < tol  # prefill
    assert (chunk(20, 21) - ref[20:21]).abs().max() < tol  # decode
    assert (chunk(21, 40) - ref[21:40]).abs().max() < tol  # prefill on a cached prefix


def test_four_turn_agent_session_reuses_previous_turn_exactly(llm):
    tok = llm.tokenizer
    sampling = SamplingParams(temperature=0.0, max_tokens=20)
    prompt = tok.apply_chat_template([{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "List the files in src/."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = list(prompt)
    previous_full: list[int] | None = None
    for turn in range(4):
        (out,) = llm.generate([prompt], sampling)
        if previous_full is None:
            assert out.num_reused_tokens == 0
        else:
            # the last reply token was sampled, never computed: its KV does not exist yet
            computed = len(previous_full) - 1
            assert out.num_reused_tokens == computed // BS * BS
            assert out.num_prefilled_tokens == len(prompt) - out.num_reused_tokens
        previous_full = list(out.prompt_token_ids) + list(out.token_ids)
        result = f"<tool_response>\nsrc/a{turn}.py\nsrc/b{turn}.py\n</tool_response>"
        piece = tok.encode(f"<|im_end|>\n<|im_start|>user\n{result}<|im_end|>\n<|im_start|>assistant\n",
                           add_special_tokens=False)
        prompt = previous_full + piece
    llm.engine.scheduler.pool.check()


def test_stop_strings_and_min_tokens_on_real_tokenizer(llm):
    (out,) = llm.generate(["1, 2, 3, 4, 5,"], SamplingParams(temperature=0.0, max_tokens=30, stop=(" 9",)))
    assert out.finish_reason is FinishReason.STOP
    assert " 9" not in out.text and out.text.startswith(" 6, 7, 8,")
    (out,) = llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8))
    assert out.num_generated_tokens == 8


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=10, seed=7)
    (a,) = llm.generate(["Once upon a time"], sp)
    b = llm.generate(["Once upon a time", "The weather today", "import numpy"], sp)[0]
    assert a.token_ids == b.token_ids


def test_bad_input_leaves_engine_serving(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 49152]], SamplingParams(max_tokens=2))
    context = llm.scheduler_config.max_model_len  # the model's 8192, or what the pool holds
    with pytest.raises(ValueError, match=f"context is {context}"):
        llm.generate([[1] * (context + 10)], SamplingParams(max_tokens=2))
    (out,) = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=3))
    assert out.num_generated_tokens == 3
    assert not llm.engine.has_unfinished()
