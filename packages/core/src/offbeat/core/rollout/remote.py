"""One Ray shell and one proxy for every rollout engine's replica.

`replica_actor(build, config, cpus=..., **ray_options)` starts a `ReplicaActor`: a plain
async actor that imports `build` ("module:function", the engine package's) inside its own
process and calls `build(config, cpus)` there, which confines the process to `cpus` and
returns the engine's server (a `RolloutServer`: `VLLMRolloutServer`, `SGLangRolloutServer`).
So the driver never imports the engine: the actor class is this module's, not a subclass
of the server. The actor forwards the protocol's calls to the server and adds the batched
call path of `_batching.py` (one Ray message per event-loop tick, results on one stream).

`RemoteRolloutServer` turns the actor handle back into the `GroupRolloutServer` /
`SyncTarget` protocols (async methods awaiting ObjectRefs, `weight_version` as a property),
which is what the CheckpointEngineManager and the PartialRolloutClient expect. Every call
to the actor is awaited: nothing here blocks the event loop (no `ray.get`).
Knows nothing about any engine: what a server can do is what it has.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from offbeat.core.rollout._batching import BatchedGenerateClient, Call, GenerateStream
from offbeat.core.rollout.protocol import TokenOutput
from offbeat.core.stacks import DIAGNOSTICS_GROUPS, diagnostics_method, process_stacks

__all__ = ["RemoteRolloutServer", "ReplicaActor", "replica_actor"]


def _load(build: str) -> Any:
    module, _, name = build.partition(":")
    if not module or not name:
        raise ValueError(f"replica build {build!r}: expected 'package.module:function'")
    return getattr(importlib.import_module(module), name)


def _images_kwarg(multi_modal_data: Any) -> dict[str, Any]:
    """`{"multi_modal_data": ...}` when a scored prompt has images, else nothing."""
    return {"multi_modal_data": multi_modal_data} if multi_modal_data else {}


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class ReplicaActor:
    """The actor of one replica: `build(config, cpus)` run in the actor's process, then
    every RolloutServer / SyncTarget call forwarded to the server it returned."""

    def __init__(self, build: str, config: Any, cpus: Sequence[int] | None = None) -> None:
        self.cpus = sorted(cpus or [])
        self.server = _load(build)(config, self.cpus)
        self._calls = GenerateStream(
            self.server.generate, getattr(self.server, "generate_group", None)
        )

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.server, name, None)
        if method is None:
            raise NotImplementedError(f"{type(self.server).__name__} has no {name}()")
        return await _maybe_await(method(*args, **kwargs))

    # ---- the RolloutServer protocol -------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict):
        return await self.server.generate(request_id, prompt_ids, sampling_params)

    async def generate_group(self, request_id: str, prompt_ids: list[int], params: dict, n: int):
        return await self._call("generate_group", request_id, prompt_ids, params, n)

    # `multi_modal_data` (a scored prompt's images) reaches the server only when given:
    # a text-only server's methods need not take it.
    async def compute_log_probs(
        self, request_id: str, token_ids: list[int], start: int, multi_modal_data: Any = None
    ):
        mm = _images_kwarg(multi_modal_data)
        return await self._call("compute_log_probs", request_id, token_ids, start, **mm)

    async def compute_top_log_probs(
        self, request_id: str, token_ids: list[int], start: int, k, multi_modal_data: Any = None
    ):
        mm = _images_kwarg(multi_modal_data)
        return await self._call("compute_top_log_probs", request_id, token_ids, start, k, **mm)

    async def abort_all(self) -> None:
        await self._call("abort_all")

    async def resume(self) -> None:
        await self._call("resume")

    async def release_kv_cache(self) -> Any:
        return await self._call("release_kv_cache")

    async def resume_kv_cache(self) -> Any:
        return await self._call("resume_kv_cache")

    async def sleep(self, level: int = 1) -> None:
        await self._call("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call("wake_up", tags)

    async def device_memory(self) -> dict[str, int] | None:
        if getattr(self.server, "device_memory", None) is None:
            return None
        return await self._call("device_memory")

    async def update_weights(self, spec: Any) -> int:
        return await self._call("update_weights", spec)

    async def status(self) -> dict[str, Any]:
        return await self._call("status")

    async def get_weight_version(self) -> int:
        """The server's version; where the server has a health probe (`refresh`), that
        probe (it raises when the server is unhealthy)."""
        if getattr(self.server, "refresh", None) is not None:
            return await self._call("refresh")
        return await self._call("get_weight_version")

    def shutdown(self) -> None:
        self.server.shutdown()

    # ---- the batched call path (driver side: BatchedGenerateClient) -------------------
    async def submit_generate(self, client_id: str, calls: list[Call]) -> None:
        self._calls.submit(client_id, calls)

    async def generate_results(self, client_id: str):
        async for items in self._calls.results(client_id):
            yield items

    async def cancel_generate(self, client_id: str, keys: list[int]) -> None:
        self._calls.cancel(client_id, keys)

    async def close_generate(self, client_id: str) -> None:
        self._calls.close(client_id)

    # ---- diagnostics ------------------------------------------------------------------
    @diagnostics_method
    async def format_stacks(self) -> str:
        """This process's threads and asyncio tasks (the stall watchdog's dump asks for
        them). It runs on an event loop of its own (a Ray concurrency group), so it
        answers while a call blocks the actor's main loop."""
        return process_stacks()

    # ---- placement ------------------------------------------------------------------
    def process_cpus(self) -> dict[int, tuple[str, list[int]]]:
        """pid -> (name, cores its threads may run on) for this actor's process and every
        process it started (the engine's own processes)."""
        from offbeat.core.cpus import process_tree_cpus

        return {
            pid: (name, sorted(cpus))
            for pid, (name, cpus) in process_tree_cpus(os.getpid()).items()
        }

    def __repr__(self) -> str:  # Ray prints it in log prefixes
        config = getattr(getattr(self, "server", None), "config", None)
        return f"ReplicaActor({getattr(config, 'server_id', '?')})"


def replica_actor(
    build: str, config: Any, *, cpus: Sequence[int] | None = None, **ray_options: Any
) -> Any:
    """Start a `ReplicaActor` that runs `build(config, cpus)` ("module:function"); return its
    handle. `cpus`: cores every process of the replica is confined to (None or empty: no
    confinement; `build` does the pinning). `ray_options` go to `ray.remote` (e.g.
    `num_gpus`, `scheduling_strategy`, `runtime_env`); the defaults ask for one CPU and
    allow many concurrent calls."""
    import ray

    options = {
        "num_cpus": 1,
        "max_concurrency": 100_000,
        "concurrency_groups": DIAGNOSTICS_GROUPS,  # format_stacks answers on a loop of its own
        **ray_options,
    }
    return ray.remote(**options)(ReplicaActor).remote(build, config, list(cpus or []))


class RemoteRolloutServer:
    """A Ray actor handle of a replica seen as a local `GroupRolloutServer` and
    `SyncTarget` (what `CheckpointEngineManager` and `PartialRolloutClient` take).
    `missing`: the protocol's optional methods the engine's server lacks (e.g.
    `generate_group`); they read as None here, so `supports_group` and its kin say no."""

    def __init__(
        self,
        handle: Any,
        weight_version: int | None = None,
        *,
        batched: bool = True,
        missing: Iterable[str] = (),
    ) -> None:
        self.handle = handle
        self._weight_version = weight_version
        # False: one Ray call per `generate` (handles without the batched methods, e.g. a
        # plain `ray.remote(VLLMRolloutServer)`; the path before batching).
        self.batched = batched
        self._calls = BatchedGenerateClient(handle)
        self._kv_noop = False  # the replica said its KV-cache calls do nothing
        for name in missing:
            if name not in _OPTIONAL:
                raise ValueError(f"missing={name!r}: only {sorted(_OPTIONAL)} may be missing")
            setattr(self, name, None)

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
        self, request_id: str, token_ids: list[int], start: int, multi_modal_data: Any = None
    ) -> list[float]:
        mm = _images_kwarg(multi_modal_data)
        return await self.handle.compute_log_probs.remote(request_id, list(token_ids), start, **mm)

    async def compute_top_log_probs(
        self,
        request_id: str,
        token_ids: list[int],
        start: int,
        k: int,
        multi_modal_data: Any = None,
    ) -> dict[str, list]:
        mm = _images_kwarg(multi_modal_data)
        return await self.handle.compute_top_log_probs.remote(
            request_id, list(token_ids), start, k, **mm
        )

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

    async def update_weights(self, spec: Any) -> int:
        self._weight_version = await self.handle.update_weights.remote(spec)
        return self._weight_version

    async def status(self) -> dict[str, Any]:
        return await self.handle.status.remote()


# What an engine's server may lack (the rest is the RolloutServer / SyncTarget protocol).
_OPTIONAL = frozenset(
    {"generate_group", "compute_log_probs", "compute_top_log_probs", "device_memory"}
)
