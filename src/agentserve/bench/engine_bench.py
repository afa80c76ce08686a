"""`agentserve bench engine`: our engine against transformers on the same weights and dtype,
measured side by side in one run.

Rows: prefill tokens/s on a 1,000-token prompt; decode tokens/s at batch 1; total decode
tokens/s with 8 concurrent requests (transformers runs them one at a time); and the machine's
measured matmul GFLOP/s in the dtype our engine computes in (fp32 for a bf16 model on a CPU
without a bf16 dot product: model/precision.py), whose prefill ceiling is GFLOP/s / (2 x
parameters). transformers runs in `dtype` as it is.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from agentserve.api import LLM
from agentserve.engine.request import SamplingParams
from agentserve.model.reference import HFReference, best_of, count_parameters, matmul_gflops


@dataclass(frozen=True, slots=True)
class BenchRow:
    metric: str
    agentserve: float
    transformers: float
    unit: str

    @property
    def ratio(self) -> float:
        return self.agentserve / self.transformers


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, min(vocab, 100_000)) for _ in range(n)]


def run_bench(model: str, dtype: str, cache_root, prompt_len: int = 1000, decode_tokens: int = 64,
              concurrency: int = 8, repeats: int = 2) -> list[BenchRow]:
    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=False, cache_root=cache_root)
    hf = HFReference(llm.model_dir, dtype)
    vocab = llm.model_config.vocab_size
    long_prompt = prompt_ids(vocab, prompt_len, 0)
    short = [prompt_ids(vocab, 32, s) for s in range(concurrency)]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    gen = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)

    def ours_prefill() -> float:
        return llm.generate([long_prompt], one)[0].latency_s

    def ours_decode(prompts: list[list[int]]) -> Callable[[], float]:
        def once() -> float:
            t = time.perf_counter()
            outs = llm.generate(prompts, gen)
            return (time.perf_counter() - t) - max(o.time_to_first_token_s or 0 for o in outs)
        return once

    hf_prefill = best_of(repeats, lambda: hf.prefill_s(long_prompt))
    our_prefill = best_of(repeats, ours_prefill)
    def hf_decode_s(prompt: list[int], tries: int) -> float:
        # decode time = generate(n) - prefill (generate(1)) on the same prompt, each the fastest
        # of its tries (the fastest of differences could pair a disturbed generate(1) with a
        # quiet generate(n) and come out below the decode time, or negative on a short run)
        return (best_of(tries, lambda: hf.generate_s(prompt, decode_tokens))
                - best_of(tries, lambda: hf.generate_s(prompt, 1)))

    hf_dec1 = hf_decode_s(short[0], repeats)
    our_dec1 = best_of(repeats, ours_decode(short[:1]))
    hf_seq = sum(hf_decode_s(p, 1) for p in short)
    our_conc = best_of(repeats, ours_decode(short))
    n_dec = decode_tokens - 1
    computed = str(llm.runner.model.compute_dtype).removeprefix("torch.")  # our ceiling: fp32 where bf16 widens
    gflops = matmul_gflops(computed)
    # Per prefill token the layers cost 2 FLOPs per weight; the embedding is a lookup and the
    # output projection runs once per sequence, so neither counts.
    embed = llm.model_config.vocab_size * llm.model_config.hidden_size
    params = count_parameters(hf) - embed * (1 if llm.model_config.tie_word_embeddings else 2)
    return [
        BenchRow(f"prefill tok/s ({prompt_len}-token prompt)", prompt_len / our_prefill, prompt_len / hf_prefill, "tok/s"),
        BenchRow("decode tok/s, batch 1", n_dec / our_dec1, n_dec / hf_dec1, "tok/s"),
        BenchRow(f"decode tok/s, {concurrency} requests (HF: one at a time)",
                 concurrency * n_dec / our_conc, concurrency * n_dec / hf_seq, "tok/s"),
        BenchRow(f"matmul GFLOP/s ({computed}); prefill ceiling = {gflops * 1e9 / (2 * params):.0f} tok/s",
                 gflops, gflops, "GFLOP/s"),
    ]


def rows_as_dicts(rows: list[BenchRow]) -> list[dict[str, object]]:
    return [dict(asdict(r), ratio=r.ratio) for r in rows]
