"""The placeholder imports cleanly and keeps the dependency direction: no SGLang in core."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import offbeat.rollout_sglang, offbeat.core.rollout, offbeat.core.config
import offbeat.core.algorithms, offbeat.core.data, offbeat.core.device
bad = sorted(m for m in sys.modules if m.split(".")[0] in {"sglang", "sgl_kernel"})
print(",".join(bad))
"""


def test_imports_without_pulling_sglang():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_no_rollout_engine_claims_sglang_yet():
    import offbeat.rollout_sglang as pkg
    from offbeat.core.registry import ROLLOUT_ENGINES

    assert pkg.__all__ == []
    assert "sglang" not in ROLLOUT_ENGINES.names()
