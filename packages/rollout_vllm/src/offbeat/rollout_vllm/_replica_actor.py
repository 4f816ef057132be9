"""What runs in a replica's Ray actor: `VLLMRolloutServer`, confined to the replica's cores,
plus the batched call path of `_batching.py`.

The process confines itself before the engine starts, so vLLM's engine-core process and
its workers inherit the mask: every process of the replica stays on its cores. Knows
nothing about which cores those are (the job's config decides, see `replica.py`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from offbeat.core.cpus import pin_process, pin_threads, process_tree_cpus
from offbeat.core.stacks import diagnostics_method, process_stacks
from offbeat.rollout_vllm import _prestart, compat
from offbeat.rollout_vllm._batching import Call, GenerateStream
from offbeat.rollout_vllm.server import VLLMRolloutServer, VLLMServerConfig

__all__ = ["VLLMReplicaActor"]


class VLLMReplicaActor(VLLMRolloutServer):
    """`VLLMRolloutServer(config)` started on `cpus` (None or empty: wherever Ray put it)."""

    def __init__(self, config: VLLMServerConfig, cpus: Sequence[int] | None = None) -> None:
        self.cpus = sorted(cpus or [])
        if self.cpus:
            pin_process(self.cpus)
        if _prestart.started():  # the engine core forks from the preloaded server
            compat.engine_core_context(_prestart.ForkServerContext())
        super().__init__(config)
        if self.cpus:  # the forkserver preloaded on any core; from now on, on ours
            for pid in _prestart.server_pids():
                pin_threads(pid, self.cpus)
        self._calls = GenerateStream(self.generate, self.generate_group)

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
        process it started (vLLM's engine core and workers)."""
        return {
            pid: (name, sorted(cpus))
            for pid, (name, cpus) in process_tree_cpus(os.getpid()).items()
        }

    def __repr__(self) -> str:  # Ray prints it in log prefixes
        config = getattr(self, "config", None)
        return f"VLLMReplicaActor({getattr(config, 'server_id', '?')})"
