"""The Ray shell around a train engine: one factory, nothing else.

The engines stay plain classes (tests and a single-process trainer use them directly); the
job's trainer group (`offbeat.core.runtime`) runs one actor per data-parallel rank with
its own rank class. Knows nothing about how the
ranks rendezvous: pass the torch.distributed env:// variables (MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE, LOCAL_RANK) through `runtime_env={"env_vars": ...}` in `ray_options`,
and the engine joins that group when it is built.
"""

from __future__ import annotations

from typing import Any

from offbeat.core.registry import TRAIN_ENGINES

__all__ = ["make_train_engine_actor"]


def make_train_engine_actor(engine: str | type = "fsdp2", **ray_options: Any) -> Any:
    """A Ray actor class for the train engine `engine` (a registered name or a class),
    e.g. ``make_train_engine_actor("fsdp2", num_gpus=1).remote(config)``.

    `export_weights` is a generator: call it inside the actor (e.g. from a method of a
    subclass that feeds the checkpoint engine), not across the actor boundary.
    """
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a core dependency
        raise ImportError("make_train_engine_actor needs Ray: pip install ray") from e
    cls = TRAIN_ENGINES.get(engine) if isinstance(engine, str) else engine
    return ray.remote(**ray_options)(cls) if ray_options else ray.remote(cls)
