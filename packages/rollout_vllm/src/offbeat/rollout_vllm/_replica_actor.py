"""What runs in a replica's Ray actor before the shared shell (`offbeat.core.rollout.remote`)
takes over: `build(config, cpus)` confines the process to the replica's cores and starts
`VLLMRolloutServer`.

The process confines itself before the engine starts, so vLLM's engine-core process and
its workers inherit the mask: every process of the replica stays on its cores. Knows
nothing about which cores those are (the job's config decides, see `replica.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from offbeat.core.cpus import pin_process, pin_threads
from offbeat.rollout_vllm import _prestart, compat
from offbeat.rollout_vllm.server import VLLMRolloutServer, VLLMServerConfig

__all__ = ["build"]


def build(config: VLLMServerConfig | Mapping[str, Any], cpus: Sequence[int]) -> VLLMRolloutServer:
    """`VLLMRolloutServer(config)` started on `cpus` (empty: wherever Ray put it); `config`
    may come as the keywords of a `VLLMServerConfig` (the driver then never imports vLLM)."""
    if not isinstance(config, VLLMServerConfig):
        config = VLLMServerConfig(**config)
    cpus = sorted(cpus)
    if cpus:
        pin_process(cpus)
    if _prestart.started():  # the engine core forks from the preloaded server
        compat.engine_core_context(_prestart.ForkServerContext())
    server = VLLMRolloutServer(config)
    if cpus:  # the forkserver preloaded on any core; from now on, on ours
        for pid in _prestart.server_pids():
            pin_threads(pid, cpus)
    return server
