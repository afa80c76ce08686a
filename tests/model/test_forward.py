"""Our paged forward against transformers' forward on the same weights (tiny random models)."""

from __future__ import annotations

import pytest
import torch

from agentserve.model.transformer import ChunkLayout, PagedKV, Transformer
from tests.model.hf_tiny import model_config_of, tiny_hf_model, weights_of

ARCHS = ["qwen2", "llama", "qwen3"]
BLOCK = 4
# Same math in the same order; fp32 differences come from matmul shapes only.
TOL = {torch.float32: 1e-4, torch.bfloat16: 0.15}


def slots_for(block_ids: list[int], start: int, stop: int) -> torch.Tensor:
    pos = torch.arange(start, stop)
    return torch.tensor(block_ids)[pos // BLOCK] * BLOCK + pos % BLOCK


def run_chunk(model, kv, ids, start, block_ids):
    n = len(ids)
    ctx = slots_for(block_ids, 0, start + n)
    return model.forward(torch.tensor(ids), torch.arange(start, start + n), ctx[start:],
                         [ChunkLayout(0, n, start, ctx)], kv, torch.arange(n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_decode_and_cached_prefix_match_hf(arch, dtype):
    hf = tiny_hf_model(arch)
    cfg = model_config_of(hf, arch)
    model = Transformer(cfg, weights_of(hf, dtype))
    ids = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    ref_model = hf.to(dtype)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    blocks = [5, 2, 7, 0, 3, 6, 1, 4]  # a scattered block table
    tol = TOL[dtype]
    # prefill of the first 20 tokens in one chunk
    kv = PagedKV(cfg, 8, BLOCK, dtype, torch.device("cpu"))
    out = run_chunk(model, kv, ids[:20], 0, blocks)
    assert (out - ref[:20]).abs().max() < tol
    # decode the next 5 one at a time over the paged cache
    for p in range(20, 25):
        out = run_chunk(model, kv, ids[p : p + 1], p, blocks)
        assert (out[0] - ref[p]).abs().max() < tol
    # prefill the rest on top of the cached prefix (several rows, start > 0, partial block)
    out = run_chunk(model, kv, ids[25:], 25, blocks)
    assert (out - ref[25:]).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_long_chunk_over_a_cached_prefix_takes_the_split_path_and_matches_hf(arch, dtype):
    """A chunk of SPLIT_MIN_ROWS+ rows over a cached prefix: two flash calls merged by their
    log-sum-exps (no mask), against transformers' forward of the whole sequence; a short chunk
    after it stays on the masked path and matches too."""
    from agentserve.model.transformer import SPLIT_MIN_ROWS

    hf = tiny_hf_model(arch)
    cfg = model_config_of(hf, arch)
    model = Transformer(cfg, weights_of(hf, dtype))
    n_new = SPLIT_MIN_ROWS + 13
    ids = torch.randint(0, cfg.vocab_size, (37 + n_new + 5,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = hf.to(dtype)(torch.tensor([ids])).logits[0].float()
    blocks = torch.randperm(64, generator=torch.Generator().manual_seed(5)).tolist()  # scattered
    kv = PagedKV(cfg, 64, BLOCK, dtype, torch.device("cpu"))
    tol = TOL[dtype]
    run_chunk(model, kv, ids[:37], 0, blocks)  # the cached prefix (ends mid-block)
    long = ChunkLayout(0, n_new, 37, slots_for(blocks, 0, 37 + n_new))
    assert model._splits(long, torch.device("cpu"))
    out = run_chunk(model, kv, ids[37 : 37 + n_new], 37, blocks)
    assert (out - ref[37 : 37 + n_new]).abs().max() < tol
    short = ChunkLayout(0, 5, 37 + n_new, slots_for(blocks, 0, len(ids)))
    assert not model._splits(short, torch.device("cpu"))
    out = run_chunk(model, kv, ids[37 + n_new :], 37 + n_new, blocks)
    assert (out - ref[37 + n_new :]).abs().max() < tol


def test_split_attention_equals_fp64_softmax_over_the_union():
    """The merge itself, at grouped-query shapes, against a float64 masked softmax."""
    model = Transformer.__new__(Transformer)
    gen = torch.Generator().manual_seed(6)
    for heads, kv_heads, dim, rows, start in ((14, 2, 64, 64, 300), (8, 8, 32, 100, 1), (6, 2, 16, 200, 513)):
        model.config = type("Shape", (), {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": dim})()
        model.scale = dim ** -0.5
        k_cache, v_cache = torch.randn(1024, kv_heads, dim, generator=gen), torch.randn(1024, kv_heads, dim, generator=gen)
        slots = torch.randperm(1024, generator=gen)[: start + rows]
        q = torch.randn(rows, heads, dim, generator=gen)
        got = model._split_attention(q, ChunkLayout(0, rows, start, slots), k_cache, v_cache)
        keys = k_cache[slots].double().repeat_interleave(heads // kv_heads, 1)  # [ctx, heads, dim]
        values = v_cache[slots].double().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("rhd,chd->hrc", q.double(), keys) * model.scale
        hidden = torch.arange(start + rows)[None, :] > (torch.arange(rows)[:, None] + start)
        want = torch.einsum("hrc,chd->rhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), values)
        assert (got.double() - want).abs().max() < 1e-5, (heads, kv_heads, dim, rows, start)


def test_two_chunks_in_one_batch_do_not_interfere():
    hf = tiny_hf_model("qwen2")
    cfg = model_config_of(hf, "qwen2")
    model = Transformer(cfg, weights_of(hf, torch.float32))
    kv = PagedKV(cfg, 16, BLOCK, torch.float32, torch.device("cpu"))
    a = list(range(10, 19))  # 9 tokens, blocks 0..2
    b = list(range(40, 45))  # 5 tokens, blocks 8..9
    ctx_a, ctx_b = slots_for([0, 1, 2], 0, 9), slots_for([8, 9], 0, 5)
    out = model.forward(torch.tensor(a + b), torch.cat([torch.arange(9), torch.arange(5)]),
                        torch.cat([ctx_a, ctx_b]),
                        [ChunkLayout(0, 9, 0, ctx_a), ChunkLayout(9, 5, 0, ctx_b)], kv,
                        torch.tensor([8, 13]))
    with torch.no_grad():
        ra = hf(torch.tensor([a])).logits[0, -1]
        rb = hf(torch.tensor([b])).logits[0, -1]
    assert (out[0] - ra).abs().max() < 1e-4
    assert (out[1] - rb).abs().max() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_group_with_different_context_lengths_matches_hf(arch):
    """The batched decode path pads contexts to the longest; padding must be invisible."""
    from agentserve.model.runner import ModelRunner

    hf = tiny_hf_model(arch)
    cfg = model_config_of(hf, arch)
    model = Transformer(cfg, weights_of(hf, torch.float32))
    runner = ModelRunner(model, 16, BLOCK, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (7, 13, 4)]
    tables = [[9, 2, 14, 5], [0, 11, 3, 7], [12, 6]]
    for ids, blocks in zip(seqs, tables):  # prefill all but the last token
        run_chunk(model, runner.kv, ids[:-1], 0, blocks)
    contexts = [slots_for(blocks, 0, len(ids)) for ids, blocks in zip(seqs, tables)]
    group = runner._decode_group([0, 1, 2], contexts)
    assert group is not None and group.visible is not None
    out = model.forward(torch.tensor([ids[-1] for ids in seqs]), torch.tensor([len(ids) - 1 for ids in seqs]),
                        torch.stack([c[-1] for c in contexts]), [], runner.kv, torch.arange(3), group)
    for row, ids in enumerate(seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        assert (out[row] - ref).abs().max() < 1e-4
