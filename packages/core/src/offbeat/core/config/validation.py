"""One validation pass over a `JobConfig`, run before any process or actor starts.

Every rule runs; all problems are collected and raised together as one `ConfigError`
whose message names each bad key, its value and what would be valid. The rules know
only the config and the registries (which names exist), nothing of the running system.

Add a rule from anywhere with the `@check` decorator: a function `(cfg, problems)` that
calls `problems.add(...)` (or a `problems.require_*` helper) for each violation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offbeat.core.registry import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    REWARD_FUNCTIONS,
    ROLLOUT_ENGINES,
    TRAIN_ENGINES,
    Registry,
)

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

__all__ = ["ConfigError", "Problem", "Problems", "check", "validate"]

OFF_POLICY_STRATEGIES = ("drop", "wait")
TRAINER_MODES = ("sync", "separate_async")
OLD_LOG_PROB_SOURCES = ("rollout", "trainer")
ROLLOUT_IS_LEVELS = ("none", "token", "sequence")
ROLLOUT_IS_MODES = ("truncate", "mask")
# model.dtype: what the train engines compute in and export (their dtype tables' names).
MODEL_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Problem:
    key: str  # dotted path, e.g. "async_training.max_off_policy_threshold"
    value: Any
    expected: str  # what would be valid

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}: {self.expected}"


class ConfigError(ValueError):
    """Raised once with every problem found; `.problems` holds them."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = list(problems)
        n = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid config ({n} problem{'s' if n != 1 else ''}):\n{lines}")


class Problems:
    """Collects problems; the `require_*` helpers return True when the value is fine."""

    def __init__(self) -> None:
        self.items: list[Problem] = []

    def add(self, key: str, value: Any, expected: str) -> None:
        self.items.append(Problem(key, value, expected))

    def require_int(self, key: str, value: Any, *, minimum: int | None = 1) -> bool:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and minimum is not None and value < minimum:
            ok = False
        if not ok:
            bound = "" if minimum is None else (" > 0" if minimum == 1 else f" >= {minimum}")
            self.add(key, value, f"must be an int{bound}")
        return ok

    def require_number(
        self, key: str, value: Any, *, low: float | None = None, high: float | None = None
    ) -> bool:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and ((low is not None and value < low) or (high is not None and value > high)):
            ok = False
        if not ok:
            lo = "-inf" if low is None else low
            hi = "inf" if high is None else high
            self.add(key, value, f"must be a number in [{lo}, {hi}]")
        return ok

    def require_choice(self, key: str, value: Any, choices: Iterable[str]) -> bool:
        choices = tuple(choices)
        if value not in choices:
            self.add(key, value, f"must be one of {', '.join(choices)}")
            return False
        return True

    def require_registered(self, key: str, value: Any, registry: Registry[Any]) -> bool:
        if value not in registry:
            known = registry.names()
            listed = ", ".join(known) if known else "(none registered)"
            self.add(key, value, f"unknown {registry.kind}; registered: {listed}")
            return False
        return True


Check = Callable[["JobConfig", Problems], None]
_CHECKS: list[Check] = []


def check(fn: Check) -> Check:
    """Register a validation rule (runs in registration order on every `validate`)."""
    if fn not in _CHECKS:
        _CHECKS.append(fn)
    return fn


def validate(cfg: JobConfig) -> None:
    """Run every rule on `cfg` (a `JobConfig`, a recipe's subclass of it, or an OmegaConf
    DictConfig of one: the rules only read attributes).

    Raises one `ConfigError` listing every problem; returns None when all rules pass.
    """
    problems = Problems()
    for rule in _CHECKS:
        rule(cfg, problems)
    if problems.items:
        raise ConfigError(problems.items)


# ---------------------------------------------------------------------------------------
# The rules.


@check
def _resources(cfg: JobConfig, p: Problems) -> None:
    r, tp = cfg.resources, cfg.rollout.tensor_parallel_size
    # resources.device (registered, its plugin loads, present here): see support.py.
    ok = [
        p.require_int("resources.num_nodes", r.num_nodes),
        p.require_int("resources.devices_per_node", r.devices_per_node),
        p.require_int("resources.trainer_devices", r.trainer_devices),
        p.require_int("resources.rollout_devices", r.rollout_devices),
    ]
    if not all(ok):
        return
    if p.require_int("rollout.tensor_parallel_size", tp) and r.rollout_devices % tp:
        p.add(
            "resources.rollout_devices",
            r.rollout_devices,
            f"must be a multiple of rollout.tensor_parallel_size={tp}",
        )
    a = cfg.actor
    tp_ok = p.require_int("actor.tensor_model_parallel_size", a.tensor_model_parallel_size)
    pp_ok = p.require_int("actor.pipeline_model_parallel_size", a.pipeline_model_parallel_size)
    if tp_ok and pp_ok:
        mp = a.tensor_model_parallel_size * a.pipeline_model_parallel_size
        if r.trainer_devices % mp:
            p.add(
                "resources.trainer_devices",
                r.trainer_devices,
                f"must be a multiple of actor.tensor_model_parallel_size × "
                f"actor.pipeline_model_parallel_size = {mp}",
            )


@check
def _batch_sizes(cfg: JobConfig, p: Problems) -> None:
    tb, a, pss = cfg.data.train_batch_size, cfg.actor, cfg.async_training.parameter_sync_step
    ok = [
        p.require_int("data.train_batch_size", tb),
        p.require_int("actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
        p.require_int("async_training.parameter_sync_step", pss),
    ]
    p.require_int("data.val_batch_size", cfg.data.val_batch_size)
    p.require_int("actor.ppo_micro_batch_size_per_device", a.ppo_micro_batch_size_per_device)
    p.require_int("actor.ppo_epochs", a.ppo_epochs)
    if all(ok) and tb != pss * a.ppo_mini_batch_size:
        p.add(
            "data.train_batch_size",
            tb,
            f"must equal async_training.parameter_sync_step × actor.ppo_mini_batch_size "
            f"= {pss} × {a.ppo_mini_batch_size} = {pss * a.ppo_mini_batch_size}",
        )
    # Each data-parallel rank must get whole trajectories of every mini-batch.
    r, n = cfg.resources, cfg.rollout.n
    ints = (r.trainer_devices, a.tensor_model_parallel_size, a.pipeline_model_parallel_size, n)
    if all(isinstance(x, int) and x > 0 for x in ints) and ok[1]:
        mp = a.tensor_model_parallel_size * a.pipeline_model_parallel_size
        dp = r.trainer_devices // mp
        if r.trainer_devices % mp == 0 and (a.ppo_mini_batch_size * n) % dp:
            p.add(
                "actor.ppo_mini_batch_size",
                a.ppo_mini_batch_size,
                f"× rollout.n={n} trajectories must split evenly over the {dp} "
                f"data-parallel trainer ranks",
            )


@check
def _async(cfg: JobConfig, p: Problems) -> None:
    s = cfg.async_training
    p.require_int("async_training.max_off_policy_threshold", s.max_off_policy_threshold)
    p.require_choice(
        "async_training.max_off_policy_strategy", s.max_off_policy_strategy, OFF_POLICY_STRATEGIES
    )
    warmup_ok = p.require_int("async_training.num_warmup_batches", s.num_warmup_batches, minimum=0)
    threshold = s.max_off_policy_threshold
    if (
        warmup_ok
        and cfg.trainer.mode == "separate_async"
        and s.max_off_policy_strategy == "drop"
        and type(threshold) is int  # a bad threshold is reported on its own
        and threshold > 0
        and s.num_warmup_batches + 1 > threshold
    ):
        from offbeat.core.buffer import drop_depth_message

        p.add(
            "async_training.num_warmup_batches",
            s.num_warmup_batches,
            drop_depth_message(s.num_warmup_batches, threshold),
        )


@check
def _registry_names(cfg: JobConfig, p: Problems) -> None:
    al = cfg.algorithm
    p.require_registered("actor.engine", cfg.actor.engine, TRAIN_ENGINES)
    if p.require_registered("rollout.engine", cfg.rollout.engine, ROLLOUT_ENGINES):
        # Load the engine's plugin: it may add rules of its own (they run after this one).
        try:
            ROLLOUT_ENGINES.get(cfg.rollout.engine)
        except Exception as e:
            p.add("rollout.engine", cfg.rollout.engine, f"its plugin does not load: {e}")
    p.require_registered("reward.name", cfg.reward.name, REWARD_FUNCTIONS)
    p.require_registered("algorithm.loss_agg_mode", al.loss_agg_mode, LOSS_AGG_MODES)
    p.require_registered("algorithm.kl_loss_type", al.kl_loss_type, KL_ESTIMATORS)
    known = p.require_registered("algorithm.adv_estimator", al.adv_estimator, ADV_ESTIMATORS)
    if known and getattr(ADV_ESTIMATORS.get(al.adv_estimator), "needs_critic", False):
        p.require_registered("critic.engine", cfg.critic.engine, TRAIN_ENGINES)


@check
def _algorithm(cfg: JobConfig, p: Problems) -> None:
    al, a = cfg.algorithm, cfg.actor
    p.require_choice("algorithm.old_log_prob_source", al.old_log_prob_source, OLD_LOG_PROB_SOURCES)
    level_ok = p.require_choice(
        "algorithm.rollout_is_level", al.rollout_is_level, ROLLOUT_IS_LEVELS
    )
    p.require_choice("algorithm.rollout_is_mode", al.rollout_is_mode, ROLLOUT_IS_MODES)
    p.require_number("algorithm.rollout_is_threshold", al.rollout_is_threshold, low=1.0)
    lower = al.rollout_is_threshold_lower
    if lower is not None:
        p.require_number("algorithm.rollout_is_threshold_lower", lower, low=0.0, high=1.0)
    if level_ok and al.rollout_is_level != "none" and al.old_log_prob_source != "trainer":
        p.add(
            "algorithm.rollout_is_level",
            al.rollout_is_level,
            "needs algorithm.old_log_prob_source='trainer' (with 'rollout' the proximal and "
            "behaviour log-probs are the same); set it or use rollout_is_level='none'",
        )
    p.require_number("algorithm.gamma", al.gamma, low=0.0, high=1.0)
    p.require_number("algorithm.lam", al.lam, low=0.0, high=1.0)
    p.require_number("algorithm.kl_loss_coef", al.kl_loss_coef, low=0.0)
    p.require_number("algorithm.entropy_coeff", al.entropy_coeff)
    low = a.clip_ratio_low
    if p.require_number("actor.clip_ratio_low", low, low=0.0, high=1.0) and low == 1.0:
        p.add("actor.clip_ratio_low", low, "must be < 1 (the ratio's lower bound is 1 - it)")
    p.require_number("actor.clip_ratio_high", a.clip_ratio_high, low=0.0)
    p.require_number("actor.clip_ratio_c", a.clip_ratio_c)
    if p.require_number("actor.lr", a.lr, low=0.0) and not a.lr > 0:
        p.add("actor.lr", a.lr, "must be > 0")
    p.require_number("actor.weight_decay", a.weight_decay, low=0.0)
    warmup_ok = p.require_int("actor.lr_warmup_steps", a.lr_warmup_steps, minimum=0)
    from offbeat.core.train.optim import LR_SCHEDULES

    if p.require_choice("actor.lr_schedule", a.lr_schedule, LR_SCHEDULES) and warmup_ok:
        _cosine_has_a_horizon(cfg, p)
    p.require_number("actor.min_lr_ratio", a.min_lr_ratio, low=0.0, high=1.0)


def _cosine_has_a_horizon(cfg: JobConfig, p: Problems) -> None:
    """The cosine schedule decays after the warm-up, until the last of the run's
    total_training_steps × parameter_sync_step × ppo_epochs mini-batch updates."""
    a, t = cfg.actor, cfg.trainer
    counts = (t.total_training_steps, cfg.async_training.parameter_sync_step, a.ppo_epochs)
    if a.lr_schedule != "cosine" or not all(type(n) is int and n > 0 for n in counts):
        return  # a bad count is reported on its own
    updates = counts[0] * counts[1] * counts[2]
    if updates <= a.lr_warmup_steps:
        p.add(
            "actor.lr_warmup_steps",
            a.lr_warmup_steps,
            f"must be < the run's {updates} updates (trainer.total_training_steps × "
            "async_training.parameter_sync_step × actor.ppo_epochs) with "
            "actor.lr_schedule=cosine, which decays after the warm-up",
        )


@check
def _rollout(cfg: JobConfig, p: Problems) -> None:
    ro = cfg.rollout
    p.require_int("rollout.n", ro.n)
    p.require_int("rollout.max_tokens", ro.max_tokens)
    p.require_number("rollout.temperature", ro.temperature, low=0.0)
    p.require_number("rollout.top_p", ro.top_p, low=0.0, high=1.0)
    p.require_int("rollout.top_k", ro.top_k, minimum=None)
    if ro.seed is not None:
        p.require_int("rollout.seed", ro.seed, minimum=0)
    p.require_int("data.max_prompt_length", cfg.data.max_prompt_length)


# rollout.pd.connector: the KV connectors a prefill-decode replica can use (vLLM's).
PD_CONNECTORS = ("shared_storage",)


@check
def _rollout_pd(cfg: JobConfig, p: Problems) -> None:
    pd = getattr(cfg.rollout, "pd", None)
    if pd is None:
        return
    for key in ("enabled", "share_device"):
        if not isinstance(getattr(pd, key), bool):
            p.add(f"rollout.pd.{key}", getattr(pd, key), "must be true or false")
    if pd.enabled is not True:
        return
    if cfg.rollout.engine != "vllm":
        p.add("rollout.engine", cfg.rollout.engine, "must be vllm with rollout.pd.enabled=true")
    ok = p.require_int("rollout.pd.prefill_engines", pd.prefill_engines)
    ok = p.require_int("rollout.pd.decode_engines", pd.decode_engines) and ok
    p.require_choice("rollout.pd.connector", pd.connector, PD_CONNECTORS)
    if pd.storage_path is not None and (
        not isinstance(pd.storage_path, str) or not pd.storage_path.strip()
    ):
        p.add("rollout.pd.storage_path", pd.storage_path, "must be null or a directory path")
    r, tp = cfg.resources, cfg.rollout.tensor_parallel_size
    if r.device != "cuda":
        p.add(
            "resources.device",
            r.device,
            "must be cuda with rollout.pd.enabled=true (prefill-decode replicas run on CUDA vLLM)",
        )
    if not ok or type(tp) is not int or tp < 1 or type(r.rollout_devices) is not int:
        return
    engines = pd.prefill_engines + pd.decode_engines
    if pd.share_device is True:
        util = cfg.rollout.engine_kwargs.get("gpu_memory_utilization")
        top = round(0.95 / engines, 3)
        if not isinstance(util, int | float) or isinstance(util, bool) or util * engines > 0.95:
            p.add(
                "rollout.engine_kwargs.gpu_memory_utilization",
                util,
                f"must be set, at most 0.95 / {engines} = {top}, with rollout.pd.share_device=true: "
                f"the {engines} engines of a PD replica share its devices",
            )
        return
    need = engines * tp
    if r.rollout_devices % need:
        p.add(
            "resources.rollout_devices",
            r.rollout_devices,
            f"must be a multiple of (rollout.pd.prefill_engines + rollout.pd.decode_engines) x "
            f"rollout.tensor_parallel_size = {need} (each engine of a PD replica on devices "
            "of its own), or set rollout.pd.share_device=true (the engines share the "
            "replica's devices)",
        )


@check
def _model_and_trainer(cfg: JobConfig, p: Problems) -> None:
    _model(cfg, p)
    t = cfg.trainer
    p.require_choice("trainer.mode", t.mode, TRAINER_MODES)
    p.require_int("trainer.total_training_steps", t.total_training_steps)
    if t.total_epochs is not None:
        p.require_int("trainer.total_epochs", t.total_epochs)
    p.require_int("trainer.save_freq", t.save_freq, minimum=-1)
    p.require_int("trainer.test_freq", t.test_freq, minimum=0)
    if not isinstance(t.checkpoint_dir, str) or not t.checkpoint_dir.strip():
        p.add("trainer.checkpoint_dir", t.checkpoint_dir, "must be a non-empty path")


def _model(cfg: JobConfig, p: Problems) -> None:
    _model_path(cfg.model.path, p)
    p.require_choice("model.dtype", cfg.model.dtype, MODEL_DTYPES)


def _model_path(path: Any, p: Problems) -> None:
    """model.path names a model: offbeat's tiny preset (`offbeat-tiny:<size>`), an existing
    HF model directory when given as a path, or a name the model builder resolves."""
    from offbeat.core.models.tiny import TINY_PREFIX

    if not isinstance(path, str) or not path.strip():
        p.add("model.path", path, "must name a model (a HF model directory)")
    elif path.startswith(TINY_PREFIX):
        from offbeat.core.models import TINY_MODEL_PRESETS

        if path[len(TINY_PREFIX) :] not in TINY_MODEL_PRESETS:
            p.add(
                "model.path", path, f"{TINY_PREFIX}<size> with size in {sorted(TINY_MODEL_PRESETS)}"
            )
    elif path.startswith(("/", "./", "../")) and not Path(path).is_dir():
        p.add("model.path", path, "an existing HF model directory")


@check
def _max_restarts(cfg: JobConfig, p: Problems) -> None:
    t = cfg.trainer
    n = getattr(t, "max_restarts", None)
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        p.add(
            "trainer.max_restarts",
            n,
            "must be an int >= 0 (restarts after a dead trainer rank; 0: none) or null "
            "(auto: 2 when trainer.save_freq > 0, else 0)",
        )
        return
    if n > 0 and isinstance(t.save_freq, int) and t.save_freq <= 0:
        p.add(
            "trainer.max_restarts",
            n,
            f"needs checkpoints mid-run to restart from: trainer.save_freq > 0 (it is "
            f"{t.save_freq}: {'only at the end' if t.save_freq == 0 else 'never'}); or 0 / "
            "null (no automatic restart)",
        )


@check
def _verbose(cfg: JobConfig, p: Problems) -> None:
    if not isinstance(cfg.trainer.verbose, bool):
        p.add(
            "trainer.verbose",
            cfg.trainer.verbose,
            "must be true (the engines' and Ray's logs on the console) or false (in files "
            "under trainer.log_dir/<experiment_name>/logs)",
        )


@check
def _logprob_drift_warn(cfg: JobConfig, p: Problems) -> None:
    value = cfg.trainer.logprob_drift_warn
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    if value is not None and not ok:
        p.add(
            "trainer.logprob_drift_warn",
            value,
            "must be a number > 0 (the mean |log-prob difference| per token that warns) or "
            "null (never warn)",
        )


@check
def _stall_timeout(cfg: JobConfig, p: Problems) -> None:
    value = cfg.trainer.stall_timeout_s
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
    if value is not None and not ok:
        p.add(
            "trainer.stall_timeout_s",
            value,
            "must be seconds > 0 (stop the run when nothing advances that long) or null / 0 "
            "(no stall watchdog)",
        )
        return
    if not value:
        return
    # The run's own deadlines must fire first, so the run recovers (a sync's replica
    # removed, a reward call failed) before the watchdog calls it stalled.
    deadlines = {
        key: d
        for key, d in (
            (
                "runtime.sync_timeout_s",
                getattr(getattr(cfg, "runtime", None), "sync_timeout_s", None),
            ),
            ("reward.timeout_s", getattr(getattr(cfg, "reward", None), "timeout_s", None)),
        )
        if isinstance(d, int | float) and not isinstance(d, bool) and d > 0
    }
    shorter = {key: d for key, d in deadlines.items() if value <= d}
    if shorter:
        named = " and ".join(f"{k}={d:g}" for k, d in deadlines.items())
        p.add(
            "trainer.stall_timeout_s",
            value,
            f"must be longer than the run's own deadlines, which must fire first: {named}; "
            f"set it above {max(deadlines.values()):g} s (or lower {', '.join(shorter)}), "
            "or null / 0 (no stall watchdog)",
        )


@check
def _trace(cfg: JobConfig, p: Problems) -> None:
    t = cfg.trainer
    if not isinstance(t.trace, bool):
        p.add("trainer.trace", t.trace, "must be true (trace every step) or false")
    if p.require_int("trainer.trace_steps", t.trace_steps, minimum=0) and t.trace is True:
        from offbeat.core.config.schema import TrainerConfig

        default = TrainerConfig.trace_steps
        if t.trace_steps != default:
            p.add(
                "trainer.trace_steps",
                t.trace_steps,
                f"is ignored with trainer.trace=true (every step is traced): leave it at "
                f"{default}, or set trainer.trace=false to trace only the first steps",
            )
