"""The replicas' memory as a run reports it each step: the peak RSS of each rollout
replica's process tree, the hybrid replicas' resident RSS, and the trainer's peak.

Knows a replica's Ray handle (to ask its pid) and psutil; not what the replicas do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from offbeat.core.device import current_device

__all__ = ["ReplicaMemory"]


def _tree_rss_bytes(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for pr in procs:
        with contextlib.suppress(psutil.Error):
            total += pr.memory_info().rss
    return total


class ReplicaMemory:
    """Peak RSS of each replica's process tree (the actor and the engine processes it
    spawned), sampled when asked; `servers` may change between samples (replacements).
    `hybrid`: the hybrid replicas, reported apart as their resident RSS now (sampled
    between steps, when they sleep: on CPU vLLM has no sleep mode and stays resident)."""

    def __init__(self, servers: dict[str, Any], hybrid: dict[str, Any] | None = None) -> None:
        self.servers = servers
        self.hybrid = hybrid if hybrid is not None else {}
        self.peak: dict[str, int] = {}

    @staticmethod
    async def _rss(server: Any) -> int | None:
        handle = getattr(server, "handle", None)
        if handle is None:
            return None
        try:
            pid = await asyncio.wait_for(handle.__ray_call__.remote(lambda self: os.getpid()), 5)
        except Exception:
            return None
        return await asyncio.to_thread(_tree_rss_bytes, pid)

    async def __call__(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for sid, server in list(self.servers.items()):
            rss = await self._rss(server)
            if rss is not None:
                self.peak[sid] = max(self.peak.get(sid, 0), rss)
        if self.peak:
            out["memory/rollout_peak_rss_gb"] = max(self.peak.values()) / 1e9
        hybrid = [await self._rss(s) for s in list(self.hybrid.values())]
        if any(r is not None for r in hybrid):
            out["memory/hybrid_rss_gb"] = max(r for r in hybrid if r is not None) / 1e9
        out["memory/trainer_peak_gb"] = current_device().memory_stats().peak_bytes / 1e9
        return out
