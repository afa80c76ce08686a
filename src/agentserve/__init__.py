"""agentserve: LLM serving for tool-using agents.

`from agentserve import LLM, SamplingParams` is the offline API (as in vLLM); the names load
on first use, so `import agentserve` (the CLI, the simulator) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Bundled model names, usable everywhere a model is named (Python, CLI, server).
SMOLLM2 = "smollm2-135m"
QWEN_CODER = "qwen2.5-coder-0.5b"

_API = {"LLM": "agentserve.api", "SamplingParams": "agentserve.engine.request",
        "CompletionOutput": "agentserve.api", "FinishReason": "agentserve.engine.request"}
__all__ = ["LLM", "SamplingParams", "CompletionOutput", "FinishReason", "SMOLLM2", "QWEN_CODER"]

if TYPE_CHECKING:
    from agentserve.api import LLM, CompletionOutput
    from agentserve.engine.request import FinishReason, SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'agentserve' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value
