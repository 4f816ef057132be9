"""The package keeps the dependency direction (no megatron in core, none on import) and
registers the train engine "megatron" through its entry point."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import offbeat.backend_megatron, offbeat.core.config, offbeat.core.algorithms
import offbeat.core.data, offbeat.core.device, offbeat.core.metrics
from offbeat.core.registry import TRAIN_ENGINES
engine = TRAIN_ENGINES.get("megatron")
assert engine is offbeat.backend_megatron.MegatronTrainEngine, engine
bad = sorted(m for m in sys.modules if m.split(".")[0] in {"megatron", "transformer_engine"})
print(",".join(bad))
"""


def test_import_and_lookup_do_not_pull_megatron():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_registry_lists_megatron_beside_fsdp2():
    from offbeat.core.registry import TRAIN_ENGINES

    assert {"fsdp2", "megatron"} <= set(TRAIN_ENGINES.names())


def test_job_config_selects_megatron_and_checks_trainer_devices_against_tp_times_pp():
    from offbeat.backend_megatron import megatron_config
    from offbeat.core.config import ConfigError, JobConfig, validate

    cfg = JobConfig()
    cfg.model.path = "some/model"
    cfg.actor.engine = "megatron"
    validate(cfg)  # TP = PP = 1 on the one trainer device
    engine = megatron_config(cfg)
    assert (engine.model_path, engine.tensor_model_parallel_size) == ("some/model", 1)

    cfg.actor.tensor_model_parallel_size = 2
    try:
        validate(cfg)
    except ConfigError as e:
        problems = {p.key: str(p) for p in e.problems}
    else:
        raise AssertionError("TP=2 on one trainer device validated")
    assert "multiple of actor.tensor_model_parallel_size" in problems["resources.trainer_devices"]
    assert "= 2" in problems["resources.trainer_devices"]
    assert "actor.tensor_model_parallel_size" not in problems  # megatron has TP
    assert megatron_config(cfg).tensor_model_parallel_size == 2
