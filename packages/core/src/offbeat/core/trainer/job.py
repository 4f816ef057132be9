"""Assemble and run a whole job from its config: data, model, Ray, rollout replicas, the
train engine, the checkpoint engine, and the training loop.

Knows no engine by name: rollout replicas come from the factory registered in
`ROLLOUT_ENGINES` under `rollout.engine` (offbeat.rollout_vllm provides "vllm"; a recipe
may register it), the train engine from `TRAIN_ENGINES` under `actor.engine`. Safe
defaults: Ray starts locally with its dashboard off and binds to loopback; peak memory of
the trainer and of every replica's process tree is reported each step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offbeat.core.config import JobConfig
from offbeat.core.config.validation import Problems, check
from offbeat.core.cpus import machine_cpus, pin_process
from offbeat.core.device import current_device
from offbeat.core.registry import ROLLOUT_ENGINES, TRAIN_ENGINES
from offbeat.core.tasks.synthetic import SyntheticTaskConfig
from offbeat.core.trainer.warm_start import WarmStartConfig

logger = logging.getLogger(__name__)

TINY_PREFIX = "offbeat-tiny:"


@dataclass
class RuntimeConfig:
    """Where and how the job's processes run."""

    ray_address: str = ""  # "": start a local Ray (dashboard off, loopback); else join it
    ray_num_cpus: int = 2  # CPUs of the local Ray
    node_ip: str = "127.0.0.1"  # the address a local Ray binds to
    trainer_threads: int = 1  # torch threads of the trainer process
    # The resource split on a CPU-only machine (empty: no pinning). trainer_cpus: cores of
    # the driver process (the trainer) and everything it starts. rollout_cpus: cores of
    # every process of the rollout replicas (the Ray actor, the engine's processes and
    # threads), shared out among the replicas; disjoint from trainer_cpus.
    trainer_cpus: list[int] = field(default_factory=list)
    rollout_cpus: list[int] = field(default_factory=list)
    rollout_num_cpus: float = 1.0  # Ray CPUs per rollout replica actor
    rollout_num_gpus: float = 0.0  # Ray GPUs per replica (tensor_parallel_size on GPUs)
    rollout_env: dict[str, str] = field(
        default_factory=lambda: {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    )
    max_concurrent_groups: int = 32  # prompt groups generated at once
    ckpt_backend: str = "shm"  # a name in offbeat.ckpt_engine.backends()
    sync_timeout_s: float = 300.0
    stall_timeout_s: float = 900.0  # no rollout progress this long while training waits: fail
    checkpoint_keep_last: int = 2
    progress_bar: bool = True


@dataclass
class RunConfig(JobConfig):
    """A job config plus what the embedded default needs: a synthetic task when no
    dataset is given, a brief warm start, and runtime knobs."""

    task: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


# ---- validation rules this module adds (run by offbeat.core.config.validate) -----------
@check
def _offbeat_trainer_rules(cfg: Any, p: Problems) -> None:
    s = cfg.async_training
    if (
        cfg.trainer.mode == "separate_async"
        and s.max_off_policy_strategy == "drop"
        and isinstance(s.num_warmup_batches, int)
        and type(s.max_off_policy_threshold) is int  # a bad threshold is reported on its own
        and s.max_off_policy_threshold > 0
        and s.num_warmup_batches + 1 > s.max_off_policy_threshold
    ):
        from offbeat.core.buffer import drop_depth_message

        p.add(
            "async_training.num_warmup_batches",
            s.num_warmup_batches,
            drop_depth_message(s.num_warmup_batches, s.max_off_policy_threshold),
        )
    from offbeat.core.trainer.tracking import LOGGERS

    bad = [x for x in cfg.trainer.loggers if x not in LOGGERS]
    if bad:
        p.add("trainer.loggers", list(cfg.trainer.loggers), f"each one of {list(LOGGERS)}")
    path = cfg.model.path
    if isinstance(path, str) and path.startswith(TINY_PREFIX):
        from offbeat.core.models import TINY_MODEL_PRESETS

        size = path[len(TINY_PREFIX) :]
        if size not in TINY_MODEL_PRESETS:
            p.add(
                "model.path", path, f"{TINY_PREFIX}<size> with size in {sorted(TINY_MODEL_PRESETS)}"
            )
    elif isinstance(path, str) and path.startswith(("/", "./", "../")) and not Path(path).is_dir():
        p.add("model.path", path, "an existing HF model directory")
    for key in ("train_files", "val_files"):
        for f in getattr(cfg.data, key):
            if not Path(f).is_file():
                p.add(f"data.{key}", f, "existing parquet files")
    rt = getattr(cfg, "runtime", None)
    if rt is not None:
        from offbeat.ckpt_engine import backends

        if rt.ckpt_backend not in backends():
            p.add("runtime.ckpt_backend", rt.ckpt_backend, f"one of {sorted(backends())}")
        p.require_int("runtime.max_concurrent_groups", rt.max_concurrent_groups)
        usable = sorted(os.sched_getaffinity(0))
        bad_cpus = [c for c in rt.trainer_cpus if c not in usable]
        if bad_cpus:
            p.add("runtime.trainer_cpus", list(rt.trainer_cpus), f"cores of this machine: {usable}")
        p.require_int("runtime.trainer_threads", rt.trainer_threads)


@check
def _offbeat_placement_rules(cfg: Any, p: Problems) -> None:
    rt = getattr(cfg, "runtime", None)
    if rt is None or not rt.rollout_cpus:
        return
    usable = machine_cpus()
    cpus = list(rt.rollout_cpus)
    if any(isinstance(c, bool) or not isinstance(c, int) for c in cpus):
        p.add("runtime.rollout_cpus", cpus, f"core ids (ints) of this machine: {usable}")
        return
    if [c for c in cpus if c not in usable]:
        p.add("runtime.rollout_cpus", cpus, f"cores of this machine: {usable}")
    elif len(set(cpus)) != len(cpus):
        p.add("runtime.rollout_cpus", cpus, "each core once")
    shared = sorted(set(cpus) & set(rt.trainer_cpus))
    if shared:
        p.add(
            "runtime.rollout_cpus",
            cpus,
            f"cores disjoint from runtime.trainer_cpus={list(rt.trainer_cpus)} (both name "
            f"{shared})",
        )


# ---- building blocks ---------------------------------------------------------------------
def resolve_model(path: str, cache_dir: Path) -> Path:
    """`offbeat-tiny:<size>` builds (or reuses) a tiny model; anything else is a path."""
    if path.startswith(TINY_PREFIX):
        from offbeat.core.models import build_tiny_model

        size = path[len(TINY_PREFIX) :]
        # Normal init: the warm start and RL train it (0.3 is for untrained demos).
        return build_tiny_model(cache_dir / f"tiny-{size}", size, initializer_range=0.02)
    return Path(path)


def resolve_data(cfg: RunConfig, out_dir: Path) -> tuple[list[str], list[str]]:
    """The dataset files; a synthetic task is written when none are configured."""
    train, val = list(cfg.data.train_files), list(cfg.data.val_files)
    if train:
        return train, val
    from offbeat.core.tasks import write_task_files

    t = cfg.task
    d = Path(t.out_dir) if t.out_dir else out_dir / f"{t.name}-{t.seed}-{t.min_len}-{t.max_len}"
    tr, va = write_task_files(
        d,
        t.name,
        n_train=t.n_train,
        n_val=t.n_val,
        seed=t.seed,
        min_len=t.min_len,
        max_len=t.max_len,
    )
    return [str(tr)], val or [str(va)]


def init_ray(rt: RuntimeConfig) -> None:
    # Under `uv run`, Ray would start every worker through `uv run` again with the
    # working directory uploaded as a package (minutes per worker here); workers of a
    # job share the driver's environment, so use its interpreter directly.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray
    from ray._private import ray_constants

    if os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] in ("0", "false", "False"):
        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    if ray.is_initialized():
        return
    if rt.ray_address:
        ray.init(address=rt.ray_address, log_to_driver=True)
        return
    from ray._private import services

    # Ray swaps a loopback node IP for the machine's reachable one, and its servers bind to
    # the node IP: keep loopback so a local job listens on nothing else.
    original = services.resolve_ip_for_localhost
    if services.is_localhost(rt.node_ip):
        services.resolve_ip_for_localhost = lambda host: host
    try:
        ray.init(
            num_cpus=rt.ray_num_cpus,
            include_dashboard=False,
            _node_ip_address=rt.node_ip,
            log_to_driver=True,
            configure_logging=False,
        )
    finally:
        services.resolve_ip_for_localhost = original


def pin_trainer(rt: RuntimeConfig) -> None:
    """Pin every thread of this process (Ray's driver threads included) and whatever it
    starts from now on (torch's threads, the event loop's executor, subprocesses) to
    `rt.trainer_cpus`. Call after Ray started, so Ray's own daemons keep every core; the
    rollout replicas confine themselves to `rt.rollout_cpus`."""
    if rt.trainer_cpus:
        pin_process(rt.trainer_cpus)


def listening_addresses() -> list[tuple[str, str]]:
    """(process name, address) of every TCP socket listened on by this process and its
    descendants (the local Ray cluster and the engines it started)."""
    import psutil

    me = psutil.Process()
    out = []
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            for c in proc.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((proc.name(), c.laddr.ip))
    return out


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
    spawned), sampled when asked."""

    def __init__(self, servers: dict[str, Any]) -> None:
        self.servers = servers
        self.peak: dict[str, int] = {}

    async def __call__(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for sid, server in list(self.servers.items()):
            handle = getattr(server, "handle", None)
            if handle is None:
                continue
            try:
                pid = await asyncio.wait_for(
                    handle.__ray_call__.remote(lambda self: os.getpid()), 5
                )
            except Exception:
                continue
            rss = await asyncio.to_thread(_tree_rss_bytes, pid)
            self.peak[sid] = max(self.peak.get(sid, 0), rss)
        if self.peak:
            out["memory/rollout_peak_rss_gb"] = max(self.peak.values()) / 1e9
        out["memory/trainer_peak_gb"] = current_device().memory_stats().peak_bytes / 1e9
        return out


def base_sampling(cfg: JobConfig) -> dict[str, Any]:
    ro = cfg.rollout
    params: dict[str, Any] = {
        "temperature": ro.temperature,
        "top_p": ro.top_p,
        "max_tokens": ro.max_tokens,
    }
    if ro.top_k is not None and ro.top_k > 0:
        params["top_k"] = ro.top_k
    return params


# ---- the run -----------------------------------------------------------------------------
@dataclass
class Prepared:
    """A config whose model path and dataset files are resolved to local files."""

    cfg: RunConfig
    model_dir: Path
    train_files: list[str]
    val_files: list[str]
    setup_s: float


def prepare(cfg: RunConfig) -> Prepared:
    """Seeds, threads, the synthetic dataset and the (tiny, warm-started) model."""
    from offbeat.core.tasks import read_parquet
    from offbeat.core.trainer.warm_start import warm_start

    t0 = time.perf_counter()
    seed = cfg.trainer.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(cfg.runtime.trainer_threads)
    cache_dir = Path(os.environ.get("OFFBEAT_CACHE_DIR", Path.home() / ".cache" / "offbeat"))
    train_files, val_files = resolve_data(cfg, cache_dir / "tasks")
    model_dir = resolve_model(cfg.model.path, cache_dir / "models")
    if cfg.warm_start.steps > 0:
        rows = [r for f in train_files for r in read_parquet(f)]
        model_dir = warm_start(
            model_dir, rows, cfg.warm_start, cache_dir=cache_dir / "warm_start",
            prompt_key=cfg.data.prompt_key,
        )  # fmt: skip
    job = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model_dir)))
    return Prepared(job, model_dir, train_files, val_files, time.perf_counter() - t0)


def start_replicas(p: Prepared) -> dict[str, Any]:
    """Start every rollout replica (not awaited: they come up while the trainer builds)."""
    cfg = p.cfg
    factory = ROLLOUT_ENGINES.get(cfg.rollout.engine)
    n = cfg.resources.rollout_devices // cfg.rollout.tensor_parallel_size
    return {f"rollout-{i}": factory(cfg, str(p.model_dir), i) for i in range(n)}


async def run_with_replicas(
    p: Prepared, servers: dict[str, Any], *, version_offset: int | None = None
) -> dict[str, Any]:
    """Build the trainer side around running `servers` and train to the end.

    `version_offset=None` reads the version the replicas hold (0 for fresh ones)."""
    from transformers import AutoTokenizer

    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.ckpt_engine import CheckpointEngineManager
    from offbeat.core.buffer import AsyncReplayBuffer, BufferConfig
    from offbeat.core.rewards import RewardRegistry
    from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
    from offbeat.core.tasks import PromptDataLoader, read_parquet
    from offbeat.core.trainer.agent_loop import SingleTurnAgentLoop
    from offbeat.core.trainer.checkpoint import CheckpointManager
    from offbeat.core.trainer.replicas import ReplicaPool
    from offbeat.core.trainer.rollout import RolloutDriver
    from offbeat.core.trainer.tracking import MetricsTracker
    from offbeat.core.trainer.trainer import Trainer, TrainerSettings
    from offbeat.core.trainer.validation import Validator

    t0 = time.perf_counter()
    cfg, rt = p.cfg, p.cfg.runtime
    servers = dict(servers)
    run_dir = Path(cfg.trainer.log_dir) / cfg.trainer.experiment_name
    run_dir.mkdir(parents=True, exist_ok=True)
    # The train engine builds while the replicas start.
    engine = TRAIN_ENGINES.get(cfg.actor.engine).from_job_config(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or str(p.model_dir))
    await asyncio.gather(*(s.refresh() for s in servers.values() if hasattr(s, "refresh")))
    if version_offset is None:
        version_offset = max(int(s.weight_version) for s in servers.values())
    ready_s = time.perf_counter() - t0

    balancer = AsyncLoadBalancer(dict(servers))
    client = PartialRolloutClient(balancer, PartialRolloutConfig(max_tokens=cfg.rollout.max_tokens))
    manager = CheckpointEngineManager(rt.ckpt_backend, phase_timeout_s=rt.sync_timeout_s)
    try:
        rewards = RewardRegistry(name=cfg.reward.name, kwargs=cfg.reward.kwargs)
        s = cfg.async_training
        buffer = AsyncReplayBuffer(
            BufferConfig(
                groups_per_step=cfg.data.train_batch_size,
                max_off_policy_threshold=s.max_off_policy_threshold,
                max_off_policy_strategy=s.max_off_policy_strategy,
                num_warmup_batches=0 if cfg.trainer.mode == "sync" else s.num_warmup_batches,
            )
        )
        pool = ReplicaPool(servers, balancer, manager)
        agent = SingleTurnAgentLoop(
            client, tokenizer, rewards, base_sampling(cfg), prompt_key=cfg.data.prompt_key,
            max_prompt_length=cfg.data.max_prompt_length, on_engine_error=pool.on_engine_error,
        )  # fmt: skip
        loader = PromptDataLoader(p.train_files, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
        driver = RolloutDriver(
            buffer, loader, agent, n=cfg.rollout.n, max_concurrent_groups=rt.max_concurrent_groups
        )
        pool.on_pause = driver.clock.pause
        val_rows = [r for f in p.val_files for r in read_parquet(f)]
        wants_val = cfg.trainer.test_freq > 0 or cfg.trainer.val_before_train
        validator = Validator(agent, val_rows) if val_rows and wants_val else None
        tracker = MetricsTracker(
            run_dir, cfg.trainer.loggers, total_steps=cfg.trainer.total_training_steps,
            progress=rt.progress_bar,
        )  # fmt: skip
        checkpoints = (
            None
            if cfg.trainer.save_freq < 0 and not cfg.trainer.resume
            else CheckpointManager(cfg.trainer.checkpoint_dir, keep_last=rt.checkpoint_keep_last)
        )
        settings = TrainerSettings.from_job(cfg, pad_token_id=tokenizer.pad_token_id or 0)
        trainer = Trainer(
            settings, engine=engine, buffer=buffer, driver=driver, pool=pool, tracker=tracker,
            checkpoints=checkpoints, validator=validator, rollout_memory=ReplicaMemory(servers),
            version_offset=version_offset,
        )  # fmt: skip
        tracker.event(
            f"offbeat: mode={cfg.trainer.mode} replicas={len(servers)} model={p.model_dir} "
            f"setup={p.setup_s:.1f}s replicas_ready={ready_s:.1f}s"
        )
        try:
            summary = await trainer.run()
        finally:
            tracker.close()
        plot = tracker.plot()
    finally:
        manager.close()
    summary.update(
        {
            "run_dir": str(run_dir),
            "metrics": str(tracker.jsonl_path),
            "plot": str(plot) if plot else None,
            "startup_s": p.setup_s + ready_s,
            "removed_replicas": dict(pool.removed),
            "trainer": trainer,
        }
    )
    return summary


async def run_job(cfg: RunConfig) -> dict[str, Any]:
    """Run `cfg` (already validated) to the end on fresh replicas; shut them down after."""
    t0 = time.perf_counter()
    init_ray(cfg.runtime)
    pin_trainer(cfg.runtime)
    p = await asyncio.to_thread(prepare, cfg)  # the replicas load the prepared model
    servers = start_replicas(p)
    try:
        summary = await run_with_replicas(p, servers, version_offset=0)
    finally:
        await shutdown_replicas(servers)
    summary["total_wall_s"] = time.perf_counter() - t0
    return summary


async def shutdown_replicas(servers: dict[str, Any]) -> None:
    import ray

    for s in servers.values():
        handle = getattr(s, "handle", None)
        if handle is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(handle.shutdown.remote(), 30)
            with contextlib.suppress(Exception):
                ray.kill(handle)
