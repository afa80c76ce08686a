"""Tokenizers for the analyzer's tests: the two bundled models' (from the session fixtures in
tests/conftest.py) and tiny ones with templates written for the tests (`tiny_tokenizer`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentserve.analyze.render import HFChatTokenizer, Renderer, load_tokenizer_dir
from tests.analyze.tiny_tokenizer import (
    QWEN3_STYLE_TEMPLATE,
    RAISING_TEMPLATE,
    write_tokenizer_dir,
)


@pytest.fixture(scope="session")
def qwen3_style_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("qwen3_style"), QWEN3_STYLE_TEMPLATE)


@pytest.fixture(scope="session")
def raising_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("raising"), RAISING_TEMPLATE)


@pytest.fixture(scope="session")
def no_template_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("no_template"), None)


@pytest.fixture(scope="session")
def qwen3_style(qwen3_style_dir: Path) -> HFChatTokenizer:
    return load_tokenizer_dir(qwen3_style_dir)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir: Path) -> HFChatTokenizer:
    return load_tokenizer_dir(smollm2_dir)


@pytest.fixture(scope="session")
def qwen25(qwen_dir: Path) -> HFChatTokenizer:
    return load_tokenizer_dir(qwen_dir)


@pytest.fixture(params=["smollm2", "qwen25", "qwen3_style"])
def any_template(request: pytest.FixtureRequest) -> tuple[str, Renderer]:
    """Each of the three templates: (name, renderer)."""
    return request.param, Renderer(request.getfixturevalue(request.param))
