"""The package face: what vLLM users type works, and `import agentserve` stays light."""

from __future__ import annotations

import subprocess
import sys


def test_vllm_style_imports():
    from agentserve import LLM, SamplingParams
    from agentserve.api import LLM as ApiLLM
    from agentserve.engine.request import SamplingParams as EngineSamplingParams

    assert LLM is ApiLLM and SamplingParams is EngineSamplingParams
    assert SamplingParams(temperature=0.0, max_tokens=4).greedy


def test_import_agentserve_does_not_import_torch():
    code = "import sys, agentserve; from agentserve import SamplingParams; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
