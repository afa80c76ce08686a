"""Named cost models: roofline presets for data-centre GPUs serving 8B and 32B models, and a
linear fit to our own CPU engine from `agentserve bench engine --json`.

GPU numbers are datasheet peaks (dense bf16 FLOP/s, HBM bytes/s, capacity); mfu/mbu are the
fractions a serving engine typically reaches. Models: Llama-3.1-8B (32 layers, 32x128 query,
8 KV heads x 128: 128 KiB KV per token) and Qwen2.5-32B (64 layers, 40x128 query, 8 KV heads x
128: 256 KiB per token), bf16 weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from agentserve.sim.cost import CostModel, Linear, Roofline

_GPUS = {  # peak dense bf16 FLOP/s, HBM bytes/s, HBM bytes
    "h100": (989e12, 3.35e12, 80e9),
    "h200": (989e12, 4.8e12, 141e9),
}
_MODELS = {  # params (B), layers, q_dim, KV bytes per token, weight bytes
    "llama3-8b": (8.03, 32, 4096, 2 * 32 * 8 * 128 * 2, 16.06e9),
    "qwen2.5-32b": (32.76, 64, 5120, 2 * 64 * 8 * 128 * 2, 65.5e9),
}

# `agentserve bench engine --json` on this project's CPU machine (2 shared cores,
# qwen2.5-coder-0.5b, bf16, 2026-11-30, other load present); refit with `fit_engine_bench(rows)`.
CPU_QWEN05_BENCH: tuple[dict[str, object], ...] = (
    {'metric': 'prefill tok/s (1000-token prompt)', 'agentserve': 74.19},
    {'metric': 'decode tok/s, batch 1', 'agentserve': 11.156},
    {'metric': 'decode tok/s, 8 requests (HF: one at a time)', 'agentserve': 12.233},
    {'metric': 'matmul GFLOP/s (bfloat16); prefill ceiling = 540 tok/s', 'agentserve': 386.235},
)


def roofline(gpu: str, model: str) -> Roofline:
    flops, bw, hbm = _GPUS[gpu]
    params, layers, q_dim, kv, weights = _MODELS[model]
    return Roofline(f"{gpu}-{model}", params, layers, q_dim, kv, weights, flops, bw, hbm)


def fit_engine_bench(rows: list[Mapping[str, object]], num_layers: int = 24, q_dim: int = 896,
                     name: str = "cpu-qwen2.5-coder-0.5b") -> Linear:
    """Fit a Linear model to `bench engine` rows: decode at batch 1 and 8 give the per-step
    overhead and per-decode cost, the measured matmul GFLOP/s the attention cost, and the
    1,000-token prefill the per-prefill-token cost."""
    by = {str(r["metric"]).split(" (")[0].split(",")[0]: r for r in rows}
    try:
        prefill = next(r for r in rows if str(r["metric"]).startswith("prefill"))
        dec1 = next(r for r in rows if "batch 1" in str(r["metric"]))
        dec8 = next(r for r in rows if "requests" in str(r["metric"]) and str(r["metric"]).startswith("decode"))
        gemm = next(r for r in rows if str(r["metric"]).startswith("matmul"))
    except StopIteration:
        raise ValueError(f"engine bench rows lack prefill/decode/matmul metrics: {sorted(by)}") from None
    n_prompt = int(str(prefill["metric"]).split("(")[1].split("-")[0])
    batch = int(str(dec8["metric"]).split(", ")[1].split(" ")[0])
    t1 = 1 / float(dec1["agentserve"])
    tb = batch / float(dec8["agentserve"])
    per_decode = max(0.0, (tb - t1) / (batch - 1))
    overhead = max(0.0, t1 - per_decode)
    per_pair = 4 * num_layers * q_dim / (float(gemm["agentserve"]) * 1e9)
    tp = n_prompt / float(prefill["agentserve"])
    per_prefill = max(0.0, (tp - overhead - per_pair * n_prompt * (n_prompt + 1) / 2) / n_prompt)
    return Linear(name, overhead, per_prefill, per_decode, per_pair, source="agentserve bench engine")


def preset_names() -> list[str]:
    names = [f"{g}-{m}" for g in _GPUS for m in _MODELS]
    return names + (["cpu-qwen2.5-coder-0.5b"] if CPU_QWEN05_BENCH else [])


def load_cost_model(name: str) -> CostModel:
    """A preset by name, or a `bench engine --json` file to fit."""
    if Path(name).suffix == ".json" and Path(name).is_file():
        return fit_engine_bench(json.loads(Path(name).read_text()), name=Path(name).stem)
    if name == "cpu-qwen2.5-coder-0.5b" and CPU_QWEN05_BENCH:
        return fit_engine_bench(list(CPU_QWEN05_BENCH))
    gpu, _, model = name.partition("-")
    if gpu not in _GPUS or model not in _MODELS:
        raise ValueError(f"unknown cost model {name!r}; presets: {', '.join(preset_names())}, "
                         "or a JSON file from `agentserve bench engine --json`")
    return roofline(gpu, model)
