"""Model loading: a bundled name, a .gguf file or an HF directory → an HF-style directory →
`ModelConfig`, weights (HF parameter names) and tokenizer.

torch, safetensors and transformers are imported inside the functions that need them, so
importing this module (e.g. to list `BUNDLED`) stays cheap.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from agentserve.model.config import ModelConfig
from agentserve.model.gguf_convert import HF_ARCHITECTURES
from agentserve.model.model_cache import (
    BUNDLED,
    MARKER,
    BundledModel,
    BundledPart,
    ModelLoadError,
    resolve_bundled,
    resolve_gguf,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "BUNDLED",
    "BundledModel",
    "BundledPart",
    "ModelLoadError",
    "default_cache_root",
    "load_model_config",
    "load_tokenizer",
    "load_weights",
    "resolve_model_dir",
    "weight_names",
]

_ARCH_OF_CLASS = {cls: arch for arch, cls in HF_ARCHITECTURES.items()}
_DIR_CONTENTS = "config.json, model.safetensors (or shards) and tokenizer.json"


def default_cache_root() -> Path:
    return Path.home() / ".cache" / "agentserve"


def resolve_model_dir(model: str, cache_root: Path) -> Path:
    """An HF-style directory for `model`; bundled models and GGUFs are converted once."""
    if model in BUNDLED:
        return resolve_bundled(BUNDLED[model], cache_root)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return resolve_gguf(path, cache_root)
    if path.is_dir():
        load_model_config(path)  # config.json present, architecture supported
        _safetensors_files(path)
        _check_tokenizer_files(path)
        return path.resolve()
    what = "is not a .gguf file" if path.exists() else "is not a bundled model, file or directory"
    raise ModelLoadError(
        f"model {model!r} {what}; expected a bundled model name ({', '.join(BUNDLED)}), "
        f"a path to a .gguf file, or a Hugging Face model directory with {_DIR_CONTENTS}"
    )


def load_model_config(model_dir: Path, name: str | None = None) -> ModelConfig:
    """ModelConfig from config.json (+ generation_config.json for the eos ids)."""
    path = model_dir / "config.json"
    if not path.is_file():
        hint = "; for a GGUF, pass the .gguf file itself" if any(model_dir.glob("*.gguf")) else ""
        raise ModelLoadError(f"{path} not found: a model directory needs {_DIR_CONTENTS}{hint}")
    raw = json.loads(path.read_text())
    arch = _architecture(raw, path)
    heads = int(_require(raw, "num_attention_heads", path))
    hidden = int(_require(raw, "hidden_size", path))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(_require(raw, "vocab_size", path)),
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size", path)),
        num_layers=int(_require(raw, "num_hidden_layers", path)),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rope_theta=_rope_theta(raw, path),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(_require(raw, "max_position_embeddings", path)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2",  # HF Qwen2 always has q/k/v biases
        qk_norm=arch == "qwen3",
        eos_token_ids=_eos_token_ids(model_dir, raw),
        name=name or _default_name(model_dir),
    )


def _require(raw: dict[str, object], key: str, path: Path) -> object:
    if raw.get(key) is None:
        raise ModelLoadError(f"{path} has no {key!r}, expected one in an HF model config")
    return raw[key]


def _architecture(raw: dict[str, object], path: Path) -> str:
    classes = raw.get("architectures") or []
    model_type = raw.get("model_type")
    arch = _ARCH_OF_CLASS.get(classes[0]) if classes else model_type
    if arch not in HF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: architecture {classes[0] if classes else model_type!r} is not supported; "
            f"supported: {', '.join(HF_ARCHITECTURES.values())}. Use a model of one of these "
            f"or a bundled model ({', '.join(BUNDLED)})"
        )
    # What our forward does not implement must not load silently and compute wrong logits.
    unsupported = [
        key
        for key in ("attention_bias", "mlp_bias", "use_sliding_window")
        if raw.get(key) and not (key == "attention_bias" and arch == "qwen2")
    ]
    if raw.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={raw['hidden_act']}")
    if unsupported:
        raise ModelLoadError(f"{path}: unsupported {arch} options {unsupported}, expected off")
    return str(arch)


def _rope_theta(raw: dict[str, object], path: Path) -> float:
    """transformers 5.x writes theta into `rope_parameters`; older configs at the top level."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    assert isinstance(params, dict)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(
            f"{path}: RoPE type {rope_type!r} is not supported, expected 'default' (no scaling)"
        )
    theta = raw.get("rope_theta") or params.get("rope_theta") or 10000.0  # HF's default
    return float(theta)


def _eos_token_ids(model_dir: Path, raw: dict[str, object]) -> tuple[int, ...]:
    """generation_config.json's ids first (it lists every stop id), then config.json's."""
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    ids: list[int] = []
    for value in (gen.get("eos_token_id"), raw.get("eos_token_id")):
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    if not ids:
        raise ModelLoadError(
            f"{model_dir}: no eos_token_id in config.json or generation_config.json, expected "
            "at least one; add it to generation_config.json"
        )
    return tuple(ids)


def _default_name(model_dir: Path) -> str:
    """Identifies the weights (it salts block hashes): converted dirs carry their GGUF's
    sha256; other dirs are fingerprinted by config.json and their weight files' size/mtime."""
    marker = model_dir / MARKER
    if marker.is_file():
        record = json.loads(marker.read_text())
        return f"{record['name']}@{record['sha256'][:16]}"
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for file in _safetensors_files(model_dir):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"{model_dir.resolve().name}@{digest.hexdigest()[:16]}"


def weight_names(config: ModelConfig) -> list[str]:
    """The HF parameter names `load_weights` returns for `config`."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if config.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    names += [f"model.layers.{i}.{n}" for i in range(config.num_layers) for n in per_layer]
    return names


def load_weights(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Exactly `weight_names(config)`, cast to dtype; extra tensors (and a tied lm_head)
    in the files are skipped."""
    from safetensors import safe_open

    wanted = set(weight_names(load_model_config(model_dir)))
    files = _safetensors_files(model_dir)
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in wanted.intersection(f.keys()):
                weights[key] = f.get_tensor(key).to(dtype)
    missing = sorted(wanted - weights.keys())
    if missing:
        raise ModelLoadError(
            f"{_names(files)} lack {len(missing)} expected tensors, e.g. {missing[:3]}; "
            "expected Hugging Face parameter names for this config.json"
        )
    return weights


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = [
            model_dir / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))
        ]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{index} lists {file.name}, which is missing; download it")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{model_dir} has no *.safetensors file, expected model.safetensors or shards "
            "(*.bin checkpoints are not read: save them as safetensors, or pass a .gguf file)"
        )
    return files


def _check_tokenizer_files(model_dir: Path) -> None:
    if not any(
        (model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        raise ModelLoadError(
            f"{model_dir} has no tokenizer.json (nor tokenizer.model / vocab.json), expected "
            "the model's tokenizer files next to config.json; copy them from the model's repository"
        )


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """transformers' AutoTokenizer from local files only (chat template included)."""
    from transformers import AutoTokenizer

    _check_tokenizer_files(model_dir)
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _names(paths: list[Path]) -> str:
    return ", ".join(str(p) for p in paths)
