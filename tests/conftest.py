"""Session fixtures for the two bundled models, converted once per machine.

They use the real default cache (~/.cache/agentserve): the first run converts (SmolLM2 ~15 s,
Qwen ~45 s), later runs and other test packages reuse the converted directories.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cache_root() -> Path:
    return Path.home() / ".cache" / "agentserve"


@pytest.fixture(scope="session")
def smollm2_dir(cache_root: Path) -> Path:
    from agentserve.model.loader import resolve_model_dir

    return resolve_model_dir("smollm2-135m", cache_root)


@pytest.fixture(scope="session")
def qwen_dir(cache_root: Path) -> Path:
    from agentserve.model.loader import resolve_model_dir

    return resolve_model_dir("qwen2.5-coder-0.5b", cache_root)
