"""The Ray shell around `VLLMRolloutServer`: one factory, one proxy.

`vllm_server_actor(config, cpus=..., **ray_options)` starts a replica as an async Ray actor
(the engine and its worker processes live in the actor's process tree, confined to `cpus`).
`RemoteRolloutServer` turns the actor handle back into the `GroupRolloutServer` / `SyncTarget`
protocols (async methods awaiting ObjectRefs, `weight_version` as a property), which is what
the CheckpointEngineManager expects; the PartialRolloutClient takes either. Its `generate`
and `generate_group` calls travel batched (`_batching.py`): one Ray message per event-loop
tick, results back on one stream, so control calls (`abort_all`, ...) never queue behind
hundreds of samples.
Every call to the actor is awaited: nothing here blocks the event loop (no `ray.get`).
Knows nothing about vLLM itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from offbeat.ckpt_engine.target import ReceiveSpec
from offbeat.core.rollout.protocol import TokenOutput
from offbeat.rollout_vllm._batching import BatchedGenerateClient

__all__ = ["RemoteRolloutServer", "vllm_server_actor"]


def vllm_server_actor(config: Any, *, cpus: Sequence[int] | None = None, **ray_options: Any) -> Any:
    """Start a `VLLMRolloutServer(config)` as a Ray actor; return its handle.

    `cpus`: cores that every process of the replica is confined to (None: no confinement).
    `ray_options` go to `ray.remote` (e.g. `num_gpus=1`, `name=...`, `scheduling_strategy`);
    the defaults ask for one CPU and allow many concurrent calls.
    """
    import ray

    from offbeat.core.stacks import DIAGNOSTICS_GROUPS
    from offbeat.rollout_vllm._replica_actor import VLLMReplicaActor

    options = {
        "num_cpus": 1,
        "max_concurrency": 100_000,
        "concurrency_groups": DIAGNOSTICS_GROUPS,  # format_stacks answers on a loop of its own
        **ray_options,
    }
    return ray.remote(**options)(VLLMReplicaActor).remote(config, list(cpus or []))


class RemoteRolloutServer:
    """A Ray actor handle of `VLLMRolloutServer` seen as a local `GroupRolloutServer` and
    `SyncTarget` (what `CheckpointEngineManager` and `PartialRolloutClient` take)."""

    def __init__(
        self, handle: Any, weight_version: int | None = None, *, batched: bool = True
    ) -> None:
        self.handle = handle
        self._weight_version = weight_version
        # False: one Ray call per `generate` (handles without the batched methods, e.g. a
        # plain `ray.remote(VLLMRolloutServer)`; the path before batching).
        self.batched = batched
        self._calls = BatchedGenerateClient(handle)
        self._kv_noop = False  # the replica said its KV-cache calls do nothing

    @property
    def weight_version(self) -> int | None:
        """The last version the actor reported, or the one it was started with; None when
        neither is known yet (`await refresh()`). Never asks the actor: reading it does
        not block. `generate`, `update_weights` and `refresh()` keep it current."""
        return self._weight_version

    async def refresh(self) -> int:
        """Ask the actor for its version (awaited) and keep it."""
        self._weight_version = await self.handle.get_weight_version.remote()
        return self._weight_version

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: Mapping[str, Any]
    ) -> TokenOutput:
        if self.batched:
            out = await self._calls.generate(request_id, prompt_ids, sampling_params)
        else:
            out = await self.handle.generate.remote(request_id, prompt_ids, dict(sampling_params))
        self._weight_version = out.weight_version
        return out

    async def generate_group(
        self, request_id: str, prompt_ids: list[int], sampling_params: Mapping[str, Any], n: int
    ) -> list[TokenOutput]:
        if self.batched:
            outs = await self._calls.generate_group(request_id, prompt_ids, sampling_params, n)
        else:
            outs = await self.handle.generate_group.remote(
                request_id, prompt_ids, dict(sampling_params), n
            )
        if outs:
            self._weight_version = outs[-1].weight_version
        return outs

    async def compute_log_probs(
        self, request_id: str, token_ids: list[int], start: int
    ) -> list[float]:
        return await self.handle.compute_log_probs.remote(request_id, list(token_ids), start)

    async def compute_top_log_probs(
        self, request_id: str, token_ids: list[int], start: int, k: int
    ) -> dict[str, list]:
        return await self.handle.compute_top_log_probs.remote(request_id, list(token_ids), start, k)

    async def abort_all(self) -> None:
        await self.handle.abort_all.remote()

    async def resume(self) -> None:
        await self.handle.resume.remote()

    async def release_kv_cache(self) -> None:
        # A replica without sleep mode (CPU) says so once; its no-op calls are skipped
        # from then on (each is a round trip on the weight sync's critical path).
        if self._kv_noop:
            return
        self._kv_noop = await self.handle.release_kv_cache.remote() is False

    async def resume_kv_cache(self) -> None:
        if self._kv_noop:
            return
        self._kv_noop = await self.handle.resume_kv_cache.remote() is False

    async def sleep(self, level: int = 1) -> None:
        await self.handle.sleep.remote(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.handle.wake_up.remote(tags)

    async def device_memory(self) -> dict[str, int] | None:
        return await self.handle.device_memory.remote()

    async def update_weights(self, spec: ReceiveSpec) -> int:
        self._weight_version = await self.handle.update_weights.remote(spec)
        return self._weight_version

    async def status(self) -> dict[str, Any]:
        return await self.handle.status.remote()
