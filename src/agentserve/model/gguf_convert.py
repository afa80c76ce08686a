"""GGUF file → Hugging Face model directory (config.json, fp32 model.safetensors, tokenizer).

Pure mechanics: raises ValueError/KeyError on content it cannot convert; `model_cache` turns
those into user-facing `ModelLoadError`s and owns hashing, caching and atomic publication.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import gguf
import numpy as np

# GGUF `general.architecture` → Hugging Face class; also the set of architectures we serve.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF per-block tensor stem → HF module path under `model.layers.{i}.`
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Qwen's generation_config.json stops on <|endoftext|> as well as <|im_end|>, but a GGUF
# records a single eos id; these tokens are added to it when the vocabulary has them.
_EXTRA_EOS_TOKENS = {"qwen2": ("<|endoftext|>",), "qwen3": ("<|endoftext|>",)}


@dataclass(frozen=True, slots=True)
class _Entry:
    """One output tensor: its HF name, fp32 shape and a thunk producing its values."""

    name: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    architecture: str
    has_chat_template: bool


def read_gguf_header(path: Path) -> GGUFHeader:
    """What decides whether we can serve a GGUF; cheap (the reader mmaps, reads no tensors)."""
    reader = gguf.GGUFReader(path)
    return GGUFHeader(
        architecture=str(_field(reader, "general.architecture")),
        has_chat_template="tokenizer.chat_template" in reader.fields,
    )


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write tokenizer files, config.json, generation_config.json and model.safetensors.

    The tokenizer goes first: transformers reads the GGUF's directory, which must not yet
    hold a half-written config.json (callers place the GGUF, or a link to it, in out_dir).
    """
    reader = gguf.GGUFReader(gguf_path)
    arch = str(_field(reader, "general.architecture"))
    assert arch in HF_ARCHITECTURES, arch  # callers check support before converting
    config = _hf_config(reader, arch)
    entries = [_entry(t, arch, config) for t in reader.tensors]
    _save_tokenizer(gguf_path, out_dir, int(config["max_position_embeddings"]))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(reader, arch))
    _write_safetensors(out_dir / "model.safetensors", entries)


def _field(reader: gguf.GGUFReader, key: str, default: object = None) -> object:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise KeyError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _hf_config(reader: gguf.GGUFReader, arch: str) -> dict[str, object]:
    """A config.json transformers 5.x loads as-is; values come from `{arch}.*` metadata."""

    def meta(key: str, default: object = None) -> object:
        return _field(reader, f"{arch}.{key}", default)

    names = {t.name: t for t in reader.tensors}
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    theta = float(meta("rope.freq_base", 10000.0))
    # GGUF stores eps as float32; its shortest decimal repr is the value HF's config.json had.
    eps = float(str(np.float32(meta("attention.layer_norm_rms_epsilon"))))
    config: dict[str, object] = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(names["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta("context_length")),
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _optional_int(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "dtype": "float32",
    }
    if arch != "qwen2":  # HF Qwen2 hardcodes q/k/v biases; Llama/Qwen3 read this flag
        config["attention_bias"] = False
    return config


def _generation_config(reader: gguf.GGUFReader, arch: str) -> dict[str, object]:
    eos = [int(_field(reader, "tokenizer.ggml.eos_token_id"))]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        eos.append(_optional_int(reader, key))
    if arch in _EXTRA_EOS_TOKENS:
        tokens = _field(reader, "tokenizer.ggml.tokens")
        eos.extend(tokens.index(t) for t in _EXTRA_EOS_TOKENS[arch] if t in tokens)
    return {
        "bos_token_id": _optional_int(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(i for i in eos if i is not None)),
        "pad_token_id": _optional_int(reader, "tokenizer.ggml.padding_token_id"),
    }


def _optional_int(reader: gguf.GGUFReader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else int(field.contents())


def hf_tensor_name(gguf_name: str) -> str:
    """HF parameter name of a GGUF tensor; ValueError for tensors we cannot serve."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


def _entry(tensor: gguf.ReaderTensor, arch: str, config: dict[str, object]) -> _Entry:
    name = hf_tensor_name(tensor.name)
    # llama.cpp's converter permutes llama q/k rows (per head) for its interleaved RoPE;
    # undoing it restores HF's rotate-half layout. Qwen2/Qwen3 GGUFs are not permuted.
    groups = None
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        key = "num_attention_heads" if "q_proj" in name else "num_key_value_heads"
        groups = int(config[key])
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
    return _Entry(name, shape, partial(_dequantize, tensor, shape, groups))


def _dequantize(tensor: gguf.ReaderTensor, shape: tuple[int, ...], heads: int | None) -> np.ndarray:
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    if heads is not None:
        # rows were [head, rot_half(2), dim/2] → llama.cpp stored [head, dim/2, 2]
        rows = shape[0] // heads // 2
        array = array.reshape(heads, rows, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    return np.ascontiguousarray(array, dtype=np.float32)


def _write_safetensors(path: Path, entries: list[_Entry]) -> None:
    """Stream fp32 tensors one at a time: peak memory is one tensor, not the whole model.

    Layout per the safetensors spec: u64 little-endian header size, JSON header with
    contiguous data_offsets, header padded with spaces to 8 bytes, then the raw data.
    """
    assert sys.byteorder == "little"
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        end = offset + 4 * math.prod(entry.shape)
        header[entry.name] = {
            "dtype": "F32",
            "shape": list(entry.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for entry in entries:
            array = entry.load()
            assert array.shape == entry.shape and array.dtype == np.float32, entry.name
            f.write(memoryview(array).cast("B"))


def _save_tokenizer(gguf_path: Path, out_dir: Path, max_length: int) -> None:
    """transformers builds the fast tokenizer and chat template from GGUF metadata."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.model_max_length = max_length
    # chat_template inside tokenizer_config.json: one file any consumer of the dir can read.
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)


def _write_json(path: Path, value: dict[str, object]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
