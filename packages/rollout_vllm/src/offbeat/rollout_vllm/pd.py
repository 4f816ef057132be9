"""A prefill-decode (PD) disaggregated replica: P engines prefill, D engines decode, and
the balancer and the partial-rollout client see one ordinary replica.

Each request goes to a P engine with `max_tokens=1`: its prefill writes the prompt's KV
cache through the KV connector; then a D engine runs the request itself, loading that KV
instead of recomputing it, and decodes. The D engine's output is the replica's output
(the P engine's one token is dropped), so tokens, log-probs and weight versions are the D
engine's. Abort, resume, KV release, sleep, wake and weight updates go to every engine; a
weight update counts only when every engine holds the new version, and drops the stored
KV of the old weights.

The connector is vLLM's shared-storage example connector (`_kv_connector.py`): the P
engine writes each prompt's KV to one folder under `storage_path`, the D engine reads it.
Here the replica keeps one folder per prompt prefix alive while a request of it is in
flight (one prefill serves every request with the same prefix, a GRPO group or a repeated
prompt) and removes it after the last one.

It knows nothing about vLLM itself (the engines are anything with the server's methods:
`VLLMRolloutServer`s in this process, or their Ray proxies), nor about how weights travel.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import shutil
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from offbeat.ckpt_engine.target import ReceiveSpec
from offbeat.core.rollout.protocol import TokenOutput

__all__ = [
    "CONNECTORS",
    "PDRolloutServer",
    "SharedStorage",
    "pd_engine_kwargs",
    "pd_replica",
    "pd_servers",
]

logger = logging.getLogger(__name__)

# rollout.pd.connector -> (vLLM connector class, module vLLM imports it from).
CONNECTORS: dict[str, tuple[str, str]] = {
    "shared_storage": (
        "OffbeatSharedStorageConnector",
        "offbeat.rollout_vllm._kv_connector",
    ),
}
# vLLM's default KV block size on CUDA (the connector stores whole blocks).
BLOCK_SIZE = 16


@dataclass
class SharedStorage:
    """Where the shared-storage connector keeps KV caches: one folder per prompt prefix
    of `(n - 1) // block_size * block_size` tokens, named by the md5 of those token ids as
    int64 bytes (the connector's own naming; `test_pd.py` checks it against vLLM's)."""

    path: str
    block_size: int = BLOCK_SIZE

    def folder(self, prompt_ids: Sequence[int]) -> str | None:
        """The folder that holds `prompt_ids`' KV cache; None when the prompt is too short
        to have a whole block before its last token (then nothing is transferred)."""
        tokens = (len(prompt_ids) - 1) // self.block_size * self.block_size
        if tokens <= 0:
            return None
        data = array("q", prompt_ids[:tokens]).tobytes()
        return os.path.join(self.path, hashlib.md5(data, usedforsecurity=False).hexdigest())

    def remove(self, folder: str) -> None:
        shutil.rmtree(folder, ignore_errors=True)

    def clear(self) -> None:
        """Drop every stored KV cache (they hold the old weights' keys and values)."""
        if os.path.isdir(self.path):
            for name in os.listdir(self.path):
                shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)


def pd_engine_kwargs(
    engine_kwargs: Mapping[str, Any], role: str, storage: str, connector: str = "shared_storage"
) -> dict[str, Any]:
    """vLLM engine arguments of a P (`role="prefill"`) or D (`"decode"`) engine. A P engine
    prefills every prompt whole in the step that first schedules it (no chunked prefill):
    the connector stores a prompt's KV cache in that step, so a chunk would store blocks
    not computed yet."""
    if connector not in CONNECTORS:
        raise ValueError(
            f"rollout.pd.connector={connector!r}: expected one of {sorted(CONNECTORS)}"
        )
    if role not in ("prefill", "decode"):
        raise ValueError(f"PD engine role {role!r}: expected 'prefill' or 'decode'")
    name, module = CONNECTORS[connector]
    kwargs = dict(engine_kwargs)
    kwargs["kv_transfer_config"] = {
        "kv_connector": name,
        "kv_connector_module_path": module,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": storage},
    }
    if role == "prefill":
        kwargs["enable_chunked_prefill"] = False
        longest = int(kwargs.get("max_model_len") or 0)
        kwargs["max_num_batched_tokens"] = max(
            int(kwargs.get("max_num_batched_tokens") or 0), longest, 16384
        )
    return kwargs


def _aborted(version: int | None, server_id: str) -> TokenOutput:
    v = int(version or 0)
    return TokenOutput([], [], "aborted", v, v, v, extra={"server_id": server_id})


class PDRolloutServer:
    """P engines + D engines behind one `GroupRolloutServer` / `SyncTarget`.

    `prefill`, `decode`: the engines (each a server with `generate`, `abort_all`, ...).
    A request takes the P engine and the D engine with the fewest of this replica's
    requests in flight. `storage`: where the connector keeps KV caches (None: no
    transfer, every D engine prefills for itself; for tests of the routing alone).
    """

    def __init__(
        self,
        prefill: Sequence[Any],
        decode: Sequence[Any],
        storage: SharedStorage | None,
        *,
        server_id: str = "pd-0",
    ) -> None:
        if not prefill or not decode:
            raise ValueError(
                f"a PD replica needs at least one prefill and one decode engine, got "
                f"{len(prefill)} and {len(decode)}"
            )
        self.prefill, self.decode = list(prefill), list(decode)
        self.engines = [*self.prefill, *self.decode]
        self.storage = storage
        self.server_id = server_id
        self._load = {id(e): 0 for e in self.engines}
        self._ids = itertools.count()
        # Folder -> requests holding it; its prefill (done or running); its removal.
        self._holders: dict[str, int] = {}
        self._prefills: dict[str, asyncio.Future] = {}
        self._removals: dict[str, asyncio.Future] = {}
        self._broken: str | None = None
        self.stats = {
            "prefills": 0,
            "prefills_shared": 0,
            "no_transfer": 0,
            "aborted_in_prefill": 0,
        }

    # ---- identity -------------------------------------------------------------------
    @property
    def weight_version(self) -> int | None:
        """The oldest version any engine holds (None if one does not know yet)."""
        versions = [e.weight_version for e in self.engines]
        return None if None in versions else min(versions)

    def get_weight_version(self) -> int | None:
        return self.weight_version

    async def refresh(self) -> int | None:
        await asyncio.gather(*(e.refresh() for e in self.engines if hasattr(e, "refresh")))
        return self.weight_version

    # ---- generation -----------------------------------------------------------------
    def _pick(self, engines: list[Any]) -> Any:
        return min(engines, key=lambda e: self._load[id(e)])

    async def _on(self, engine: Any, call: str, *args: Any) -> Any:
        self._load[id(engine)] += 1
        try:
            return await getattr(engine, call)(*args)
        finally:
            self._load[id(engine)] -= 1

    async def _hold(self, folder: str) -> None:
        removal = self._removals.get(folder)
        if removal is not None:  # the P engine must not see a folder half removed
            await removal
        self._holders[folder] = self._holders.get(folder, 0) + 1

    def _release(self, folder: str) -> None:
        self._holders[folder] -= 1
        if self._holders[folder] == 0:
            del self._holders[folder]
            self._prefills.pop(folder, None)
            task = asyncio.ensure_future(asyncio.to_thread(self.storage.remove, folder))
            self._removals[folder] = task
            task.add_done_callback(lambda _t, f=folder: self._removals.pop(f, None))

    async def _prefill(self, request_id: str, prompt: list[int], folder: str) -> bool:
        """The prompt's KV cache in `folder`, written by a P engine once for every request
        holding the folder. False when the prefill was aborted (nothing was written)."""
        running = self._prefills.get(folder)
        if running is not None:
            self.stats["prefills_shared"] += 1
            return await asyncio.shield(running)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._prefills[folder] = future
        ok = False
        try:
            out = await self._on(
                self._pick(self.prefill), "generate", f"{request_id}-p", prompt,
                {"max_tokens": 1, "temperature": 0.0},
            )  # fmt: skip
            ok = out.stop_reason != "aborted"
            self.stats["prefills"] += 1
            return ok
        finally:
            # A prefill that failed or was aborted wrote nothing: the requests waiting on
            # it return "aborted" (their clients resend them), the next one prefills again.
            if not ok:
                self._prefills.pop(folder, None)
            future.set_result(ok)

    async def _with_kv(self, request_id: str, prompt: list[int], call: str, *args: Any):
        """Run `call` on a D engine after the P engine has written `prompt`'s KV; an
        aborted prefill returns None."""
        if self._broken is not None:
            raise RuntimeError(f"PD replica {self.server_id} is not serving: {self._broken}")
        folder = None if self.storage is None else self.storage.folder(prompt)
        if folder is None:
            self.stats["no_transfer"] += 1
            return await self._on(self._pick(self.decode), call, request_id, prompt, *args)
        await self._hold(folder)
        try:
            if not await self._prefill(request_id, prompt, folder):
                self.stats["aborted_in_prefill"] += 1
                return None
            return await self._on(self._pick(self.decode), call, request_id, prompt, *args)
        finally:
            self._release(folder)

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: Mapping[str, Any]
    ) -> TokenOutput:
        """Prefill on a P engine, decode on a D engine. An abort during the prefill returns
        "aborted" with no tokens (the client resends it); during decoding, the D engine's
        tokens so far."""
        prompt = list(prompt_ids)
        out = await self._with_kv(request_id, prompt, "generate", dict(sampling_params))
        if out is None:
            return _aborted(self.weight_version, self.server_id)
        out.extra["engine_id"] = out.extra.get("server_id")
        out.extra["server_id"] = self.server_id
        return out

    async def generate_group(
        self, request_id: str, prompt_ids: list[int], sampling_params: Mapping[str, Any], n: int
    ) -> list[TokenOutput]:
        """One prefill for the group; its `n` samples decode on one D engine."""
        prompt = list(prompt_ids)
        outs = await self._with_kv(request_id, prompt, "generate_group", dict(sampling_params), n)
        if outs is None:
            return [_aborted(self.weight_version, self.server_id) for _ in range(n)]
        for o in outs:
            o.extra["engine_id"] = o.extra.get("server_id")
            o.extra["server_id"] = self.server_id
        return list(outs)

    async def compute_log_probs(
        self, request_id: str, token_ids: list[int], start: int
    ) -> list[float]:
        # Scoring is one prefill: a P engine does it (it stores that KV too: held and
        # removed like a request's).
        return await self._score("compute_log_probs", request_id, list(token_ids), start)

    async def compute_top_log_probs(
        self, request_id: str, token_ids: list[int], start: int, k: int
    ) -> dict[str, list]:
        return await self._score("compute_top_log_probs", request_id, list(token_ids), start, k)

    async def _score(self, call: str, request_id: str, ids: list[int], *args: Any) -> Any:
        folder = None if self.storage is None else self.storage.folder(ids)
        if folder is not None:
            await self._hold(folder)
        try:
            return await self._on(self._pick(self.prefill), call, request_id, ids, *args)
        finally:
            if folder is not None:
                self._release(folder)

    async def storage_settled(self) -> None:
        """Until every KV folder released so far has been removed."""
        while self._removals:
            await asyncio.gather(*list(self._removals.values()), return_exceptions=True)

    # ---- every engine ---------------------------------------------------------------
    async def _all(self, call: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*(getattr(e, call)(*args) for e in self.engines)))

    async def abort_all(self) -> None:
        """Abort every engine: requests in prefill return "aborted" with no tokens, those
        decoding with their tokens so far. Stays paused until `resume()`."""
        await self._all("abort_all")

    async def resume(self) -> None:
        await self._all("resume")

    async def release_kv_cache(self) -> bool:
        return any(r is not False for r in await self._all("release_kv_cache"))

    async def resume_kv_cache(self) -> bool:
        return any(r is not False for r in await self._all("resume_kv_cache"))

    async def sleep(self, level: int = 1) -> None:
        await self._all("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._all("wake_up", tags)

    async def device_memory(self) -> dict[str, int] | None:
        engine = self.engines[0]
        return await engine.device_memory() if hasattr(engine, "device_memory") else None

    async def status(self) -> dict[str, Any]:
        async def one(e: Any) -> Any:
            s = e.status()
            return await s if asyncio.iscoroutine(s) else s

        engines = await asyncio.gather(*(one(e) for e in self.engines))
        return {
            "server_id": self.server_id,
            "weight_version": self.weight_version,
            "paused": any(s.get("paused") for s in engines),
            "prefill": list(engines[: len(self.prefill)]),
            "decode": list(engines[len(self.prefill) :]),
            "holders": len(self._holders),
            "broken": self._broken,
            **self.stats,
        }

    # ---- weight sync ----------------------------------------------------------------
    @property
    def sync_receivers(self) -> int:
        """How many receivers of a weight sync this replica is: one per engine (the
        checkpoint-engine manager gives it as many ranks, `update_weights_ranks`)."""
        return len(self.engines)

    async def update_weights_ranks(self, specs: Sequence[ReceiveSpec]) -> int:
        """Receive one version into every engine, spec `i` into engine `i` (P engines
        first); complete only when each holds it. Then drop the stored KV caches, which
        hold the old weights'."""
        if len(specs) != len(self.engines):
            raise ValueError(
                f"PD replica {self.server_id}: {len(specs)} receive specs for "
                f"{len(self.engines)} engines"
            )
        version = specs[0].version
        results = await asyncio.gather(
            *(e.update_weights(s) for e, s in zip(self.engines, specs, strict=True)),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        got = [None if isinstance(r, BaseException) else r for r in results]
        if errors or any(v != version for v in got):
            self._broken = f"weight update to version {version}: engines reported {got}"
            if errors:
                raise RuntimeError(f"PD replica {self.server_id}: {self._broken}") from errors[0]
            raise RuntimeError(f"PD replica {self.server_id}: {self._broken}")
        self._broken = None
        self._prefills.clear()
        if self.storage is not None:
            await asyncio.to_thread(self.storage.clear)
        return version

    async def update_weights(self, spec: ReceiveSpec) -> int:
        """A one-receiver sync reaches one engine only, which would leave the others on
        the old weights: refused (the manager calls `update_weights_ranks`)."""
        if len(self.engines) == 1:
            return await self.update_weights_ranks([spec])
        raise RuntimeError(
            f"PD replica {self.server_id} has {len(self.engines)} engines: a weight sync "
            f"must give it {self.sync_receivers} receivers (`sync_receivers`), one per engine"
        )

    def shutdown(self) -> None:
        for e in self.engines:
            stop = getattr(e, "shutdown", None)
            if stop is not None:
                stop()


# ---- building one -----------------------------------------------------------------------
def pd_servers(
    model: str,
    engine_kwargs: Mapping[str, Any],
    storage_path: str,
    *,
    prefill_engines: int = 1,
    decode_engines: int = 1,
    connector: str = "shared_storage",
    server_id: str = "pd-0",
) -> PDRolloutServer:
    """A PD replica of `VLLMRolloutServer`s in this process (all on this process's
    device(s): give `engine_kwargs` a `gpu_memory_utilization` that fits them all)."""
    from offbeat.rollout_vllm.server import VLLMRolloutServer, VLLMServerConfig

    os.makedirs(storage_path, exist_ok=True)

    def engine(role: str, i: int) -> Any:
        kwargs = pd_engine_kwargs(engine_kwargs, role, storage_path, connector)
        sid = f"{server_id}-{role[0]}{i}"
        return VLLMRolloutServer(VLLMServerConfig(model=model, engine_kwargs=kwargs, server_id=sid))

    prefill = [engine("prefill", i) for i in range(prefill_engines)]
    decode = [engine("decode", i) for i in range(decode_engines)]
    return PDRolloutServer(prefill, decode, SharedStorage(storage_path), server_id=server_id)


def pd_replica(spec: Any) -> PDRolloutServer:
    """`spec` (a `ReplicaSpec` of a job with `rollout.pd`) as a PD replica of Ray actors:
    each engine is a replica actor of its own with `spec.ray_options` (the replica's
    bundle); on one device (`rollout.pd.share_device`) the engines split it: each asks for
    `runtime.rollout_num_gpus / (prefill_engines + decode_engines)`. The KV storage is
    `rollout.pd.storage_path/<server id>` (default: a folder under /dev/shm)."""
    from dataclasses import replace

    from offbeat.rollout_vllm.replica import engine_kwargs_of, vllm_replica

    job = spec.job
    pd = job.rollout.pd
    server_id = spec.name
    root = pd.storage_path or os.path.join("/dev/shm", f"offbeat-pd-{os.getpid()}")
    storage = os.path.join(root, server_id)
    os.makedirs(storage, exist_ok=True)
    count = pd.prefill_engines + pd.decode_engines
    num_gpus = job.runtime.rollout_num_gpus
    ray_options = dict(spec.ray_options)
    if pd.share_device and num_gpus:
        ray_options.setdefault("num_gpus", num_gpus / count)

    def engine(role: str, i: int) -> Any:
        kwargs = pd_engine_kwargs(engine_kwargs_of(job), role, storage, pd.connector)
        one = replace(spec, server_id=f"{server_id}-{role[0]}{i}", ray_options=ray_options)
        return vllm_replica(one, engine_kwargs=kwargs)

    prefill = [engine("prefill", i) for i in range(pd.prefill_engines)]
    decode = [engine("decode", i) for i in range(pd.decode_engines)]
    return PDRolloutServer(prefill, decode, SharedStorage(storage), server_id=server_id)
