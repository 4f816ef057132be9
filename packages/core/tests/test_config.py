"""Job config: loading YAML + overrides into the schema, and the one validation pass."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import pytest

from offbeat.core.config import (
    AsyncConfig,
    ConfigError,
    JobConfig,
    Problems,
    check,
    load_config,
    parse_overrides,
    validate,
)
from offbeat.core.registry import (
    ADV_ESTIMATORS,
    DEVICES,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    REWARD_FUNCTIONS,
    ROLLOUT_ENGINES,
    TRAIN_ENGINES,
)

# Names the default config uses; providers that are not part of this test's imports are
# registered as stand-ins for the duration of a test.
_DEFAULT_NAMES = [
    (DEVICES, "cpu"),
    (TRAIN_ENGINES, "fsdp2"),
    (ROLLOUT_ENGINES, "vllm"),
    (REWARD_FUNCTIONS, "task"),
    (ADV_ESTIMATORS, "grpo"),
    (LOSS_AGG_MODES, "token-mean"),
    (KL_ESTIMATORS, "k3"),
]


@pytest.fixture(autouse=True)
def default_names():
    added = []
    for reg, name in _DEFAULT_NAMES:
        if name not in reg:
            reg.register(name, object())
            added.append((reg, name))
    yield
    for reg, name in added:
        reg.unregister(name)


def good(**over) -> JobConfig:
    cfg = JobConfig()
    cfg.model.path = "some/model"
    for dotted, value in over.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def problems_of(cfg) -> dict[str, str]:
    with pytest.raises(ConfigError) as ei:
        validate(cfg)
    return {p.key: str(p) for p in ei.value.problems}


def test_default_config_with_a_model_is_valid():
    # Every rule runs on the defaults and the missing model is their only problem ...
    assert list(problems_of(JobConfig())) == ["model.path"]
    # ... so with a model the same validation passes them; it still sees every value.
    cfg = good()
    validate(cfg)
    cfg.data.train_batch_size += 1
    assert list(problems_of(cfg)) == ["data.train_batch_size"]


def test_missing_model_path_is_reported():
    cfg = JobConfig()
    assert "model.path" in problems_of(cfg)


def test_all_problems_reported_at_once_with_key_value_and_valid_choices():
    cfg = good(
        async_training__max_off_policy_threshold=0,
        async_training__max_off_policy_strategy="skip",
        data__train_batch_size=7,
        trainer__mode="colocated",
    )
    with pytest.raises(ConfigError) as ei:
        validate(cfg)
    msg = str(ei.value)
    assert "4 problems" in msg
    assert "async_training.max_off_policy_threshold=0: must be an int > 0" in msg
    assert "async_training.max_off_policy_strategy='skip': must be one of drop, wait" in msg
    assert "data.train_batch_size=7" in msg and "1 × 4 = 4" in msg
    assert "trainer.mode='colocated': must be one of sync, separate_async" in msg


@pytest.mark.parametrize("bad", [1.5, True, "2", -1])
def test_off_policy_threshold_must_be_positive_int(bad):
    probs = problems_of(good(async_training__max_off_policy_threshold=bad))
    assert list(probs) == ["async_training.max_off_policy_threshold"]


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("trace", "yes"),
        ("trace", 1),
        ("trace_steps", -1),
        ("trace_steps", 2.5),
        ("trace_steps", True),
    ],
)
def test_trace_keys_name_key_value_and_what_is_valid(key, bad):
    probs = problems_of(good(**{f"trainer__{key}": bad}))
    assert list(probs) == [f"trainer.{key}"]
    assert repr(bad) in probs[f"trainer.{key}"]


def test_trace_steps_is_rejected_where_trace_makes_it_unused():
    validate(good(trainer__trace=True))  # the default trace_steps is fine
    validate(good(trainer__trace=False, trainer__trace_steps=5))
    probs = problems_of(good(trainer__trace=True, trainer__trace_steps=5))
    assert list(probs) == ["trainer.trace_steps"]
    assert "ignored with trainer.trace=true" in probs["trainer.trace_steps"]


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_verbose_must_be_a_bool(bad):
    probs = problems_of(good(trainer__verbose=bad))
    assert list(probs) == ["trainer.verbose"]
    assert repr(bad) in probs["trainer.verbose"] and "logs" in probs["trainer.verbose"]


def test_verbose_loads_from_overrides():
    assert load_config(None, ["model.path=m"]).trainer.verbose is False
    cfg = load_config(None, ["trainer.verbose=true", "model.path=m"])
    assert cfg.trainer.verbose is True
    validate(cfg)


def test_trace_keys_load_from_overrides():
    cfg = load_config(None, ["trainer.trace=true", "model.path=m"])
    assert cfg.trainer.trace is True
    validate(cfg)
    cfg = load_config(None, ["trainer.trace_steps=0", "model.path=m"])
    assert cfg.trainer.trace is False and cfg.trainer.trace_steps == 0
    validate(cfg)


def test_train_batch_must_be_sync_steps_times_mini_batch():
    cfg = good(data__train_batch_size=12, actor__ppo_mini_batch_size=4)
    cfg.async_training.parameter_sync_step = 3
    validate(cfg)
    cfg.async_training.parameter_sync_step = 2
    probs = problems_of(cfg)
    assert "2 × 4 = 8" in probs["data.train_batch_size"]


def test_resource_split_must_add_up_and_be_positive():
    cfg = good(resources__trainer_devices=2)  # 2 + 1 != 1 × 2
    probs = problems_of(cfg)
    key = "resources.trainer_devices+resources.rollout_devices"
    assert "must equal resources.num_nodes × resources.devices_per_node = 2" in probs[key]
    cfg = good(resources__trainer_devices=0, resources__rollout_devices=2)
    assert list(problems_of(cfg)) == ["resources.trainer_devices"]


def test_rollout_devices_divisible_by_rollout_tp():
    cfg = good(resources__devices_per_node=8, resources__trainer_devices=5)
    cfg.resources.rollout_devices = 3
    cfg.rollout.tensor_parallel_size = 2
    probs = problems_of(cfg)
    assert "multiple of rollout.tensor_parallel_size=2" in probs["resources.rollout_devices"]


def test_trainer_devices_divisible_by_tp_times_pp():
    # A model-parallel engine (a stand-in: fsdp2 has no tp/pp, and more than one trainer
    # device is not built yet, so those problems are expected beside this one).
    TRAIN_ENGINES.register("megatron-standin", object())
    try:
        cfg = good(resources__devices_per_node=8, resources__trainer_devices=6)
        cfg.actor.engine = "megatron-standin"
        cfg.resources.rollout_devices = 2
        cfg.actor.tensor_model_parallel_size = 2
        cfg.actor.pipeline_model_parallel_size = 2
        with pytest.raises(ConfigError) as ei:
            validate(cfg)
        msgs = [str(p) for p in ei.value.problems if p.key == "resources.trainer_devices"]
        assert any("= 4" in m for m in msgs), msgs
        cfg.resources.trainer_devices, cfg.resources.rollout_devices = 4, 4
        with pytest.raises(ConfigError) as ei:
            validate(cfg)
        assert not any("= 4" in str(p) for p in ei.value.problems), str(ei.value)
    finally:
        TRAIN_ENGINES.unregister("megatron-standin")


def test_mini_batch_must_split_over_data_parallel_ranks():
    cfg = good(resources__devices_per_node=4, resources__trainer_devices=3)
    cfg.rollout.n = 1  # 4 trajectories over 3 DP ranks
    assert "3 data-parallel" in problems_of(cfg)["actor.ppo_mini_batch_size"]


def test_rollout_seed_is_null_or_an_int_at_least_0():
    validate(good(rollout__seed=0))
    validate(good())  # null: the engine's own RNG
    for bad in (-1, "7", 1.5):
        assert "must be an int >= 0" in problems_of(good(rollout__seed=bad))["rollout.seed"]


def test_unknown_registry_names_list_registered_ones():
    cfg = good(actor__engine="deepspeed", rollout__engine="trt", algorithm__loss_agg_mode="x")
    cfg.resources.device = "tpu"
    probs = problems_of(cfg)
    assert "unknown train engine; registered:" in probs["actor.engine"]
    assert "fsdp2" in probs["actor.engine"]
    assert "vllm" in probs["rollout.engine"]
    assert "token-mean" in probs["algorithm.loss_agg_mode"]
    assert "cpu" in probs["resources.device"]


def test_rollout_correction_needs_trainer_log_probs():
    cfg = good(algorithm__rollout_is_level="token")
    assert "old_log_prob_source='trainer'" in problems_of(cfg)["algorithm.rollout_is_level"]
    cfg.algorithm.old_log_prob_source = "trainer"
    validate(cfg)


def test_added_check_runs_and_collects(monkeypatch):
    from offbeat.core.config import validation as validate_mod

    monkeypatch.setattr(validate_mod, "_CHECKS", list(validate_mod._CHECKS))

    @check
    def _extra(cfg, p: Problems) -> None:
        p.add("trainer.experiment_name", cfg.trainer.experiment_name, "must not be 'default'")

    assert "trainer.experiment_name" in problems_of(good())


# -- loading ---------------------------------------------------------------------------


def test_load_yaml_and_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        textwrap.dedent(
            """
            model: {path: tiny}
            rollout:
              n: 2
              engine_kwargs: {enforce_eager: true, max_model_len: 1024}
            async_training: {max_off_policy_strategy: wait}
            """
        )
    )
    from offbeat.core.tasks import make_rows, write_parquet

    # validation reads the data files: they must exist, be parquet, and name scored sources
    a = write_parquet(make_rows("add", 2), tmp_path / "a.parquet")
    b = write_parquet(make_rows("reverse", 2), tmp_path / "b.parquet")
    cfg = load_config(path, ["rollout.n=8", f"+data.train_files=[{a},{b}]"])
    assert isinstance(cfg, JobConfig) and isinstance(cfg.async_training, AsyncConfig)
    assert cfg.rollout.n == 8
    assert cfg.rollout.engine_kwargs == {"enforce_eager": True, "max_model_len": 1024}
    assert cfg.async_training.max_off_policy_strategy == "wait"
    assert cfg.data.train_files == [str(a), str(b)]
    assert cfg.model.path == "tiny"
    validate(cfg)


def test_load_collects_type_errors_and_unknown_keys(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("actor: {lrr: 0.1, ppo_epochs: many}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(path, ["async_training.max_off_policy_threshold=1.5", "nosuch=1"])
    by_key = {p.key: p.expected for p in ei.value.problems}
    assert set(by_key) == {
        "actor.lrr",
        "actor.ppo_epochs",
        "async_training.max_off_policy_threshold",
        "nosuch",
    }
    assert "valid keys:" in by_key["actor.lrr"] and "lr" in by_key["actor.lrr"]
    assert "Integer" in by_key["async_training.max_off_policy_threshold"]


@dataclass
class MyAsync(AsyncConfig):
    staleness_window: int = 3


@dataclass
class MyJob(JobConfig):
    async_training: MyAsync = field(default_factory=MyAsync)


def test_load_with_extended_schema():
    cfg = load_config(None, ["async_training.staleness_window=5"], schema=MyJob)
    assert cfg.async_training.staleness_window == 5


def test_parse_overrides_rejects_malformed():
    assert parse_overrides(["a.b=1", "++c=[x, 2]", "d=null"]) == [
        ("a.b", 1),
        ("c", ["x", 2]),
        ("d", None),
    ]
    with pytest.raises(ConfigError, match=r"key\.sub=value"):
        parse_overrides(["justakey"])


def test_actor_lr_schedule_is_checked_and_reaches_the_engine():
    from offbeat.core.train.fsdp2 import actor_engine_config
    from offbeat.core.train.optim import lr_factor

    cfg = good(actor__lr=1e-3, actor__lr_schedule="cosine", actor__min_lr_ratio=0.1)
    validate(cfg)
    optim = actor_engine_config(cfg).optim
    assert optim.lr_schedule == "cosine" and optim.min_lr_ratio == 0.1
    updates = (
        cfg.trainer.total_training_steps
        * cfg.async_training.parameter_sync_step
        * cfg.actor.ppo_epochs
    )
    assert optim.total_updates == updates
    assert lr_factor(optim, 0) == pytest.approx(1.0)
    assert lr_factor(optim, updates) == pytest.approx(0.1)  # the last update's LR
    found = problems_of(good(actor__lr_schedule="linear", actor__min_lr_ratio=2.0))
    assert "cosine" in found["actor.lr_schedule"] and "actor.min_lr_ratio" in found


@pytest.mark.parametrize(
    "over, key, phrase",
    [
        ({"actor__lr": 0.0}, "actor.lr", "actor.lr=0.0: must be > 0"),
        ({"actor__weight_decay": -0.1}, "actor.weight_decay", "must be a number in [0.0, inf]"),
        ({"actor__clip_ratio_low": 1.0}, "actor.clip_ratio_low", "must be < 1"),
        ({"model__dtype": "fp16"}, "model.dtype", "must be one of float32, bfloat16, float16"),
        ({"actor__lr_schedule": "cosine", "actor__lr_warmup_steps": 10}, "actor.lr_warmup_steps",
         "must be < the run's 10 updates"),
    ],
)  # fmt: skip
def test_what_the_train_engine_would_reject_is_rejected_before_it_starts(over, key, phrase):
    """The engine's own config check (FSDP2Config / OptimConfig / PPOLossConfig.validate)
    runs when a rank builds it, after the job started: every job key it would reject is a
    config problem first, named with its job key."""
    found = problems_of(good(**over))
    assert phrase in found[key], found
