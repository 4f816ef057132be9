"""Invalid configs fail before anything starts: `offbeat run` exits with the bad keys named
and no Ray or engine process was started."""

from __future__ import annotations

import subprocess
import sys

import pytest

from offbeat.core.cli import load_recipe_config
from offbeat.core.config import ConfigError


@pytest.mark.parametrize(
    "override, key",
    [
        ("resources.trainer_devices=2", "resources.trainer_devices+resources.rollout_devices"),
        ("data.train_batch_size=7", "data.train_batch_size"),
        ("actor.engine=megatronx", "actor.engine"),
        ("rollout.engine=trt", "rollout.engine"),
        ("async_training.num_warmup_batches=2", "async_training.num_warmup_batches"),
        ("async_training.max_off_policy_strategy=skip", "async_training.max_off_policy_strategy"),
        ("model.path=./no/such/model", "model.path"),
        ("runtime.ckpt_backend=pigeon", "runtime.ckpt_backend"),
        ("runtime.trainer_cpus=[4096]", "runtime.trainer_cpus"),
        ("runtime.rollout_cpus=[4096]", "runtime.rollout_cpus"),
        ("runtime.rollout_cpus=[0,1]", "runtime.rollout_cpus"),  # core 1 is the trainer's
        ("runtime.rollout_cpus=[0,0]", "runtime.rollout_cpus"),
    ],
)
def test_invalid_config_names_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", [override])
    assert key in {p.key for p in info.value.problems}, str(info.value)


def test_unknown_backend_lists_registered_ones():
    with pytest.raises(ConfigError, match="registered: fsdp2"):
        load_recipe_config("separate_async", ["actor.engine=megatronx"])


@pytest.mark.e2e
def test_offbeat_run_fails_fast_without_starting_anything():
    cmd = [
        sys.executable, "-c", "import sys; from offbeat.core.cli import main; sys.exit(main())",
        "run", "separate_async", "data.train_batch_size=7", "resources.rollout_devices=5",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "data.train_batch_size=7" in proc.stderr
    assert "resources.trainer_devices+resources.rollout_devices" in proc.stderr
    out = proc.stdout + proc.stderr
    assert "Ray" not in out and "vLLM" not in out and "EngineCore" not in out
