"""`./offbeat` picks the engine stack it syncs: the GPU stack where `nvidia-smi` lists a
GPU, the CPU stack otherwise, `OFFBEAT_STACK` forcing either. Exercised with a fake
`nvidia-smi` and a fake `uv` on PATH (which records its arguments), so nothing is synced."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "offbeat"
GPU_LINE = "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)"


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def run_script(
    tmp_path: Path, *args: str, nvidia_smi: str | None, stack: str | None = None, **extra_env
):
    """Run ./offbeat with only a fake uv (and `nvidia_smi`'s script, if any) on top of a
    PATH that holds no real nvidia-smi or uv; return (process, the uv calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "uv.log"
    _fake(bin_dir, "uv", f'echo "$*" >> {log}')
    if nvidia_smi is not None:
        _fake(bin_dir, "nvidia-smi", nvidia_smi)
    # The system tools the script needs, without whatever else this machine has on PATH.
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for tool in ("bash", "env", "grep", "dirname", "cat", "sha256sum", "cut"):
        found = shutil.which(tool)
        assert found, tool
        if not (tools / tool).exists():
            (tools / tool).symlink_to(found)
    # the environment the script syncs (and stamps) is tmp_path's, never this checkout's .venv
    env = {"PATH": f"{bin_dir}:{tools}", "HOME": str(tmp_path),
           "UV_PROJECT_ENVIRONMENT": str(tmp_path / "venv"), **extra_env}  # fmt: skip
    if stack is not None:
        env["OFFBEAT_STACK"] = stack
    proc = subprocess.run(
        [str(tools / "bash"), str(SCRIPT), *args], env=env, capture_output=True, text=True
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls


@pytest.mark.parametrize(
    "nvidia_smi, stack, want",
    [
        (f"echo '{GPU_LINE}'", None, "gpu"),  # a GPU listed
        ("echo 'NVIDIA-SMI has failed' >&2; exit 9", None, "cpu"),  # driver broken
        ("echo 'No devices were found'", None, "cpu"),  # nvidia-smi but no GPU
        (None, None, "cpu"),  # no nvidia-smi at all
        (f"echo '{GPU_LINE}'", "cpu", "cpu"),  # forced
        (None, "gpu", "gpu"),  # forced
    ],
)
def test_stack_detection(tmp_path, nvidia_smi, stack, want):
    proc, calls = run_script(tmp_path, "stack", nvidia_smi=nvidia_smi, stack=stack)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == want
    assert calls == []  # `stack` syncs nothing


def test_gpu_machine_syncs_the_gpu_stack(tmp_path):
    proc, calls = run_script(tmp_path, "recipes", nvidia_smi=f"echo '{GPU_LINE}'")
    assert proc.returncode == 0, proc.stderr
    assert calls == [
        "sync --frozen --no-group cpu --group gpu",
        "run --frozen --no-sync offbeat recipes",
    ]


def test_cpu_machine_syncs_the_default_cpu_stack(tmp_path):
    proc, calls = run_script(tmp_path, "recipes", nvidia_smi=None)
    assert proc.returncode == 0, proc.stderr
    assert calls == ["sync --frozen", "run --frozen --no-sync offbeat recipes"]


def test_a_synced_environment_is_not_synced_again_until_its_inputs_change(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    run = "run --frozen --no-sync offbeat recipes"
    proc, calls = run_script(tmp_path, "recipes", nvidia_smi=None)
    assert proc.returncode == 0, proc.stderr
    assert calls == ["sync --frozen", run]
    assert (venv / ".offbeat-synced").exists()
    proc, calls = run_script(tmp_path, "recipes", nvidia_smi=None)  # same lock, same stack
    assert calls == ["sync --frozen", run, run]
    proc, calls = run_script(tmp_path, "recipes", nvidia_smi=None, stack="gpu")  # stack changed
    assert calls[-2:] == ["sync --frozen --no-group cpu --group gpu", run]
    proc, calls = run_script(
        tmp_path, "recipes", nvidia_smi=None, stack="gpu", OFFBEAT_SYNC="always"
    )
    assert calls[-2:] == ["sync --frozen --no-group cpu --group gpu", run]
    (venv / ".offbeat-synced").write_text("an older lock\n")
    proc, calls = run_script(tmp_path, "recipes", nvidia_smi=None, stack="gpu")
    assert calls[-2:] == ["sync --frozen --no-group cpu --group gpu", run]


def test_unknown_stack_is_refused_before_anything_runs(tmp_path):
    proc, calls = run_script(tmp_path, "recipes", nvidia_smi=None, stack="tpu")
    assert proc.returncode == 2
    assert "OFFBEAT_STACK=tpu: expected cpu, gpu or auto" in proc.stderr
    assert calls == []


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no nvidia-smi on this machine")
def test_this_machine_with_its_real_nvidia_smi():
    env = {k: v for k, v in os.environ.items() if k != "OFFBEAT_STACK"}
    out = subprocess.run([str(SCRIPT), "stack"], env=env, capture_output=True, text=True)
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    has_gpu = listed.returncode == 0 and any(
        line.startswith("GPU ") for line in listed.stdout.splitlines()
    )
    assert out.stdout.strip() == ("gpu" if has_gpu else "cpu")
