"""What offbeat can run today, as validation rules: a config that passes `check` runs.

Three kinds of rule live here, all registered with `@check`:

* features the schema names but nothing builds yet (a critic, a reference model, a
  trainer of more than one process): rejected naming the missing piece. When a piece
  lands, delete its lines in `_not_built_yet` and nothing else;
* settings of a feature that is switched off (GAE's gamma with GRPO, `critic.*` without a
  critic, the KL loss's coefficient without the KL loss, ...): a non-default value would
  be silently ignored, so it is rejected naming what would read it;
* the device: it must be registered, its plugin must load, and this machine must have it
  (the trainer runs in the process that starts the job).

Knows only the config, the registries and `Device.is_available()`; nothing of the runtime's
own knobs (`offbeat.core.trainer.runtime_checks` has those).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from offbeat.core.config.schema import AlgorithmConfig, CriticConfig
from offbeat.core.config.validation import Problems, check
from offbeat.core.registry import ADV_ESTIMATORS, DEVICES

__all__ = ["critic_estimators", "needs_critic"]

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


@check
def _not_built_yet(cfg: Any, p: Problems) -> None:
    """The one place that rejects what the schema accepts but nothing builds yet."""
    al, a, r = cfg.algorithm, cfg.actor, cfg.resources
    if needs_critic(al.adv_estimator):
        free = [n for n in ADV_ESTIMATORS.names() if not needs_critic(n)]
        p.add(
            "algorithm.adv_estimator",
            al.adv_estimator,
            f"needs a critic (value model) and there is no critic engine yet; use one of "
            f"{', '.join(free)}",
        )
    if al.use_kl_loss is True:
        p.add(
            "algorithm.use_kl_loss",
            al.use_kl_loss,
            "needs reference-model log-probs and there is no reference model yet; set false",
        )
    if type(r.trainer_devices) is int and r.trainer_devices > 1:
        p.add(
            "resources.trainer_devices",
            r.trainer_devices,
            "the trainer is one process on one device until the distributed trainer lands: "
            "set 1 and give the other devices to resources.rollout_devices",
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
def _settings_of_features_that_are_off(cfg: Any, p: Problems) -> None:
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
            p, "algorithm", al, defaults, ("kl_loss_coef", "kl_loss_type", "kl_clamp"),
            "only read with algorithm.use_kl_loss=true (no reference model yet)",
        )  # fmt: skip
    if al.rollout_is_level == "none":
        _reject_changed(
            p, "algorithm", al, defaults,
            ("rollout_is_mode", "rollout_is_threshold", "rollout_is_threshold_lower"),
            "only read when algorithm.rollout_is_level is token or sequence",
        )  # fmt: skip


@check
def _device_on_this_machine(cfg: Any, p: Problems) -> None:
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
