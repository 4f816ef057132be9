"""The default job's replicas under the default job's rollout load, without its trainer.

Shared by the job-mode benchmarks. `JobLoad` starts the recipe's replica(s) the way
`offbeat run separate_async` does (`init_ray`, `pin_trainer`, `prepare`,
`start_replicas`: the same Ray actor path and pinning), keeps
`runtime.max_concurrent_groups` groups of `rollout.n` samples in flight through the job's
agent loop, client and balancer, and syncs the job's own weights through the job's
`ReplicaPool` and checkpoint engine. `OLD_PATH` selects how the code ran before the
batched call path and the per-process resource split. `spin_cores()` keeps the trainer's
cores busy the way training does. Knows nothing about what is measured.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time
from typing import Any


# The path before the fix: one Ray actor call per sample, the replica's processes left
# wherever the OS puts them (only vLLM's OpenMP threads bound to the rollout core), and
# only the driver's main thread pinned to the trainer's core.
def old_server_config(old: bool):
    """While active (when `old`), replicas are built as before admission control: every
    call goes straight into vLLM (no bound on what the engine holds), so a sync aborts
    every call the driver has sent, queued or not. Patches the class the replica factory
    imports; the config object travels to the actor as built."""
    import contextlib
    import functools

    import offbeat.rollout_vllm.server as server

    if not old:
        return contextlib.nullcontext()
    real = server.VLLMServerConfig
    patched = functools.partial(real, engine_queue=10**9)

    @contextlib.contextmanager
    def patch():
        server.VLLMServerConfig = patched
        try:
            yield
        finally:
            server.VLLMServerConfig = real

    return patch()


OLD_PATH_OVERRIDES = [
    "runtime.rollout_cpus=[]",
    '+runtime.rollout_env.VLLM_CPU_OMP_THREADS_BIND="0"',
]

SPIN = """
import os, sys, torch
cpus = [int(c) for c in sys.argv[1].split(",") if c]
if cpus:
    os.sched_setaffinity(0, cpus)
torch.set_num_threads(max(1, len(cpus)))
a = torch.randn(256, 256)
while True:
    a = torch.tanh(a @ a)
"""


def spin_cores(cpus: list[int]) -> subprocess.Popen:
    """A process spinning float32 matmuls on `cpus` (the trainer's cores), as training
    does. Kill it when done."""
    return subprocess.Popen([sys.executable, "-c", SPIN, ",".join(map(str, cpus))])


def run_child(script: str, argv: list[str], path: str) -> Any:
    """Run `script argv` for one path in a fresh interpreter (its own Ray, nothing pinned
    yet) with `--paths path --child FILE`; return the JSON it wrote to FILE."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, script, *argv, "--paths", path, "--child", out]
        subprocess.run(cmd, check=True)
        with open(out) as f:
            return json.load(f)


def loadavg() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


class JobLoad:
    """`async with JobLoad(cfg) as job:` the job's replicas, client and weight sync.

    `old_path`: start them as the code did before the batched call path and the resource
    split (pair with `OLD_PATH_OVERRIDES` in the config). `sampling`: merged into every
    request's sampling params (e.g. `ignore_eos` to keep requests decoding).
    """

    def __init__(
        self, cfg: Any, *, old_path: bool = False, sampling: dict[str, Any] | None = None
    ) -> None:
        self.cfg = cfg
        self.old_path = old_path
        self.sampling = dict(sampling or {})
        self.inflight = 0  # generate calls the driver has outstanding
        self.completed = 0
        self.version = 0
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> JobLoad:
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        from offbeat.balancer.aio import AsyncLoadBalancer
        from offbeat.ckpt_engine import CheckpointEngineManager
        from offbeat.core.rewards import RewardRegistry
        from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
        from offbeat.core.runtime.host import init_ray, pin_trainer
        from offbeat.core.tasks import read_parquet
        from offbeat.core.trainer.agent_loop import SingleTurnAgentLoop
        from offbeat.core.trainer.elastic import start_replicas
        from offbeat.core.trainer.prepare import prepare
        from offbeat.core.trainer.replicas import ReplicaPool
        from offbeat.core.trainer.rollout_side import base_sampling

        cfg, rt = self.cfg, self.cfg.runtime
        t0 = time.perf_counter()
        init_ray(rt)
        if self.old_path:
            if rt.trainer_cpus:  # what pin_trainer did: the calling thread only
                os.sched_setaffinity(0, set(rt.trainer_cpus))
        else:
            pin_trainer(rt)
        self.prepared = p = await asyncio.to_thread(prepare, cfg)
        with old_server_config(self.old_path):
            self.servers = start_replicas(p)
        for s in self.servers.values():
            s.batched = not self.old_path
        await asyncio.gather(*(s.refresh() for s in self.servers.values()))
        self.startup_s = time.perf_counter() - t0
        tensors = sorted(load_file(str(p.model_dir / "model.safetensors")).items())
        self.named_tensors = lambda: iter(tensors)
        self.balancer = AsyncLoadBalancer(dict(self.servers))
        client = PartialRolloutClient(
            self.balancer, PartialRolloutConfig(max_tokens=cfg.rollout.max_tokens)
        )
        tokenizer = AutoTokenizer.from_pretrained(str(p.model_dir))
        rewards = RewardRegistry(name=cfg.reward.name, kwargs=cfg.reward.kwargs)
        self.agent = SingleTurnAgentLoop(
            _Counted(client, self), tokenizer, rewards, {**base_sampling(cfg), **self.sampling},
            prompt_key=cfg.data.prompt_key,
        )  # fmt: skip
        self.rows = [r for f in p.train_files for r in read_parquet(f)]
        self.manager = CheckpointEngineManager(rt.ckpt_backend, phase_timeout_s=rt.sync_timeout_s)
        self.pool = ReplicaPool(self.servers, self.balancer, self.manager)
        return self

    def start_rollout(self) -> None:
        """`max_concurrent_groups` workers, each generating one group after another."""
        uids = itertools.count()
        n = self.cfg.rollout.n

        async def work() -> None:
            while True:
                i = next(uids)
                await self.agent.sample(f"g{i}", self.rows[i % len(self.rows)], n)

        self._tasks = [
            asyncio.create_task(work()) for _ in range(self.cfg.runtime.max_concurrent_groups)
        ]

    async def stop_rollout(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def check(self) -> None:
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise RuntimeError("rollout worker crashed") from t.exception()

    async def sync(self) -> tuple[float, Any]:
        """One weight sync of the next version, as the trainer does it: (seconds, result)."""
        self.version += 1
        t0 = time.perf_counter()
        result = await self.pool.sync(self.named_tensors, self.version)
        return time.perf_counter() - t0, result

    async def server_status(self) -> list[dict]:
        return list(await asyncio.gather(*(s.status() for s in self.servers.values())))

    async def __aexit__(self, *exc: Any) -> None:
        from offbeat.core.trainer.elastic import shutdown_replicas

        await self.stop_rollout()
        self.manager.close()
        await shutdown_replicas(self.servers)


class _Counted:
    """The client, counting the driver's outstanding generate calls."""

    def __init__(self, client: Any, load: JobLoad) -> None:
        self.client, self.load = client, load

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.load.inflight += 1
        try:
            return await self.client.generate(*args, **kwargs)
        finally:
            self.load.inflight -= 1
            self.load.completed += 1


class GcPauses:
    """Durations of this process's garbage collections, by generation, since `take()`."""

    def __init__(self) -> None:
        import gc

        self.pauses: list[tuple[int, float]] = []
        self._t0 = 0.0
        self._gc = gc

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._t0))

    def start(self) -> None:
        self._gc.callbacks.append(self._callback)

    def take(self) -> float:
        """Longest collection since the last take."""
        pauses, self.pauses = self.pauses, []
        return max((s for _, s in pauses), default=0.0)

    def stop(self) -> None:
        self._gc.callbacks.remove(self._callback)


class LoopLag:
    """How late this event loop runs a 10 ms timer (max and total, since `take()`)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        async def run() -> None:
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                self.lags.append(time.perf_counter() - t - 0.01)

        self._task = asyncio.create_task(run())

    def take(self) -> float:
        lags, self.lags = self.lags, []
        return max(lags, default=0.0)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
