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
        ("reward.functions.my_source=no_such_module_xyz:fn", "reward.functions.my_source"),
        ("runtime.rollout_cpus=[4096]", "runtime.rollout_cpus"),
        ("runtime.rollout_cpus=[0,1]", "runtime.rollout_cpus"),  # core 1 is the trainer's
        ("runtime.rollout_cpus=[0,0]", "runtime.rollout_cpus"),
    ],
)
def test_invalid_config_names_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", [override])
    assert key in {p.key for p in info.value.problems}, str(info.value)


@pytest.mark.parametrize(
    "override",
    [
        "runtime.max_failed_batches=0",
        "runtime.max_failed_batches=1.5",
        "trainer.stall_timeout_s=-1",
    ],
)
def test_rollout_failure_limits_are_checked(override):
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", [override])
    problems = {p.key: p for p in info.value.problems}
    assert key in problems, str(info.value)
    assert float(problems[key].value) == float(value)


def test_stall_timeout_off_and_its_old_key():
    for off in ("null", "0"):
        _, cfg = load_recipe_config("separate_async", [f"trainer.stall_timeout_s={off}"])
        assert not cfg.trainer.stall_timeout_s
    _, cfg = load_recipe_config("separate_async", [])
    assert cfg.trainer.stall_timeout_s == 600.0  # the documented default
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", ["trainer.stall_timeout_s=-1"])
    assert "seconds > 0" in str(info.value) and "null / 0" in str(info.value)
    with pytest.raises(ConfigError, match=r"runtime\.stall_timeout_s=900: moved: set "
                       r"trainer\.stall_timeout_s instead"):  # fmt: skip
        load_recipe_config("separate_async", ["runtime.stall_timeout_s=900"])


@pytest.mark.parametrize(
    ("overrides", "shorter"),
    [
        (["trainer.stall_timeout_s=120"], "runtime.sync_timeout_s"),  # default sync 300 s
        (["trainer.stall_timeout_s=20", "runtime.sync_timeout_s=10"], "reward.timeout_s"),
        (["trainer.stall_timeout_s=300"], "runtime.sync_timeout_s"),  # equal: a race
    ],
)
def test_a_stall_timeout_not_longer_than_the_runs_deadlines_is_refused(overrides, shorter):
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", overrides)
    (problem,) = [p for p in info.value.problems if p.key == "trainer.stall_timeout_s"]
    text = str(info.value)
    assert problem.value == float(overrides[0].partition("=")[2])
    assert "must be longer than the run's own deadlines, which must fire first" in text
    sync = overrides[1].partition("=")[2] if len(overrides) > 1 else "300"
    assert f"runtime.sync_timeout_s={sync} and reward.timeout_s=30" in text
    assert f"(or lower {shorter})" in text and "or null / 0 (no stall watchdog)" in text
    # above both it passes, and so does a watchdog that is off
    _, cfg = load_recipe_config("separate_async", [*overrides[1:], "trainer.stall_timeout_s=301"])
    assert cfg.trainer.stall_timeout_s == 301
    load_recipe_config("separate_async", [*overrides, "trainer.stall_timeout_s=null"])


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


# Accepted means it runs: what the runtime does not honour is rejected naming the key, the
# value and what is missing or valid (offbeat.core.config.support and
# offbeat.core.trainer.runtime_checks).
NOT_HONOURED = [
    (  # a critic of its own takes a device of its own: 1 + 1 + 1 on 2 devices
        ["algorithm.adv_estimator=gae", "critic.placement=separate"],
        "resources.trainer_devices+resources.rollout_devices+critic.devices",
        "must equal resources.num_nodes × resources.devices_per_node = 2",
    ),
    (
        [
            "algorithm.use_kl_loss=true",
            "ref.placement=separate",
            "resources.devices_per_node=3",
            "runtime.trainer_in_driver=true",
        ],
        "runtime.trainer_in_driver",
        "ref.placement=separate starts worker groups",
    ),
    (
        ["algorithm.adv_estimator=gae", "critic.placement=separate", "critic.devices=0"],
        "critic.devices",
        "must be an int > 0",
    ),
    (
        ["algorithm.use_kl_loss=true", "ref.devices=2"],
        "ref.devices",
        "only read with ref.placement=separate",
    ),
    (["critic.devices=2"], "critic.devices", "nothing reads critic.*"),
    (["ref.param_offload=true"], "ref.param_offload", "nothing reads ref.*"),
    (
        ["algorithm.use_kl_loss=true", "ref.param_offload=true"],
        "ref.param_offload",
        "resources.device=cpu keeps every weight in host memory",
    ),
    (["algorithm.kl_ctrl.type=adaptive"], "algorithm.kl_ctrl.type", "use_kl_in_reward=true"),
    (
        ["algorithm.use_kl_loss=true", "ref.log_prob_micro_batch_size_per_device=0"],
        "ref.log_prob_micro_batch_size_per_device",
        "must be an int > 0",
    ),
    (["algorithm.kl_penalty=k3"], "algorithm.kl_penalty", "use_kl_in_reward=true"),
    (
        ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.target_kl=0.5"],
        "algorithm.kl_ctrl.target_kl",
        "only the adaptive controller",
    ),
    (["algorithm.kl_clamp=5.0"], "algorithm.kl_clamp", "use_kl_in_reward=true"),
    (
        ["algorithm.adv_estimator=gae", "critic.model_path=/no/such/critic"],
        "critic.model_path",
        "an existing HF model directory",
    ),
    (["algorithm.adv_estimator=gae", "critic.lr=0"], "critic.lr", "must be > 0"),
    (
        ["actor.tensor_model_parallel_size=2"],
        "actor.tensor_model_parallel_size",
        "fsdp2 has no tensor/pipeline parallelism",
    ),
    (
        ["actor.pipeline_model_parallel_size=2"],
        "actor.pipeline_model_parallel_size",
        "use actor.engine=megatron (offbeat-backend-megatron)",
    ),
    (["algorithm.gamma=0.99"], "algorithm.gamma", "only GAE"),
    (["algorithm.lam=0.95"], "algorithm.lam", "only GAE"),
    (["critic.lr=2e-5"], "critic.lr", "nothing reads critic.*"),
    (["critic.model_path=/models/critic"], "critic.model_path", "nothing reads critic.*"),
    (["critic.placement=separate"], "critic.placement", "nothing reads critic.*"),
    (["algorithm.kl_loss_coef=0.1"], "algorithm.kl_loss_coef", "use_kl_loss=true"),
    (["algorithm.rollout_is_threshold=3.0"], "algorithm.rollout_is_threshold", "token or sequence"),
    (
        ["algorithm.adv_estimator=rloo", "algorithm.norm_adv_by_std_in_grpo=false"],
        "algorithm.norm_adv_by_std_in_grpo",
        "'rloo' ignores it",
    ),
    (
        [
            "resources.devices_per_node=3",
            "resources.trainer_devices=2",
            "runtime.trainer_in_driver=true",
        ],
        "runtime.trainer_in_driver",
        "runs as a worker group",
    ),
    (  # trainer and replicas may be on different nodes: shm cannot reach across
        ["resources.num_nodes=2", "resources.rollout_devices=3"],
        "runtime.ckpt_backend",
        "'shm' moves weights within one machine only; use broadcast",
    ),
    (
        ["resources.num_nodes=2", "resources.rollout_devices=3", "runtime.ckpt_backend=disk"],
        "runtime.ckpt_backend",
        "without options that cross machines",
    ),
    (["runtime.trainer_num_cpus=0"], "runtime.trainer_num_cpus", "a number > 0"),
    (
        ["runtime.trainer_resources={GPU: 1}"],
        "runtime.trainer_resources.GPU",
        "a custom Ray resource name",
    ),
    (["runtime.ckpt_backend=naive"], "runtime.ckpt_backend", "Ray actor of its own"),
    (["runtime.ckpt_backend=cuda_ipc"], "runtime.ckpt_backend", "needs resources.device in"),
    (["runtime.rollout_num_gpus=1"], "runtime.rollout_num_gpus", "the replicas run on CPU"),
    (["resources.device=npu"], "resources.device", "offbeat-device-ascend[npu]"),
    (["rollout.engine_kwargs.dtype=bfloat16"], "rollout.engine_kwargs.dtype", "model.dtype"),
    (
        ["rollout.engine_kwargs.hf_overrides={rope_theta: 1.0}"],
        "rollout.engine_kwargs.hf_overrides",
        "model.override_config",
    ),
    (["model.override_config={no_such_field: 1}"], "model.override_config", "no_such_field"),
    (["runtime.rollout_env={}"], "runtime.rollout_env", "changes nothing"),
    (["warm_start.enabled=true", "warm_start.steps=0"], "warm_start.steps", "needs steps > 0"),
    (["trainer.total_epochs=1", "task.n_train=31"], "trainer.total_epochs", "no whole batch"),
    (
        ["runtime.ray_address=auto", "runtime.ray_num_cpus=16"],
        "runtime.ray_num_cpus",
        "only read when the job starts a local Ray",
    ),
    # hybrid replicas, against the resource split
    (
        ["trainer.validate_on_trainer_devices=true"],
        "runtime.ray_num_cpus",
        ">= 3: with trainer.validate_on_trainer_devices=true each of the 1 trainer bundles",
    ),
    (
        [
            "trainer.validate_on_trainer_devices=true",
            "runtime.ray_num_cpus=3",
            "runtime.trainer_in_driver=true",
        ],
        "trainer.validate_on_trainer_devices",
        "a trainer pool for the hybrid replicas to live in",
    ),
    (
        [
            "trainer.validate_on_trainer_devices=true",
            "runtime.ray_num_cpus=3",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
        ],
        "trainer.validate_on_trainer_devices",
        "validation to serve",
    ),
    (
        [
            "trainer.validate_on_trainer_devices=true",
            "runtime.ray_num_cpus=4",
            "resources.devices_per_node=3",
            "rollout.tensor_parallel_size=2",
            "resources.rollout_devices=2",
        ],
        "trainer.validate_on_trainer_devices",
        "rollout.tensor_parallel_size=1",
    ),
    (
        [
            "trainer.validate_on_trainer_devices=true",
            "runtime.ray_num_cpus=3",
            "trainer.hybrid_sleep_level=3",
        ],
        "trainer.hybrid_sleep_level",
        "1 (free the KV cache, offload the weights) or 2",
    ),
    (["trainer.hybrid_sleep_level=1"], "trainer.hybrid_sleep_level", "nothing else reads it"),
    (["runtime.replica_replace_attempts=-1"], "runtime.replica_replace_attempts", ">= 0"),
    (["runtime.replica_replace_backoff_s=0"], "runtime.replica_replace_backoff_s", "> 0"),
]


@pytest.mark.parametrize(
    "overrides, key, phrase", NOT_HONOURED, ids=[c[1] + ":" + c[0][-1] for c in NOT_HONOURED]
)
def test_what_the_runtime_does_not_honour_is_rejected(overrides, key, phrase):
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", overrides)
    mine = [str(p) for p in info.value.problems if p.key == key]
    assert mine, str(info.value)
    assert any(phrase in m for m in mine), mine


@pytest.mark.parametrize(
    "overrides",
    [
        ["resources.devices_per_node=3", "resources.trainer_devices=2"],  # a worker group
        ["resources.devices_per_node=5", "resources.trainer_devices=4",
         "runtime.trainer_num_cpus=0.5"],
        ["resources.num_nodes=2", "resources.devices_per_node=1", "runtime.ckpt_backend=broadcast",
         "runtime.trainer_resources={trainer_node: 1}"],
        ["trainer.validate_on_trainer_devices=true", "runtime.ray_num_cpus=3",
         "trainer.hybrid_sleep_level=1"],
        ["runtime.replica_replace_attempts=0"],
    ],
)  # fmt: skip
def test_what_the_runtime_honours_is_accepted(overrides):
    load_recipe_config("separate_async", overrides)


def test_gae_and_kl_are_accepted_with_a_critic_and_a_reference():
    load_recipe_config(
        "separate_async",
        ["algorithm.adv_estimator=gae", "algorithm.gamma=0.99", "algorithm.lam=0.95",
         "critic.lr=1e-4", "critic.ppo_epochs=2", "algorithm.use_kl_loss=true",
         "algorithm.kl_loss_type=k2", "algorithm.use_kl_in_reward=true",
         "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.05"],
    )  # fmt: skip


def test_gae_without_a_critic_engine_and_kl_without_a_reference_name_what_is_missing(monkeypatch):
    """A train engine that builds neither a value model nor a reference policy: `check`
    names the missing piece and the engines that have it."""
    from offbeat.core.registry import TRAIN_ENGINES
    from offbeat.core.train import FSDP2TrainEngine

    class PolicyOnly:  # a registered engine with neither builder
        from_job_config = FSDP2TrainEngine.from_job_config

    TRAIN_ENGINES.register("policy_only", PolicyOnly)
    try:
        with pytest.raises(ConfigError) as info:
            load_recipe_config(
                "separate_async",
                ["algorithm.adv_estimator=gae", "critic.engine=policy_only",
                 "algorithm.use_kl_loss=true", "actor.engine=policy_only"],
            )  # fmt: skip
    finally:
        TRAIN_ENGINES.unregister("policy_only")
    by_key = {p.key: p.expected for p in info.value.problems}
    assert "needs a critic (value model)" in by_key["algorithm.adv_estimator"]
    assert "critic.engine='policy_only' builds none" in by_key["algorithm.adv_estimator"]
    assert "engines that do: fsdp2" in by_key["algorithm.adv_estimator"]
    assert "needs a reference model" in by_key["algorithm.use_kl_loss"]
    assert "actor.engine='policy_only'" in by_key["algorithm.use_kl_loss"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.adv_estimator=gae", "resources.devices_per_node=3",
         "resources.trainer_devices=2"],
        ["algorithm.use_kl_loss=true", "runtime.trainer_in_driver=false"],
        ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true",
         "runtime.trainer_in_driver=false"],
    ],
)  # fmt: skip
def test_a_critic_and_reference_beside_a_trainer_worker_group_are_accepted(overrides):
    """The group's ranks build the critic and the reference beside the actor: `check`
    accepts them, and the ranks are told to build exactly what the algorithm reads."""
    from offbeat.core.runtime import group_roles, trainer_in_driver

    _, cfg = load_recipe_config("separate_async", overrides)
    assert trainer_in_driver(cfg) is False
    want = ["actor"]
    if cfg.algorithm.adv_estimator == "gae":
        want.append("critic")
    if cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        want.append("reference")
    assert list(group_roles(cfg)) == want


def test_a_critic_and_reference_in_groups_of_their_own_get_pools_of_their_own():
    from offbeat.core.runtime import group_roles, pool_specs, trainer_in_driver

    _, cfg = load_recipe_config(
        "separate_async",
        ["algorithm.adv_estimator=gae", "critic.placement=separate", "critic.devices=2",
         "algorithm.use_kl_loss=true", "ref.placement=separate", "resources.devices_per_node=5",
         "runtime.ray_num_cpus=5"],
    )  # fmt: skip
    assert trainer_in_driver(cfg) is False  # null (auto): the actor is a worker group too
    assert group_roles(cfg) == ("actor",)  # the actor's ranks hold neither
    specs = {s.name: s for s in pool_specs(cfg)}
    assert list(specs) == ["trainer", "rollout", "critic", "reference"]
    assert specs["critic"].bundles == 2 and specs["reference"].bundles == 1
    assert dict(specs["critic"].bundle) == dict(specs["trainer"].bundle) == {"CPU": 1.0}


def test_hybrid_replicas_put_the_trainer_in_a_pool_with_room_for_them():
    from offbeat.core.runtime import pool_specs, trainer_in_driver

    _, cfg = load_recipe_config(
        "separate_async", ["trainer.validate_on_trainer_devices=true", "runtime.ray_num_cpus=3"]
    )
    assert trainer_in_driver(cfg) is False  # null (auto) gives a trainer pool here
    specs = {s.name: s for s in pool_specs(cfg)}
    assert dict(specs["trainer"].bundle) == {"CPU": 2.0}  # the rank's CPU + its hybrid's
    assert specs["trainer"].bundles == 1 and dict(specs["rollout"].bundle) == {"CPU": 1.0}


def test_cuda_is_rejected_on_a_machine_without_it(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", ["resources.device=cuda"])
    by_key = {p.key: str(p) for p in info.value.problems}
    assert "torch.cuda.is_available() is False" in by_key["resources.device"]
    assert "OFFBEAT_STACK=gpu" in by_key["resources.device"]
    # ...and the replicas would get no GPU: the YAML gives them 0.
    assert "each replica is given its" in by_key["runtime.rollout_num_gpus"]


def test_cuda_without_gpus_for_the_replicas_is_rejected_where_cuda_exists(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", ["resources.device=cuda"])
    assert [p.key for p in info.value.problems] == ["runtime.rollout_num_gpus"], str(info.value)
    load_recipe_config("separate_async", ["resources.device=cuda", "runtime.rollout_num_gpus=1"])
    with pytest.raises(ConfigError, match="this machine has 2 visible CUDA devices"):
        load_recipe_config(
            "separate_async",
            ["resources.device=cuda", "runtime.rollout_num_gpus=1", "resources.devices_per_node=4",
             "resources.rollout_devices=3"],
        )  # fmt: skip


def test_one_gpu_shared_by_the_trainer_and_the_replica(monkeypatch):
    """runtime.share_trainer_gpu: one GPU (devices_per_node still counts it twice) passes
    with a replica share below the whole GPU; the trainer in the driver takes the last
    replica's GPU; a share that leaves the trainer nothing, or a trainer outside the
    driver, is refused."""
    import torch

    from offbeat.core.runtime.host import split_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    one_gpu = ["resources.device=cuda", "runtime.rollout_num_gpus=1", "runtime.trainer_cpus=[]",
               "runtime.rollout_cpus=[]", "runtime.share_trainer_gpu=true"]  # fmt: skip
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", one_gpu)  # the replica would take it all
    assert [p.key for p in info.value.problems] == ["rollout.engine_kwargs.gpu_memory_utilization"]
    _, cfg = load_recipe_config(
        "separate_async", [*one_gpu, "+rollout.engine_kwargs.gpu_memory_utilization=0.4"]
    )
    assert split_gpus(cfg) == 1 and chosen == [0]  # Ray: GPU 0; the trainer: GPU 0 too
    with pytest.raises(ConfigError, match="the trainer in the driver"):
        load_recipe_config(
            "separate_async",
            [*one_gpu, "+rollout.engine_kwargs.gpu_memory_utilization=0.4",
             "runtime.trainer_in_driver=false"],
        )  # fmt: skip


def test_one_gpu_holds_the_trainer_rank_its_hybrid_replica_and_the_replica(monkeypatch):
    """runtime.share_trainer_gpu with hybrid replicas: the trainer is a worker group, and one
    GPU holds its one rank, the rank's hybrid replica and the one standalone replica. The
    trainer and rollout bundles each hold half the GPU; the rank takes 3/4 of its half, the
    hybrid replica 1/4, the replica its whole half. The two engines' memory shares must
    leave the trainer its part (together <= 0.9); more ranks or replicas are refused."""
    import torch

    from offbeat.core.runtime import pool_specs, trainer_in_driver
    from offbeat.core.runtime.host import split_gpus
    from offbeat.core.runtime.launch import _rank_options, hybrid_options, replica_options

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    hybrid_one_gpu = [
        "resources.device=cuda", "resources.devices_per_node=2", "runtime.rollout_num_gpus=1",
        "runtime.trainer_cpus=[]", "runtime.rollout_cpus=[]", "runtime.share_trainer_gpu=true",
        "trainer.validate_on_trainer_devices=true", "runtime.ray_num_cpus=8",
        "runtime.rollout_num_cpus=2",
    ]  # fmt: skip
    _, cfg = load_recipe_config(
        "separate_async", [*hybrid_one_gpu, "+rollout.engine_kwargs.gpu_memory_utilization=0.3"]
    )
    assert trainer_in_driver(cfg) is False and split_gpus(cfg) is None  # Ray sees the GPU
    specs = {s.name: s for s in pool_specs(cfg)}
    assert dict(specs["trainer"].bundle) == {"GPU": 0.5, "CPU": 3.0}  # rank + hybrid CPUs
    assert dict(specs["rollout"].bundle) == {"GPU": 0.5, "CPU": 2.0}

    class Pools:
        def __init__(self) -> None:
            self.specs, self.groups = specs, dict.fromkeys(specs)

        def strategy(self, pool: str, index: int) -> str:
            return f"{pool}-{index}"

        def bundle_order(self, pool: str) -> list[int]:
            return list(range(specs[pool].bundles))

    pools = Pools()
    (rank,) = _rank_options(cfg, pools)
    hybrid = hybrid_options(cfg, pools, 0)
    replica = replica_options(pools, 0)
    assert (rank["num_gpus"], hybrid["num_gpus"], replica["num_gpus"]) == (0.375, 0.125, 0.5)
    assert rank["num_gpus"] + hybrid["num_gpus"] + replica["num_gpus"] == 1.0
    assert replica["scheduling_strategy"] == "rollout-0"
    # both engines awake (a validation): 2 x 0.5 of the GPU would leave the trainer nothing
    with pytest.raises(ConfigError) as info:
        load_recipe_config(
            "separate_async",
            [*hybrid_one_gpu, "+rollout.engine_kwargs.gpu_memory_utilization=0.5"],
        )
    (problem,) = info.value.problems
    assert problem.key == "rollout.engine_kwargs.gpu_memory_utilization"
    assert "each take it, together at most 0.9" in str(problem) and "at most 0.45" in str(problem)
    # two trainer ranks or two replicas are more than one GPU holds
    for more in (["resources.trainer_devices=2", "resources.devices_per_node=3"],
                 ["resources.rollout_devices=2", "resources.devices_per_node=3"]):  # fmt: skip
        with pytest.raises(ConfigError, match="puts everything on one GPU") as info:
            load_recipe_config(
                "separate_async",
                [*hybrid_one_gpu, "+rollout.engine_kwargs.gpu_memory_utilization=0.3", *more],
            )
        assert "runtime.share_trainer_gpu" in [p.key for p in info.value.problems]
    # without hybrid replicas the replica alone may take up to 0.9, as before
    _, cfg = load_recipe_config(
        "separate_async",
        [*hybrid_one_gpu[:-3], "+rollout.engine_kwargs.gpu_memory_utilization=0.9"],
    )
    assert trainer_in_driver(cfg) and dict(pool_specs(cfg, trainer=False)[0].bundle)["GPU"] == 1


def test_npu_without_the_plugin_names_the_package(monkeypatch):
    from offbeat.core.registry import DEVICES

    monkeypatch.setattr(DEVICES, "_entry_points", lambda: {})  # offbeat-device-ascend absent
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", ["resources.device=npu"])
    (problem,) = [p for p in info.value.problems if p.key == "resources.device"]
    assert "unknown device" in problem.expected
    assert "offbeat-device-ascend[npu]" in problem.expected and "torch-npu" in problem.expected


@pytest.mark.e2e
def test_offbeat_check_lists_data_sources_without_a_reward(tmp_path):
    """The data_source rule is registered in a fresh `offbeat check` process."""
    from offbeat.core.tasks import write_parquet

    rows = [
        {"prompt": "q", "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "1"}},
        {"prompt": "q", "data_source": "my/unscored", "reward_model": {"ground_truth": "2"}},
    ]
    path = write_parquet(rows, tmp_path / "train.parquet")
    cmd = [
        sys.executable, "-c", "import sys; from offbeat.core.cli import main; sys.exit(main())",
        "check", "separate_async", f"data.train_files=[{path}]",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"data.train_files='{path}'" in proc.stderr
    assert "'my/unscored' (1 row)" in proc.stderr and "'openai/gsm8k'" in proc.stderr


@pytest.mark.e2e
def test_offbeat_check_rejects_prompts_longer_than_max_prompt_length():
    """The prompt-length rule is registered in a fresh `offbeat check` process: the recipe's
    verl example file has prompts longer than the default data.max_prompt_length=64."""
    from pathlib import Path

    path = Path(__file__).parents[1] / "recipes/separate_async/data/verl_example.parquet"
    cmd = [
        sys.executable, "-c", "import sys; from offbeat.core.cli import main; sys.exit(main())",
        "check", "separate_async", f"data.train_files=[{path}]",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "data.max_prompt_length=64:" in proc.stderr, proc.stderr
    assert "12 of 12 prompts in verl_example.parquet" in proc.stderr, proc.stderr
    assert "set data.max_prompt_length>=185" in proc.stderr, proc.stderr


# ---- dataset files and rows that cannot be used (issue 31, item 6) -------------------------
def _rows_file(path, prompts, truths=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(prompts)
    columns = {"prompt": prompts, "data_source": ["openai/gsm8k"] * n}
    columns["ground_truth"] = truths if truths is not None else ["1"] * n
    pq.write_table(pa.table(columns), path)
    return str(path)


def _not_utf8(raw):
    import pyarrow as pa

    return pa.array([b"fine", raw, b"fine"], pa.binary()).view(pa.string())


def _truncated(path):
    from pathlib import Path

    whole = _rows_file(path.with_suffix(".whole"), ["q"] * 50)
    data = Path(whole).read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return str(path)


FILE_CASES = {  # name -> (make the file under a path, what the message says)
    "not_parquet": (lambda p: p.write_text("id,prompt\n1,q\n") and str(p), "it is not parquet, or truncated"),
    "truncated": (_truncated, "it is not parquet, or truncated"),
    "zero_bytes": (lambda p: p.write_bytes(b"") or str(p), "it is empty (0 bytes), not parquet"),
    "zero_rows": (lambda p: _rows_file(p, []), "a parquet file with at least one row (train.parquet has 0)"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_offbeat_check_rejects_a_file_that_cannot_be_read(tmp_path, case):
    make, said = FILE_CASES[case]
    path = make(tmp_path / "train.parquet")
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", [f"data.train_files=[{path}]"])
    problems = [p for p in info.value.problems if p.key == "data.train_files" and p.value == path]
    assert problems and said in problems[0].expected, str(info.value)
    if case != "zero_rows":
        assert "train.parquet: " + said in problems[0].expected


ROW_CASES = {  # name -> (prompts, ground truths or None, what the message says about row 1)
    "null_prompt": (["q", None, "q"], None, "row 1: 'prompt' is null"),
    "message_without_content": (
        [[{"role": "user", "content": "q"}], [{"role": "user", "content": None}], [{"role": "user", "content": "q"}]],
        None, "row 1: 'prompt' message 0 (role 'user') has no 'content'"),
    "null_ground_truth": (["q", "q", "q"], ["1", None, "1"], "row 1: the ground truth is null"),
    "invalid_utf8": (_not_utf8(b"bad\xff"), None, "row 1: column 'prompt' is not valid UTF-8"),
    "surrogate_cesu8": (_not_utf8(b"\xed\xa0\x80"), None, "row 1: column 'prompt' is not valid UTF-8"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(ROW_CASES))
def test_offbeat_check_names_the_file_and_row_of_a_bad_row(tmp_path, case):
    prompts, truths, said = ROW_CASES[case]
    path = _rows_file(tmp_path / "train.parquet", prompts, truths)
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", [f"data.train_files=[{path}]"])
    (problem,) = [p for p in info.value.problems if p.key == "data.train_files"]
    assert problem.value == path
    assert "1 of the 3 rows read in train.parquet cannot" in problem.expected, problem.expected
    assert said in problem.expected, problem.expected


def test_a_file_of_good_rows_passes_the_row_rule(tmp_path):
    path = _rows_file(tmp_path / "train.parquet", ["q", "q"])
    load_recipe_config("separate_async", [f"data.train_files=[{path}]"])


@pytest.mark.parametrize(
    "override", ["reward.timeout_s=0", "reward.timeout_s=-1", "agent.tool_max_chars=0"]
)
def test_user_code_limits_are_checked(override):
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", [override])
    problems = {p.key: p for p in info.value.problems}
    assert key in problems, str(info.value)
    assert float(problems[key].value) == float(value)


def test_offbeat_check_names_each_bad_image_row(tmp_path):
    """`offbeat check separate_async_vlm` on a file of image rows: a missing image file,
    an undecodable image and an image count unlike the placeholders' are named by row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from offbeat.core.tasks.visual import make_visual_rows

    rows = make_visual_rows(5, seed=3)
    rows[1]["images"] = [{"bytes": None, "path": str(tmp_path / "gone.png")}]
    rows[2]["images"] = [{"bytes": b"not an image", "path": None}]
    rows[4]["images"] = rows[4]["images"] * 2  # two images, one placeholder
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async_vlm", [f"data.train_files=[{path}]"])
    (problem,) = [p for p in info.value.problems if p.key == "data.train_files"]
    said = problem.expected
    assert "3 of the 5 rows read in train.parquet cannot" in said, said
    assert "row 1:" in said and "does not exist" in said
    assert "row 2:" in said and "undecodable image" in said
    assert "row 4:" in said and "2 image(s)" in said and "1 placeholder(s)" in said
    assert "row 0:" not in said and "row 3:" not in said
