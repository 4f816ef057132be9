"""The package installs alone: wheel into a fresh venv with no index and no dependencies."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1]


def _quickstart() -> str:
    readme = (PKG / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _build_wheel(out: Path) -> Path:
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv:
        cmd = [uv, "build", str(PKG), "--wheel", "-o", str(out)]
    else:  # pip fetches the build backend (hatchling) itself
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(PKG)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("offbeat_balancer-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_installs_alone_and_the_quickstart_runs(tmp_path):
    wheel = _build_wheel(tmp_path / "dist")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    before = subprocess.run(
        [py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout.split()
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=300,
    )
    after = subprocess.run(
        [py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert sorted(set(after) - set(before)) == ["offbeat-balancer==0.1.0"]
    check = subprocess.run(
        [py, "-I", "-c", "import offbeat.balancer, offbeat.balancer.aio, offbeat.balancer.actor"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert check.returncode == 0, check.stderr
    run = subprocess.run(
        [py, "-I", "-c", _quickstart()], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert "'total_inflight': 2" in run.stdout
