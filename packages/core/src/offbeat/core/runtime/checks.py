"""Validation rules for the runtime's placement keys: the trainer group and the pools.

Registered with `@check` on import (the job imports this module); they run for configs
with a `runtime` section. Knows only the config; starts nothing (whether the cluster can
hold the pools is known only once Ray is up: `ResourcePools.create` says so then).
"""

from __future__ import annotations

from typing import Any

from offbeat.core.config.validation import Problems, check


def _positive(p: Problems, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        p.add(key, value, "a number > 0")


@check
def _trainer_group_rules(cfg: Any, p: Problems) -> None:
    rt = getattr(cfg, "runtime", None)
    if rt is None:
        return
    r = cfg.resources
    _positive(p, "runtime.trainer_num_cpus", rt.trainer_num_cpus)
    _positive(p, "runtime.placement_timeout_s", rt.placement_timeout_s)
    for key in ("trainer_resources", "rollout_resources"):
        for name, amount in dict(getattr(rt, key)).items():
            if name in ("CPU", "GPU") or isinstance(amount, bool):
                p.add(
                    f"runtime.{key}.{name}",
                    amount,
                    "a custom Ray resource name with an amount > 0 (CPUs and devices come "
                    "from runtime.*_num_cpus and resources.*_devices)",
                )
            else:
                _positive(p, f"runtime.{key}.{name}", amount)
    if rt.trainer_in_driver is True:
        if type(r.trainer_devices) is int and r.trainer_devices > 1:
            p.add(
                "runtime.trainer_in_driver",
                True,
                f"the driver holds one trainer rank; resources.trainer_devices="
                f"{r.trainer_devices} runs as a worker group: set null (auto) or false",
            )
        if type(r.num_nodes) is int and r.num_nodes > 1:
            p.add(
                "runtime.trainer_in_driver",
                True,
                f"with resources.num_nodes={r.num_nodes} the trainer runs on its pool's node "
                f"and syncs from there: set null (auto) or false",
            )
