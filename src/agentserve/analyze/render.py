"""Render requests through a real chat template and tokenize them as a server does.

A server renders the template to text (`add_generation_prompt=True` for a prompt) and encodes
that text without adding special tokens; the same is done here. Where a break lies in the text
is found from the texts themselves (their first differing character), so no token offsets are
kept.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from agentserve.analyze.messages import JsonValue, Message, server_messages

T = TypeVar("T")

KEEP_TEXTS = 64  # rendered texts kept (prefix renderings for message spans are many and small)
KEEP_RENDERINGS = 8  # tokenized renderings kept (a long request's ids take megabytes)


class TemplateError(Exception):
    """The chat template raised while rendering; the text names the template's complaint."""


class TokenizerError(Exception):
    """A tokenizer (directory) that cannot be used for analysis."""


class ChatTokenizer(Protocol):
    """What the analyzer needs: render messages to text, and encode text to token ids."""

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Message] | None,
        *,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, JsonValue],
    ) -> str: ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        ...


class _HFBackend(Protocol):
    """The part of a Hugging Face tokenizer used here."""

    chat_template: str | dict[str, str] | None

    def apply_chat_template(self, conversation: list[Message], **kwargs: JsonValue) -> str: ...

    def __call__(self, text: str, **kwargs: bool) -> Mapping[str, list[int]]: ...


@dataclass(frozen=True, slots=True)
class Rendering:
    """One rendered sequence: its text and token ids."""

    text: str
    token_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.token_ids)


class HFChatTokenizer:
    """A Hugging Face tokenizer (fast) with its chat template, rendered with transformers' jinja
    environment, exactly as vLLM and SGLang do."""

    def __init__(self, backend: _HFBackend, name: str) -> None:
        if not getattr(backend, "chat_template", None):
            raise TokenizerError(f"{name}: the tokenizer has no chat template")
        self._backend = backend
        self.name = name

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Message] | None,
        *,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, JsonValue],
    ) -> str:
        try:
            text = self._backend.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
        except Exception as exc:  # jinja errors, TypeError, raise_exception(): all the template's
            raise TemplateError(f"chat template raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):
            raise TemplateError(f"chat template returned {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self._backend(text, add_special_tokens=False)["input_ids"])


def load_tokenizer_dir(path: Path) -> HFChatTokenizer:
    """A Hugging Face tokenizer directory: tokenizer.json plus a chat template (in
    tokenizer_config.json or chat_template.jinja)."""
    if not path.is_dir():
        raise TokenizerError(f"{path}: not a directory")
    if not (path / "tokenizer.json").is_file():
        raise TokenizerError(f"{path}: no tokenizer.json")
    from transformers import PreTrainedTokenizerFast  # imported on use: ~1 s, and no torch

    try:
        backend = PreTrainedTokenizerFast.from_pretrained(str(path))
    except Exception as exc:  # transformers reports unreadable files in several exception types
        raise TokenizerError(f"{path}: cannot load the tokenizer: {exc}") from exc
    if not backend.chat_template:
        raise TokenizerError(
            f"{path}: no chat template (neither tokenizer_config.json nor chat_template.jinja "
            "has one)"
        )
    return HFChatTokenizer(backend, path.name)


def load_model_tokenizer(name: str, cache_root: Path) -> HFChatTokenizer:
    """A bundled model's tokenizer and template, from the directory the model package resolves;
    weights are never loaded. Loaded as a generic fast tokenizer from the same tokenizer.json and
    template as `model.loader.load_tokenizer` (same token ids), without importing torch."""
    from agentserve.model.loader import resolve_model_dir  # the model package owns model files

    tokenizer = load_tokenizer_dir(resolve_model_dir(name, cache_root))
    tokenizer.name = name
    return tokenizer


class Renderer:
    """Renders and encodes through one tokenizer with fixed template options. The analysis asks
    for the same message lists several times (a full sequence is the next request's "old" side,
    message spans render prefixes), so recent results are kept; older ones are dropped to bound
    memory on long sessions."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        template_kwargs: Mapping[str, JsonValue] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self._texts: OrderedDict[str, str] = OrderedDict()  # LRU: request key → text
        self._renderings: OrderedDict[str, Rendering] = OrderedDict()  # LRU: text → rendering

    def text(
        self, messages: Sequence[Message], tools: Sequence[Message] | None, *, generation: bool
    ) -> str:
        """The template's text for `messages`; raises TemplateError."""
        key = json.dumps([list(messages), list(tools or ()), generation])
        text = self._recall(self._texts, key)
        if text is None:
            text = self.tokenizer.render(
                server_messages(messages),
                list(tools) if tools else None,
                add_generation_prompt=generation,
                template_kwargs=self.template_kwargs,
            )
            self._remember(self._texts, key, text, KEEP_TEXTS)
        return text

    def rendering(
        self, messages: Sequence[Message], tools: Sequence[Message] | None, *, generation: bool
    ) -> Rendering:
        text = self.text(messages, tools, generation=generation)
        rendering = self._recall(self._renderings, text)
        if rendering is None:
            rendering = Rendering(text, tuple(self.tokenizer.encode(text)))
            self._remember(self._renderings, text, rendering, KEEP_RENDERINGS)
        return rendering

    @staticmethod
    def _recall(cache: OrderedDict[str, T], key: str) -> T | None:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        return None

    @staticmethod
    def _remember(cache: OrderedDict[str, T], key: str, value: T, keep: int) -> None:
        cache[key] = value
        if len(cache) > keep:
            cache.popitem(last=False)
