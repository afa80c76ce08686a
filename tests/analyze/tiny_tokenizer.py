"""A tiny byte-level BPE tokenizer and chat templates written for the analyzer's tests, among
them a Qwen3-style one that drops the reasoning of earlier rounds; no download needed."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# Written for these tests after the shape of Qwen3's template: tools in the system turn, and an
# assistant message's reasoning rendered only after the last user message (so a new user
# message drops the reasoning of every earlier round).
QWEN3_STYLE_TEMPLATE = """
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = m.content or '' %}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].replace('<think>', '').strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > ns.last_query and reasoning %}
{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
{%- endif %}
{{- content }}
{%- for tc in m.tool_calls or [] %}
{%- set f = tc.function if tc.function is defined else tc %}
{{- '\\n<tool_call>\\n{"name": "' + f.name + '", "arguments": ' }}
{{- f.arguments if f.arguments is string else f.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

RAISING_TEMPLATE = """
{%- for m in messages %}
{%- if m.role == 'tool' %}{{ raise_exception('tool messages are not supported') }}{%- endif %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

_CORPUS = [
    "You are a coding agent. Read files, run commands and fix the failing tests.",
    '{"type": "function", "function": {"name": "read_file", "parameters": {}}}',
    "def test_add():\n    assert add(1, 2) == 3\n",
    "The current time is 2025-01-02 10:00:00 UTC. Step 1 of 10.",
    "I should read the test first, then run pytest and look at the output.",
]


def build_tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE (any text encodes) with ChatML special tokens, trained in milliseconds."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    tokenizer.add_tokens(ADDED)
    return tokenizer


def write_tokenizer_dir(path: Path, template: str | None) -> Path:
    """tokenizer.json + tokenizer_config.json (with `chat_template` when given)."""
    path.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
