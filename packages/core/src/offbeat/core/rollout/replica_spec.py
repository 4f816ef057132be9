"""The one contract between a job and a rollout engine: a `ReplicaSpec` in, a replica out.

Every factory in `ROLLOUT_ENGINES` (`rollout.engine`) is `factory(spec) -> RolloutServer`:
the job (and the recipes' named pools: teachers, judges) describes the replica it wants,
the engine's package maps the job's config onto its own server and starts it, usually
through the shared Ray shell of `remote.py`. Knows nothing of any engine, nor of how the
pools are reserved (`offbeat.core.runtime.launch` computes the placement options).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offbeat.core.config.run import RunConfig

__all__ = ["ReplicaSpec", "start_replica"]


@dataclass(frozen=True)
class ReplicaSpec:
    """Replica `index` of `job` (a RunConfig, or a recipe's job config for its own pool)
    on the model at `model_path`.

    `server_id`: its name (None: `rollout-<index>`; replacements, hybrid replicas, teachers
    and judges have their own). `cpus`: its cores (None: its share of
    `runtime.rollout_cpus`; a hybrid replica takes its trainer rank's). `ray_options`: what
    places its actor (the `scheduling_strategy` of its bundle in the pool, a hybrid
    replica's share of the rank's device: `replica_options`, `hybrid_options`), merged over
    the engine's defaults. `hybrid`: it lives in a trainer rank's bundle (asleep but for
    validation)."""

    job: RunConfig
    model_path: str
    index: int
    server_id: str | None = None
    cpus: list[int] | None = None
    ray_options: dict[str, Any] = field(default_factory=dict)
    hybrid: bool = False

    @property
    def name(self) -> str:
        return self.server_id or f"rollout-{self.index}"

    @property
    def placed(self) -> bool:
        """Whether the actor goes into a bundle of a placement group."""
        return "scheduling_strategy" in self.ray_options


def start_replica(spec: ReplicaSpec) -> Any:
    """Start `spec` with the factory registered under the job's `rollout.engine` (not
    awaited: the returned proxy answers once the engine is up)."""
    from offbeat.core.registry import ROLLOUT_ENGINES

    return ROLLOUT_ENGINES.get(spec.job.rollout.engine)(spec)
