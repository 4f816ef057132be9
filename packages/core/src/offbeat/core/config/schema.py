"""The job config: one typed dataclass per component, composed by `JobConfig`.

These dataclasses are Hydra/OmegaConf structured configs: a recipe YAML fills them and
OmegaConf type-checks every value on merge. They hold values only; the cross-field rules
(a resource split that adds up, batch sizes that divide, names that exist in a registry)
live in `validation.py`, run once before anything starts.

To extend: add a field with a default to the component's dataclass (old YAMLs keep
working) and, if it has a rule, a check with `@check` in `validation.py` or your own module.
Batch sizes are counted in *prompts* (groups) unless the name says `trajectories`; each
prompt yields `rollout.n` trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "AsyncConfig",
    "CriticConfig",
    "DataConfig",
    "JobConfig",
    "KLControlConfig",
    "ModelConfig",
    "PDConfig",
    "RecordConfig",
    "ReferenceConfig",
    "ReplayConfig",
    "ResourceConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
]


@dataclass
class ResourceConfig:
    """Devices of the job and their split between training and rollout (no colocation)."""

    device: str = "cpu"  # a name in offbeat.core.registry.DEVICES
    num_nodes: int = 1
    devices_per_node: int = 2
    trainer_devices: int = 1  # data-parallel trainer ranks; adds up with rollout_devices
    rollout_devices: int = 1

    @property
    def total_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet files of prompts
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 512  # tokens; longer prompts are rejected by the dataloader
    train_batch_size: int = (
        4  # prompts per global step (= parameter_sync_step × ppo_mini_batch_size)
    )
    val_batch_size: int = 64  # validation prompts in flight at once
    shuffle: bool = True
    seed: int = 0


@dataclass
class ModelConfig:
    path: str = ""  # HF model directory (or what the model builder understands)
    tokenizer_path: str = ""  # empty: same as `path`
    dtype: str = "float32"  # float32 | bfloat16 | float16
    trust_remote_code: bool = False
    # Set on the model's HF config, by the trainer and by the rollout engines alike (vLLM:
    # hf_overrides), e.g. {attention_dropout: 0.0}; keys must exist in that config.
    override_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class ActorConfig:
    """The policy's train engine and its PPO update."""

    engine: str = "fsdp2"  # a name in TRAIN_ENGINES
    ppo_mini_batch_size: int = 4  # prompts per optimizer step (mini-batch)
    ppo_micro_batch_size_per_device: int = 4  # trajectories per forward/backward
    ppo_epochs: int = 1
    # > 1 needs a model-parallel engine (megatron, not fsdp2); trainer_devices must be a
    # multiple of their product (the rest is data parallelism).
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    lr: float = 1e-6
    weight_decay: float = 0.0
    lr_warmup_steps: int = 0
    # After the warm-up: "constant", or "cosine" down to lr x min_lr_ratio at the last
    # update (trainer.total_training_steps x parameter_sync_step x ppo_epochs updates).
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping
    clip_ratio_low: float = 0.2  # ratio lower bound 1 - clip_ratio_low
    clip_ratio_high: float = 0.2  # ratio upper bound 1 + clip_ratio_high
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages; <= 1 disables
    gradient_checkpointing: bool = False


@dataclass
class CriticConfig:
    """The value model: the policy architecture with a scalar head, built (and every key
    here read) only when the advantage estimator needs one (GAE); its own optimizer, LR
    schedule, micro-batches, grad clipping and checkpoint beside the actor's. It updates
    on the actor's mini-batches, after the actor."""

    engine: str = "fsdp2"  # a name in TRAIN_ENGINES whose engine builds a critic
    model_path: str = ""  # empty: initialise from model.path (the actor's)
    # actor: on the actor's ranks (the trainer process, or each rank of the trainer's
    # worker group); separate: a worker group of its own, `devices` ranks on a pool of its
    # own (the trainer then runs as a worker group too).
    placement: str = "actor"
    devices: int = 1  # ranks of its own group (placement=separate); adds up in resources.*
    ppo_micro_batch_size_per_device: int = 4  # trajectories per forward/backward
    ppo_epochs: int = 1  # passes over each mini-batch per global step
    lr: float = 1e-5
    lr_warmup_steps: int = 0  # mini-batch updates of linear warm-up
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping
    cliprange_value: float = 0.5  # V stays within ± this of the old value (clipped loss)


@dataclass
class ReferenceConfig:
    """The reference policy: a frozen copy of the initial policy (model.path) that gives
    ``ref_log_probs``; built (and read) only when a KL term needs it
    (algorithm.use_kl_loss or algorithm.use_kl_in_reward)."""

    placement: str = "actor"  # actor | separate, as critic.placement
    devices: int = 1  # ranks of its own group (placement=separate), as critic.devices
    param_offload: bool = False  # keep its weights in host memory between forwards (GPUs)
    # trajectories per forward; None: actor.ppo_micro_batch_size_per_device
    log_prob_micro_batch_size_per_device: int | None = None


@dataclass
class KLControlConfig:
    """The coefficient of the KL penalty in the reward (algorithm.use_kl_in_reward)."""

    type: str = "fixed"  # fixed | adaptive (steered towards target_kl)
    kl_coef: float = 0.001  # the (initial) coefficient
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only: samples the correction is spread over


@dataclass
class RecordConfig:
    """Write each trained batch to `dir` (see offbeat.core.rollout.record): every `every`-th
    step, or only the steps listed in `steps`. Empty `dir`: nothing is recorded."""

    dir: str = ""
    steps: list[int] = field(default_factory=list)  # non-empty: exactly these global steps
    every: int = 1  # with `steps` empty: steps k, 2k, ... (1: every step)


@dataclass
class ReplayConfig:
    """Train on the batches recorded in `dir` instead of generating them (see
    offbeat.core.rollout.replay). `cache`: each recorded step once, then live generation;
    `repeat`: cycle through the recording for the whole run. Empty `dir`: all live."""

    dir: str = ""
    mode: str = "cache"  # cache | repeat


@dataclass
class PDConfig:
    """Prefill-decode disaggregation (vLLM): each replica is `prefill_engines` P engines
    and `decode_engines` D engines; a request prefills on a P engine, whose KV cache goes
    to a D engine through `connector`, which decodes. The balancer sees one replica."""

    enabled: bool = False
    prefill_engines: int = 1
    decode_engines: int = 1
    connector: str = "shared_storage"  # vLLM's shared-storage example connector
    # All engines of a replica on its tensor_parallel_size devices, splitting their memory
    # (each engine's gpu_memory_utilization is its share); false: each engine on devices
    # of its own, a replica then takes (prefill_engines + decode_engines) x tp devices.
    share_device: bool = False
    # Where the connector keeps KV caches (one folder per replica below it); a local path
    # that every engine of a replica sees. null: a folder under /dev/shm.
    storage_path: str | None = None


@dataclass
class RolloutConfig:
    engine: str = "vllm"  # a name in ROLLOUT_ENGINES
    tensor_parallel_size: int = 1
    n: int = 4  # trajectories sampled per prompt (the group size)
    max_tokens: int = 256  # response budget per trajectory
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Per-prompt sampling seeds: the group at position p of the data order is seeded from
    # (seed, p), its sample i with that + i, so a resumed run samples each prompt as an
    # uninterrupted one would. null: the engine's own sampling RNG (batch-order dependent).
    seed: int | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the engine as is
    record: RecordConfig = field(default_factory=RecordConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    pd: PDConfig = field(default_factory=PDConfig)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # a name in ADV_ESTIMATORS
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0  # GAE only
    lam: float = 1.0  # GAE only
    loss_agg_mode: str = "token-mean"  # a name in LOSS_AGG_MODES
    # Old-policy log-probs: "rollout" = the behaviour policy's (bypass mode); "trainer" =
    # recomputed with the trainer's start-of-step weights (decoupled PPO: proximal policy).
    old_log_prob_source: str = "rollout"
    # Rollout correction between proximal and behaviour policy (decoupled PPO only).
    rollout_is_level: str = "none"  # none | token | sequence
    rollout_is_mode: str = "truncate"  # truncate | mask
    rollout_is_threshold: float = 2.0  # upper bound on the IS ratio
    rollout_is_threshold_lower: float | None = None  # mask mode; None: 1 / threshold
    # KL to the reference policy as a loss term of the actor (GRPO-style) ...
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"  # a name in KL_ESTIMATORS
    kl_clamp: float = 10.0  # per-token KL estimates are clamped to ± this (loss and reward)
    # ... and/or as a penalty in the reward (classic PPO-RLHF): r_t -= beta × KL_t.
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"  # a name in KL_ESTIMATORS, for the in-reward penalty
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    entropy_coeff: float = 0.0


@dataclass
class RewardConfig:
    """How responses are scored (see offbeat.core.rewards for the calling convention)."""

    name: str = "task"  # "task": each row by its data_source's function; else a registered one
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to every reward function
    # data_source -> user function "pkg.mod:fn" or "path/to/file.py:fn" (before the registry)
    functions: dict[str, str] = field(default_factory=dict)
    genrm: dict[str, Any] = field(default_factory=dict)  # LLM judge (offbeat.core.rewards.genrm)
    # Seconds one reward call may take (sync ones run in a thread of their own, off the
    # event loop); past it the response's group fails (failed/reward_timeout_total) and a
    # sync call's thread is abandoned (Python cannot kill it). The genrm judge is bounded
    # by reward.genrm.timeout_s instead.
    timeout_s: float = 30.0


@dataclass
class AsyncConfig:
    """How far rollout may run ahead of training (see DESIGN §3)."""

    parameter_sync_step: int = 1  # mini-batch updates per global step (per weight sync)
    max_off_policy_threshold: int = 2  # largest span a trained group may have
    max_off_policy_strategy: str = "drop"  # drop | wait
    num_warmup_batches: int = 1  # batches submitted before the first step


@dataclass
class TrainerConfig:
    mode: str = "separate_async"  # sync | separate_async
    total_training_steps: int = 10
    # Passes over data.train_files: the run stops after at most
    # total_epochs × rows // train_batch_size steps. None: total_training_steps decides.
    total_epochs: int | None = None
    checkpoint_dir: str = "checkpoints"
    save_freq: int = 0  # global steps between checkpoints; 0: only at the end, -1: never
    resume: bool = False
    # Automatic restarts of a run that a dead trainer rank stopped (its process killed or
    # crashed; nothing else restarts: not a rank's own exception, not a config or reward
    # error): each resumes from the newest checkpoint, in the same process. null (auto): 2
    # when checkpoints are written mid-run (save_freq > 0), else 0. Two: a lone death (an
    # OOM kill, a lost worker) is survived twice over, while a rank that dies at the same
    # step every time stops after redoing at most 2 x save_freq steps. A set count > 0
    # needs save_freq > 0 (checked): without a checkpoint a restart would redo the run.
    max_restarts: int | None = None
    test_freq: int = 0  # global steps between validations; 0: never
    val_before_train: bool = False
    project_name: str = "offbeat"  # names the run (with experiment_name) in the logs
    experiment_name: str = "default"
    log_dir: str = "outputs"
    loggers: list[str] = field(default_factory=lambda: ["console"])
    # false: the console shows offbeat's lines; each rollout replica's process output (its
    # engine's logs) goes to <log_dir>/<experiment_name>/logs/<replica>.log, and Ray's
    # worker logs stay in its session directory (linked there as logs/ray). true: both come
    # back to the console, as Ray forwards them.
    verbose: bool = False
    seed: int = 0
    # Warn (once, then at most every 50 steps) when logprob_drift/abs_mean, the mean
    # |log p_trainer - log p_rollout| per token on trajectories sampled at the trainer's
    # current weights, passes this; null: never. float32 on both sides: ~3e-7; bf16: ~1e-2.
    logprob_drift_warn: float | None = 0.05
    # The stall watchdog (offbeat.core.trainer.watchdog): while the training loop runs,
    # stop the run when nothing advances for this long (no group finished, no batch
    # taken, no update, sync or validation prompt done), naming the stalled stage and
    # writing every thread's and asyncio task's stack to <log_dir>/<experiment_name>/logs.
    # 600 s: twice runtime.sync_timeout_s's default, 20x reward.timeout_s's, so those
    # deadlines fire first and the run recovers (a replica replaced, a group failed).
    # Engine start and warm start come before it; checkpoint saves and replica
    # replacements hold it. null or 0: off.
    stall_timeout_s: float | None = 600.0
    # The step timeline, <log_dir>/<experiment_name>/trace.json (Chrome trace / Perfetto):
    # every step when trace=true, else the first trace_steps steps (0: no trace).
    trace: bool = False
    trace_steps: int = 3
    # Hybrid replicas: one rollout replica per trainer rank, on the trainer's devices,
    # asleep while it trains; each validation wakes them, syncs them and adds them to the
    # balancer while validation runs (the trainer waits meanwhile). Needs a trainer pool
    # (the trainer runs as a worker group) and validation (test_freq or val_before_train).
    validate_on_trainer_devices: bool = False
    # How hybrid replicas sleep: 1 frees the KV cache and offloads the weights to host
    # memory, 2 frees both (they are synced at every wake). Engines without sleep mode
    # (vLLM on CPU) stay resident and idle.
    hybrid_sleep_level: int = 2


@dataclass
class JobConfig:
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: ReferenceConfig = field(default_factory=ReferenceConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    async_training: AsyncConfig = field(default_factory=AsyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def topk_kl_coef(self) -> float:
        """The weight of a forward-KL term to a teacher's top-k tokens in the policy loss
        (`ppo_loss_config`): none in a plain job. A recipe whose config adds a teacher
        overrides it (OPD's, from its `distillation` section), so core reads no recipe key."""
        return 0.0
