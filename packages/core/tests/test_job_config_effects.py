"""Keys of a job config that once were read nowhere now have their effect: total_epochs
bounds the steps, val_batch_size bounds validation concurrency, project_name names the
run, and the warm start is for the tiny model only unless asked. No engine, no Ray:
`prepare` resolves the model and data; the pieces that use the keys are built directly."""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from offbeat.core.cli import load_recipe_config
from offbeat.core.models import build_tiny_model
from offbeat.core.runtime.host import split_gpus
from offbeat.core.tasks import make_rows, write_parquet
from offbeat.core.tasks.dataloader import steps_within_epochs
from offbeat.core.train import actor_engine_config
from offbeat.core.trainer import Validator
from offbeat.core.trainer.prepare import prepare, run_header, wants_warm_start


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A local HF model directory (not an `offbeat-tiny:` name)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("own") / "model",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )


@pytest.fixture
def data(tmp_path) -> tuple[Path, Path]:
    train = write_parquet(make_rows("add", 40, seed=0, min_len=1, max_len=1), tmp_path / "t.pq")
    val = write_parquet(make_rows("add", 8, seed=1, min_len=1, max_len=1), tmp_path / "v.pq")
    return train, val


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFBEAT_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # prepare() sets the trainer's thread count


def job(data, *extra: str):
    train, val = data
    overrides = [
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "runtime.trainer_cpus=[]",
        *extra,
    ]
    return load_recipe_config("separate_async", overrides)[1]


def test_steps_within_epochs():
    assert steps_within_epochs(60, None, 40, 4) == 60  # no bound
    assert steps_within_epochs(60, 1, 40, 4) == 10
    assert steps_within_epochs(60, 2, 42, 4) == 21  # whole batches of 2 x 42 rows
    assert steps_within_epochs(5, 3, 40, 4) == 5  # the step count is the smaller bound


def test_total_epochs_bounds_the_run_the_lr_horizon_and_the_progress(model_dir, data):
    cfg = job(data, f"model.path={model_dir}", "trainer.total_epochs=1")
    configured = cfg.trainer.total_training_steps  # the recipe's default (100)
    assert configured > 10
    p = prepare(cfg)
    assert p.cfg.trainer.total_training_steps == 10  # 40 rows / 4 prompts per step
    s = cfg.async_training.parameter_sync_step
    assert actor_engine_config(p.cfg).optim.total_updates == 10 * s
    assert "trainer.total_epochs=1 leaves 10 steps" in run_header(p, 1, 0.0)
    # Without it the configured step count stands.
    assert prepare(job(data, f"model.path={model_dir}")).cfg.trainer.total_training_steps == (
        configured
    )


@pytest.mark.parametrize(
    "path, enabled, steps, want",
    [
        ("offbeat-tiny:tiny", None, 60, True),  # auto: the tiny model
        ("/models/Qwen2.5-1.5B", None, 60, False),  # auto: not your own model
        ("/models/Qwen2.5-1.5B", True, 60, True),  # asked for
        ("offbeat-tiny:tiny", False, 60, False),  # refused
        ("offbeat-tiny:tiny", None, 0, False),  # nothing to do
    ],
)
def test_wants_warm_start(path, enabled, steps, want):
    cfg = SimpleNamespace(
        model=SimpleNamespace(path=path), warm_start=SimpleNamespace(enabled=enabled, steps=steps)
    )
    assert wants_warm_start(cfg) is want


def test_own_model_is_not_warm_started_unless_asked(model_dir, data):
    cfg = job(data, f"model.path={model_dir}")
    assert cfg.warm_start.steps == 150  # the recipe's, meant for the tiny model
    p = prepare(cfg)
    assert p.model_dir == model_dir and p.cfg.model.path == str(model_dir)
    assert any("no warm start" in n for n in p.notes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asked = prepare(
            job(data, f"model.path={model_dir}", "warm_start.enabled=true", "warm_start.steps=2")
        )
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "/offbeat/" in w.filename]
    assert not ours  # no warning from offbeat's own code (the warm start's loop included)
    assert asked.model_dir != model_dir and (asked.model_dir / "config.json").is_file()
    assert asked.cfg.model.path == str(asked.model_dir)


def test_project_and_experiment_name_the_run(model_dir, data):
    cfg = job(
        data, f"model.path={model_dir}", "trainer.project_name=gsm8k", "trainer.experiment_name=e1"
    )
    assert run_header(prepare(cfg), 1, 0.0).startswith("offbeat: run gsm8k/e1 ")


class _CountingAgent:
    """Stands in for the agent loop: counts the validation samples in flight at once."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.peak = 0

    async def sample(self, uid, row, n, sampling=None):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        return [SimpleNamespace(reward=1.0, response_ids=[1, 2])]


@pytest.mark.parametrize("val_batch_size", [1, 3])
async def test_val_batch_size_bounds_validation_concurrency(data, val_batch_size):
    cfg = job(data, f"data.val_batch_size={val_batch_size}", "trainer.test_freq=1")
    agent = _CountingAgent()
    validator = Validator.build(cfg.trainer, cfg.data, agent, [{"prompt": i} for i in range(10)])
    metrics = await validator.run()
    assert metrics["val/reward"] == 1.0
    assert agent.peak == val_batch_size


def test_no_validator_when_the_job_never_validates(data):
    cfg = job(data, "trainer.test_freq=0", "trainer.val_before_train=false")
    assert Validator.build(cfg.trainer, cfg.data, _CountingAgent(), [{"prompt": 0}]) is None


def test_a_local_ray_gets_the_replicas_gpus_and_the_trainer_the_next(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    cfg = SimpleNamespace(
        resources=SimpleNamespace(device="cuda", rollout_devices=7, trainer_devices=1,
                                  num_nodes=1),
        runtime=SimpleNamespace(ray_address="", trainer_in_driver=None),
    )  # fmt: skip
    assert split_gpus(cfg) == 7 and chosen == [7]  # Ray: GPUs 0-6; the trainer: GPU 7
    cfg.runtime.ray_address = "auto"  # a joined cluster has its own GPUs
    assert split_gpus(cfg) is None and chosen == [7]
    cfg.runtime.ray_address, cfg.resources.device = "", "cpu"
    assert split_gpus(cfg) is None and chosen == [7]
