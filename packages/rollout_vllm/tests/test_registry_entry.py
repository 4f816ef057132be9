"""`rollout.engine=vllm` resolves through the installed entry point, with no recipe code."""

import subprocess
import sys

import pytest

# A fresh interpreter that imports vLLM (~20 s here): the full tier, not --fast.
pytestmark = pytest.mark.slow


def test_vllm_is_a_registered_rollout_engine_once_installed():
    code = (
        "from offbeat.core.registry import ROLLOUT_ENGINES\n"
        "assert 'vllm' in ROLLOUT_ENGINES.names(), ROLLOUT_ENGINES.names()\n"
        "from offbeat.rollout_vllm.replica import vllm_replica\n"
        "assert ROLLOUT_ENGINES.get('vllm') is vllm_replica\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
