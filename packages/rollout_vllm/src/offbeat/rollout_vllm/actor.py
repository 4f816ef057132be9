"""The Ray shell of a vLLM replica: the shared one (`offbeat.core.rollout.remote`).

`vllm_server_actor(config, cpus=..., **ray_options)` starts a replica as an async Ray actor
(the engine and its worker processes live in the actor's process tree, confined to `cpus`;
`_replica_actor.build` runs there). `RemoteRolloutServer`, core's proxy of every engine's
replica, turns the handle back into the `GroupRolloutServer` / `SyncTarget` protocols.
Knows nothing about vLLM itself, and imports none of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from offbeat.core.rollout.remote import RemoteRolloutServer, replica_actor

__all__ = ["BUILD", "RemoteRolloutServer", "vllm_server_actor"]

BUILD = "offbeat.rollout_vllm._replica_actor:build"


def vllm_server_actor(config: Any, *, cpus: Sequence[int] | None = None, **ray_options: Any) -> Any:
    """Start a `VLLMRolloutServer(config)` (a `VLLMServerConfig` or its keywords) as a Ray
    actor; return its handle.

    `cpus`: cores that every process of the replica is confined to (None: no confinement).
    `ray_options` go to `ray.remote` (e.g. `num_gpus=1`, `name=...`, `scheduling_strategy`);
    the defaults ask for one CPU and allow many concurrent calls.
    """
    return replica_actor(BUILD, config, cpus=cpus, **ray_options)
