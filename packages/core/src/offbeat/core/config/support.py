"""What offbeat can run today, as validation rules: a config that passes `check` runs.

Three kinds of rule live here, all registered with `@check`:

* features the schema names but nothing builds yet (worker groups outside a job's
  runtime: several trainer ranks, a critic or a reference model in a group of its own):
  rejected naming the missing piece. When a piece lands, delete its lines in `_not_built_yet` and nothing
  else. GAE runs only with a critic and a KL term only with a reference model: when the
  configured train engine cannot build one, `check` names it;
* settings of a feature that is switched off (GAE's gamma with GRPO, `critic.*` without a
  critic, the KL loss's coefficient without the KL loss, ...): a non-default value would
  be silently ignored, so it is rejected naming what would read it;
* the device: it must be registered, its plugin must load, and this machine must have it
  (the trainer runs in the process that starts the job).

Knows only the config, the registries (whether a train engine has a registered critic
or offers `reference_from_job_config`) and `Device.is_available()`; nothing of the runtime's
own knobs (`offbeat.core.trainer.runtime_checks` has those).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offbeat.core.config.schema import (
    AlgorithmConfig,
    CriticConfig,
    KLControlConfig,
    ReferenceConfig,
)
from offbeat.core.config.validation import Problems, check
from offbeat.core.registry import ADV_ESTIMATORS, DEVICES, KL_ESTIMATORS, TRAIN_ENGINES

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig, RolloutConfig

__all__ = [
    "critic_estimators",
    "needs_critic",
    "needs_reference",
    "replica_devices",
    "separate_groups",
]

PLACEMENTS = ("actor", "separate")
# The config section of each role that may run in a worker group of its own.
SEPARATE_SECTIONS = {"critic": "critic", "reference": "ref"}

# Packages that provide a device offbeat does not build in: named when it is missing.
DEVICE_PACKAGES = {"npu": "offbeat-device-ascend[npu] (the Ascend plugin and torch-npu)"}
# What to do when a registered device is not usable on this machine.
UNAVAILABLE_HINTS = {
    "cuda": (
        "torch.cuda.is_available() is False on this machine (no CUDA GPU, or the CPU stack "
        "is installed: on a CUDA machine run `OFFBEAT_STACK=gpu ./offbeat ...`); use "
        "resources.device=cpu here"
    ),
}


def needs_critic(estimator: Any) -> bool:
    """True when the advantage estimator registered as `estimator` needs a value model."""
    if not isinstance(estimator, str) or estimator not in ADV_ESTIMATORS:
        return False
    return bool(getattr(ADV_ESTIMATORS.get(estimator), "needs_critic", False))


def critic_estimators() -> list[str]:
    return [n for n in ADV_ESTIMATORS.names() if needs_critic(n)]


def needs_reference(algorithm: Any) -> bool:
    """True when a KL term reads reference log-probs (as a loss or in the reward)."""
    return algorithm.use_kl_loss is True or algorithm.use_kl_in_reward is True


def replica_devices(rollout: RolloutConfig) -> int:
    """Devices one rollout replica takes: `rollout.tensor_parallel_size`, times its
    engines for a prefill-decode replica whose engines have devices of their own."""
    tp = rollout.tensor_parallel_size
    pd = getattr(rollout, "pd", None)
    if pd is not None and pd.enabled is True and pd.share_device is not True:
        return tp * (pd.prefill_engines + pd.decode_engines)
    return tp


def separate_groups(cfg: JobConfig) -> dict[str, Any]:
    """Role ("critic", "reference") -> its `devices` (ranks of its own worker group), for
    each model the algorithm reads and places in a group of its own (`placement=separate`);
    none for a config without those sections."""
    al, critic, ref = (getattr(cfg, k, None) for k in ("algorithm", "critic", "ref"))
    if al is None:
        return {}
    out = {}
    if critic is not None and critic.placement == "separate" and needs_critic(al.adv_estimator):
        out["critic"] = critic.devices
    if ref is not None and ref.placement == "separate" and needs_reference(al):
        out["reference"] = ref.devices
    return out


@check
def _devices_add_up(cfg: JobConfig, p: Problems) -> None:
    """The trainer's, the rollout's and any separate group's devices fill the nodes (here,
    beside `separate_groups`; the counts themselves are checked by validation's rules)."""
    r = cfg.resources
    counts = (r.num_nodes, r.devices_per_node, r.trainer_devices, r.rollout_devices)
    if not all(type(n) is int for n in counts):
        return
    total = r.num_nodes * r.devices_per_node
    # A critic / reference model in a worker group of its own takes devices of its own.
    own = {
        f"{SEPARATE_SECTIONS[role]}.devices": n
        for role, n in separate_groups(cfg).items()
        if type(n) is int  # a bad value is reported on its own
    }
    used = r.trainer_devices + r.rollout_devices + sum(own.values())
    if used != total:
        keys = ["resources.trainer_devices", "resources.rollout_devices", *own]
        others = "".join(f", {k.split('.')[0]}.devices={n}" for k, n in own.items())
        p.add(
            "+".join(keys),
            used,
            f"must equal resources.num_nodes × resources.devices_per_node = {total} "
            f"(e.g. trainer_devices={max(total - r.rollout_devices - sum(own.values()), 1)}, "
            f"rollout_devices={r.rollout_devices}{others})",
        )


def _engines_that(builder: str) -> list[str]:
    out = [name for name in TRAIN_ENGINES.names() if _builds(name, builder)]
    return out or ["(none registered)"]


def _builds(engine: Any, builder: str) -> bool | None:
    """Whether the train engine registered as `engine` has `builder` ("critic": a critic
    class registered for it; else a classmethod of that name). None: unknown name,
    reported by the registry rule."""
    if not isinstance(engine, str) or engine not in TRAIN_ENGINES:
        return None
    try:
        if builder == "critic":
            from offbeat.core.train.engine import critic_engine

            return critic_engine(engine) is not None
        return hasattr(TRAIN_ENGINES.get(engine), builder)
    except Exception:
        return None


@check
def _not_built_yet(cfg: JobConfig, p: Problems) -> None:
    """The one place that rejects what the schema accepts but nothing builds yet."""
    al, a, r = cfg.algorithm, cfg.actor, cfg.resources
    if needs_critic(al.adv_estimator) and (_builds(cfg.critic.engine, "critic") is False):
        p.add(
            "algorithm.adv_estimator",
            al.adv_estimator,
            f"needs a critic (value model) and critic.engine={cfg.critic.engine!r} builds "
            f"none; engines that do: {', '.join(_engines_that('critic'))}",
        )
    if needs_reference(al):
        key = "use_kl_loss" if al.use_kl_loss is True else "use_kl_in_reward"
        if _builds(a.engine, "reference_from_job_config") is False:
            p.add(
                f"algorithm.{key}",
                True,
                f"needs a reference model and actor.engine={a.engine!r} builds none; engines "
                f"that do: {', '.join(_engines_that('reference_from_job_config'))}",
            )
    for role in separate_groups(cfg) if not hasattr(cfg, "runtime") else ():
        section = SEPARATE_SECTIONS[role]
        p.add(
            f"{section}.placement",
            "separate",
            "a worker group of its own runs in a job's runtime, which a config without a "
            "runtime section (a bare JobConfig, not a recipe's RunConfig) does not start: "
            "set actor, or run it as a recipe",
        )
    if type(r.trainer_devices) is int and r.trainer_devices > 1 and not hasattr(cfg, "runtime"):
        p.add(
            "resources.trainer_devices",
            r.trainer_devices,
            "several trainer ranks run as the job's worker group, which a config without a "
            "runtime section (a bare JobConfig, not a recipe's RunConfig) does not start: "
            "set 1, or run it as a recipe",
        )
    if a.engine == "fsdp2":
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            value = getattr(a, key)
            if type(value) is int and value > 1:
                p.add(
                    f"actor.{key}",
                    value,
                    "fsdp2 has no tensor/pipeline parallelism: set 1, or use "
                    "actor.engine=megatron (offbeat-backend-megatron)",
                )


def _reject_changed(
    p: Problems, section: str, cfg_section: Any, defaults: Any, names: tuple[str, ...], why: str
) -> None:
    for name in names:
        value, default = getattr(cfg_section, name), getattr(defaults, name)
        if value != default:
            p.add(f"{section}.{name}", value, f"{why}; leave it at {default!r}")


@check
def _settings_of_features_that_are_off(cfg: JobConfig, p: Problems) -> None:
    al, defaults = cfg.algorithm, AlgorithmConfig()
    est = al.adv_estimator
    if not needs_critic(est):
        critics = ", ".join(critic_estimators()) or "gae"
        _reject_changed(
            p, "algorithm", al, defaults, ("gamma", "lam"),
            f"only GAE (algorithm.adv_estimator={critics}) reads it; {est!r} ignores it",
        )  # fmt: skip
        names = tuple(f.name for f in fields(CriticConfig))
        _reject_changed(
            p, "critic", cfg.critic, CriticConfig(), names,
            f"nothing reads critic.* unless algorithm.adv_estimator needs a critic ({critics})",
        )  # fmt: skip
    if est != "grpo":
        _reject_changed(
            p, "algorithm", al, defaults, ("norm_adv_by_std_in_grpo",),
            f"only algorithm.adv_estimator='grpo' reads it; {est!r} ignores it",
        )  # fmt: skip
    if al.use_kl_loss is not True:
        _reject_changed(
            p, "algorithm", al, defaults, ("kl_loss_coef", "kl_loss_type"),
            "only read with algorithm.use_kl_loss=true",
        )  # fmt: skip
    if al.use_kl_in_reward is not True:
        _reject_changed(
            p, "algorithm", al, defaults, ("kl_penalty",),
            "only read with algorithm.use_kl_in_reward=true",
        )  # fmt: skip
        names = tuple(f.name for f in fields(KLControlConfig))
        _reject_changed(
            p, "algorithm.kl_ctrl", al.kl_ctrl, KLControlConfig(), names,
            "only read with algorithm.use_kl_in_reward=true",
        )  # fmt: skip
    elif al.kl_ctrl.type == "fixed":
        _reject_changed(
            p, "algorithm.kl_ctrl", al.kl_ctrl, KLControlConfig(), ("target_kl", "horizon"),
            "only the adaptive controller (algorithm.kl_ctrl.type=adaptive) reads it",
        )  # fmt: skip
    if not needs_reference(al):
        _reject_changed(
            p, "algorithm", al, defaults, ("kl_clamp",),
            "only read with algorithm.use_kl_loss=true or algorithm.use_kl_in_reward=true",
        )  # fmt: skip
        names = tuple(f.name for f in fields(ReferenceConfig))
        _reject_changed(
            p, "ref", cfg.ref, ReferenceConfig(), names,
            "nothing reads ref.* unless algorithm.use_kl_loss or algorithm.use_kl_in_reward "
            "is true (no reference model is built)",
        )  # fmt: skip
    elif cfg.ref.param_offload is True and cfg.resources.device == "cpu":
        p.add(
            "ref.param_offload", True,
            "resources.device=cpu keeps every weight in host memory already; leave it false",
        )  # fmt: skip
    if al.rollout_is_level == "none":
        _reject_changed(
            p, "algorithm", al, defaults,
            ("rollout_is_mode", "rollout_is_threshold", "rollout_is_threshold_lower"),
            "only read when algorithm.rollout_is_level is token or sequence",
        )  # fmt: skip


def _placement_devices(p: Problems, section: str, c: Any) -> None:
    """`devices` is read only by a group of its own; there, an int > 0."""
    if c.placement == "separate":
        p.require_int(f"{section}.devices", c.devices)
    elif c.devices != 1:
        p.add(
            f"{section}.devices",
            c.devices,
            f"only read with {section}.placement=separate (placed with the actor it runs on "
            f"the actor's ranks, resources.trainer_devices); leave it at 1",
        )


@check
def _critic_and_reference_values(cfg: JobConfig, p: Problems) -> None:
    """Ranges of the critic's, the reference's and the KL controller's keys, when read."""
    al, c = cfg.algorithm, cfg.critic
    if needs_critic(al.adv_estimator):
        if p.require_choice("critic.placement", c.placement, PLACEMENTS):
            _placement_devices(p, "critic", c)
        p.require_int("critic.ppo_micro_batch_size_per_device", c.ppo_micro_batch_size_per_device)
        p.require_int("critic.ppo_epochs", c.ppo_epochs)
        p.require_int("critic.lr_warmup_steps", c.lr_warmup_steps, minimum=0)
        if p.require_number("critic.lr", c.lr, low=0.0) and not c.lr > 0:
            p.add("critic.lr", c.lr, "must be > 0")
        p.require_number("critic.weight_decay", c.weight_decay, low=0.0)
        p.require_number("critic.grad_clip", c.grad_clip)
        cliprange = c.cliprange_value
        if p.require_number("critic.cliprange_value", cliprange, low=0.0) and not cliprange > 0:
            p.add("critic.cliprange_value", cliprange, "must be > 0")
        path = c.model_path
        if path and isinstance(path, str) and not Path(path).is_dir():
            p.add("critic.model_path", path, "an existing HF model directory, or empty (the "
                  "actor's model.path)")  # fmt: skip
    if needs_reference(al):
        r = cfg.ref
        if p.require_choice("ref.placement", r.placement, PLACEMENTS):
            _placement_devices(p, "ref", r)
        if r.log_prob_micro_batch_size_per_device is not None:
            p.require_int(
                "ref.log_prob_micro_batch_size_per_device", r.log_prob_micro_batch_size_per_device
            )
        p.require_number("algorithm.kl_clamp", al.kl_clamp, low=0.0)
    if al.use_kl_in_reward is True:
        from offbeat.core.algorithms.kl_control import KL_CONTROLLERS

        k = al.kl_ctrl
        p.require_registered("algorithm.kl_penalty", al.kl_penalty, KL_ESTIMATORS)
        ok = p.require_choice("algorithm.kl_ctrl.type", k.type, KL_CONTROLLERS)
        if ok and k.type == "adaptive":
            target = k.target_kl
            if p.require_number("algorithm.kl_ctrl.target_kl", target, low=0.0) and not target > 0:
                p.add("algorithm.kl_ctrl.target_kl", target, "must be > 0")
            p.require_int("algorithm.kl_ctrl.horizon", k.horizon)
        p.require_number("algorithm.kl_ctrl.kl_coef", k.kl_coef, low=0.0)


@check
def _device_on_this_machine(cfg: JobConfig, p: Problems) -> None:
    name = cfg.resources.device
    if name not in DEVICES:
        known = ", ".join(DEVICES.names())
        hint = f"; {name!r} needs {DEVICE_PACKAGES[name]}" if name in DEVICE_PACKAGES else ""
        p.add("resources.device", name, f"unknown device; registered: {known}{hint}")
        return
    try:
        device = DEVICES.get(name)
    except ImportError as e:  # a plugin whose vendor library is missing says what to install
        package = DEVICE_PACKAGES.get(name, "")
        hint = f"; install {package}" if package.split(" ")[0] not in str(e) else ""
        p.add("resources.device", name, f"its plugin does not load: {e}{hint}")
        return
    if not device.is_available():
        hint = UNAVAILABLE_HINTS.get(name, f"no {name} device is usable on this machine")
        p.add("resources.device", name, hint)
