"""The placeholder imports cleanly and keeps the dependency direction: no megatron in core."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import offbeat.backend_megatron, offbeat.core.config, offbeat.core.algorithms
import offbeat.core.data, offbeat.core.device, offbeat.core.metrics
bad = sorted(m for m in sys.modules if m.split(".")[0] in {"megatron", "transformer_engine"})
print(",".join(bad))
"""


def test_imports_without_pulling_megatron():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_no_train_engine_claims_megatron_yet():
    import offbeat.backend_megatron as pkg
    from offbeat.core.registry import TRAIN_ENGINES

    assert pkg.__all__ == []
    assert "megatron" not in TRAIN_ENGINES.names()
