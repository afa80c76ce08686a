"""The C++ decode attention against an fp64 reference and against the torch path it replaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from agentserve.model import cpu_kernels
from agentserve.model.runner import ModelRunner
from agentserve.model.transformer import Transformer
from tests.model.hf_tiny import model_config_of, tiny_hf_model, weights_of


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels.load_cpu_kernels()
    if k is None:
        pytest.skip("the C++ kernels could not be built here (see the logged reason); torch path only")
    return k


def reference(q, k_cache, v_cache, slots, lengths, scale):
    """Plain fp64 attention, one (sequence, head) at a time."""
    b, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    out = torch.empty(b, heads, dim, dtype=torch.float64)
    for i in range(b):
        ctx = slots[i, : lengths[i]]
        keys, values = k_cache[ctx].double(), v_cache[ctx].double()
        for h in range(heads):
            w = torch.softmax(keys[:, h // group] @ q[i, h].double() * scale, dim=0)
            out[i, h] = w @ values[:, h // group]
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("dim", [16, 32, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (14, 2), (9, 3), (4, 4)])
def test_kernel_matches_fp64_reference(kernels, dtype, tol, dim, heads, kv_heads):
    gen = torch.Generator().manual_seed(dim * 100 + heads)
    num_slots, longest = 4096, 300  # longer than a 128-key tile: the online softmax rescales
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    lengths = torch.tensor([longest, 1, 129, 77])
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:longest] for _ in lengths])  # scattered
    q = (3 * torch.randn(len(lengths), heads, dim, generator=gen)).to(dtype)  # peaked softmax
    out = kernels.decode_attention(q, k_cache, v_cache, slots, lengths, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.double() - reference(q, k_cache, v_cache, slots, lengths, dim**-0.5)).abs().max() < tol


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("lengths", [[2000, 3, 1500, 1, 2500], [1], [1, 1, 1, 4000], [700, 700, 700, 700, 9]])
def test_threads_split_by_keys_cover_every_sequence(kernels, threads, lengths):
    """Tasks go to threads in runs of about equal keys, not of equal count: with long and short
    sequences mixed, and more threads than tasks, every (sequence, head) is still computed once."""
    gen = torch.Generator().manual_seed(len(lengths) * 31 + threads)
    num_slots, kv_heads, heads, dim = 8192, 3, 9, 64
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=gen)
    lens = torch.tensor(lengths)
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[: max(lengths)] for _ in lengths])
    q = 3 * torch.randn(len(lengths), heads, dim, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.decode_attention(q, k_cache, v_cache, slots, lens, dim**-0.5)
    finally:
        torch.set_num_threads(before)
    # (fp32 sums over up to 4k keys: a task never computed would be off by O(1))
    assert (out.double() - reference(q, k_cache, v_cache, slots, lens, dim**-0.5)).abs().max() < 1e-5


def test_bf16_decode_is_as_close_to_fp64_as_torch_sdpa(kernels):
    """bf16 decode goes through the prefill micro kernel (probabilities rounded to bf16 for
    PV, as torch's flash kernel does): its mean error from fp64 may not exceed SDPA's on the
    same inputs by more than 10%."""
    if not kernels.bf16_prefill:
        pytest.skip("no AVX512-BF16 here: bf16 decode stays on the fp32 loop")
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, num_slots = 14, 2, 64, 4096
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=gen).bfloat16()
    lengths = torch.tensor([700, 1, 129, 300, 255])
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:700] for _ in lengths])
    q = (3 * torch.randn(len(lengths), heads, dim, generator=gen)).bfloat16()
    exact = reference(q, k_cache, v_cache, slots, lengths, dim**-0.5)
    ours = float((kernels.decode_attention(q, k_cache, v_cache, slots, lengths, dim**-0.5).double() - exact).abs().mean())
    theirs = 0.0
    for i, n in enumerate(lengths.tolist()):
        keys = k_cache[slots[i, :n]].transpose(0, 1)[None]  # [1, kv_heads, n, dim]
        values = v_cache[slots[i, :n]].transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q[i].view(1, kv_heads, heads // kv_heads, dim), keys, values,
                                             scale=dim**-0.5).reshape(heads, dim)
        theirs += float((out.double() - exact[i]).abs().mean()) / len(lengths)
    assert ours <= 1.1 * theirs, (ours, theirs)


def test_kernel_rejects_what_it_was_not_built_for(kernels):
    q = torch.randn(1, 4, 24)  # head_dim 24 is not compiled in
    cache = torch.randn(8, 2, 24)
    with pytest.raises(RuntimeError, match="head_dim 24"):
        kernels.decode_attention(q, cache, cache, torch.zeros(1, 8, dtype=torch.int64), torch.tensor([8]), 1.0)
    assert not kernels.supports(24) and kernels.supports(64)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_model_decode_with_kernel_equals_torch_path(kernels, arch):
    hf = tiny_hf_model(arch)
    cfg = model_config_of(hf, arch)
    weights = weights_of(hf, torch.float32)
    with_kernel, without = Transformer(cfg, weights, kernels=kernels), Transformer(cfg, weights)
    runner = ModelRunner(without, 32, 4, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    lengths = [9, 30, 2]
    slots = [torch.randperm(128, generator=gen)[:n] for n in lengths]
    for layer in range(cfg.num_layers):  # any cache contents will do: both paths read the same
        runner.kv.k[layer].normal_(generator=gen)
        runner.kv.v[layer].normal_(generator=gen)
    group = runner._decode_group([0, 1, 2], slots)
    ids, pos = torch.tensor([3, 4, 5]), torch.tensor([n - 1 for n in lengths])
    write = torch.stack([s[-1] for s in slots])
    a = with_kernel.forward(ids, pos, write, [], runner.kv, torch.arange(3), group)
    b = without.forward(ids, pos, write, [], runner.kv, torch.arange(3), group)
    assert (a - b).abs().max() < 1e-5


def test_kernels_can_be_turned_off(kernels, smollm2_dir):
    from agentserve.config import CacheConfig
    from agentserve.model.build import build_runner
    from agentserve.model.loader import load_model_config

    config, cache = load_model_config(smollm2_dir), CacheConfig(block_size=16, num_blocks=8)
    on = build_runner(smollm2_dir, config, "float32", "cpu", cache, 0)
    off = build_runner(smollm2_dir, config, "float32", "cpu", cache, 0, cpu_kernels=False)
    assert on.runner.model.kernels is not None and off.runner.model.kernels is None


def test_the_pinned_ninja_is_found_without_an_activated_venv(tmp_path):
    import ninja

    assert cpu_kernels.path_with_ninja(str(tmp_path)).split(os.pathsep)[0] == ninja.BIN_DIR
    (tmp_path / "ninja").write_text("#!/bin/sh\n")
    (tmp_path / "ninja").chmod(0o755)
    assert cpu_kernels.path_with_ninja(str(tmp_path)) == str(tmp_path)  # one already on PATH wins


def test_a_build_killed_half_way_does_not_wedge_the_next_start(kernels, caplog):
    """torch's builder leaves its lock file behind when killed; the next load must not wait on
    it forever (it did: a harness that stopped a server mid-build wedged every later start)."""
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    name = kernels.module.__name__
    stale = os.path.join(_get_build_directory(name, verbose=False), "lock")
    open(stale, "w").close()
    code = "from agentserve.model.cpu_kernels import load_cpu_kernels; assert load_cpu_kernels() is not None"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not os.path.exists(stale) and "left by a build that was killed" in done.stderr


PIN_SCRIPT = """
import json, os, torch
from agentserve.model.cpu_kernels import load_cpu_kernels
kernels = load_cpu_kernels()
cpus = sorted(os.sched_getaffinity(0))[:2]
torch.set_num_threads(2)
first = kernels.bind_threads(cpus)
after_first = [sorted(os.sched_getaffinity(t)) for t in first] if -1 not in first else None
x = torch.randn(512, 512)
for _ in range(20):
    x = torch.tanh(x @ x / 512)  # torch's own parallel ops run on the same team
again = kernels.bind_threads(list(reversed(cpus)))
print(json.dumps({"pid": os.getpid(), "first": first, "again": again, "cpus": cpus,
                  "after_first": after_first,
                  "now": [sorted(os.sched_getaffinity(t)) for t in again] if -1 not in again else None}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="per-thread affinity on Linux, two CPUs")
def test_bind_threads_pins_the_team_torch_runs_its_ops_on(kernels):
    # In a child process: pinning this one's main thread would narrow every test after it.
    out = subprocess.run([sys.executable, "-c", PIN_SCRIPT], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    a, b = r["cpus"]
    assert r["first"][0] == r["pid"]  # member 0 is the calling (main) thread
    assert r["after_first"] == [[a], [b]]
    # the same two threads after torch's own parallel ops: the pool keeps its members
    assert r["again"] == r["first"] and r["now"] == [[b], [a]]
