"""agentserve: LLM serving for tool-using agents."""

from __future__ import annotations

__version__ = "0.1.0"

# Bundled model names, usable everywhere a model is named (Python, CLI, server).
SMOLLM2 = "smollm2-135m"
QWEN_CODER = "qwen2.5-coder-0.5b"
