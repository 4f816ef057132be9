"""Assemble and run a whole job from its config: data, model, Ray, rollout replicas, the
train engine, the checkpoint engine, and the training loop.

Knows no engine by name: rollout replicas come from the factory registered in
`ROLLOUT_ENGINES` under `rollout.engine` (offbeat.rollout_vllm provides "vllm"; a recipe
may register it), the train engine from `TRAIN_ENGINES` under `actor.engine` (and the
critic under `critic.engine`, the reference model under `actor.engine`, when needed). Safe
defaults: Ray starts locally with its dashboard off and binds to loopback; peak memory of
the trainer and of every replica's process tree is reported each step.

Knows no recipe and no reward by name: a recipe changes the job through `JobExtension`s
(`offbeat.core.trainer.extension`) it passes to `run_job`, and a reward that needs more than
a scorer declares its extension in `REWARD_EXTENSIONS`, which `run_job` asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offbeat.core import compat
from offbeat.core.config import JobConfig, TrainerConfig
from offbeat.core.config.run import RunConfig
from offbeat.core.cpus import pin_process
from offbeat.core.device import current_device
from offbeat.core.models.resolve import resolve_model
from offbeat.core.models.tiny import TINY_PREFIX
from offbeat.core.rewards import checks as _reward_checks  # noqa: F401  (registers its rules)
from offbeat.core.rollout import record_checks as _record_checks  # noqa: F401  (its rules)
from offbeat.core.rollout.replica_spec import ReplicaSpec, start_replica
from offbeat.core.runtime import checks as _runtime_checks  # noqa: F401  (registers its rules)
from offbeat.core.runtime.config import RuntimeConfig
from offbeat.core.runtime.launch import (
    hybrid_replicas,
    replica_options,
    start_pools,
    start_trainer,
    start_trainer_side,
)
from offbeat.core.runtime.launch import trainer_in_driver as _trainer_in_driver
from offbeat.core.tasks import checks as _prompt_checks  # noqa: F401  (registers its rules)
from offbeat.core.trainer import extension as ext
from offbeat.core.trainer import runtime_checks  # noqa: F401  (registers its rules)
from offbeat.core.trainer.elastic import replacement_for, shutdown_replicas, start_hybrid_replicas
from offbeat.core.trainer.extension import JobExtension


# ---- building blocks ---------------------------------------------------------------------
def wants_warm_start(cfg: RunConfig) -> bool:
    """`warm_start.enabled` null (auto): only offbeat's own tiny models; true/false: as said."""
    ws = cfg.warm_start
    if ws.steps <= 0 or ws.enabled is False:
        return False
    return (
        ws.enabled is True or cfg.model.path.startswith(TINY_PREFIX) or _is_tiny_vlm(cfg.model.path)
    )


def _is_tiny_vlm(path: str) -> bool:
    from offbeat.core.models.tiny_vlm import TINY_VLM_PREFIX

    return path == TINY_VLM_PREFIX


def resolve_data(cfg: RunConfig, out_dir: Path) -> tuple[list[str], list[str]]:
    """The dataset files; a synthetic task is written when none are configured."""
    train, val = list(cfg.data.train_files), list(cfg.data.val_files)
    if train:
        return train, val
    from offbeat.core.tasks import write_task_files

    t = cfg.task
    d = Path(t.out_dir) if t.out_dir else out_dir / f"{t.name}-{t.seed}-{t.min_len}-{t.max_len}"
    if t.name == "shapes":  # the visual task: images of squares, count or colour
        from offbeat.core.tasks.visual import write_visual_task_files

        tr, va = write_visual_task_files(d, n_train=t.n_train, n_val=t.n_val, seed=t.seed)
        return [str(tr)], val or [str(va)]
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


def init_ray(rt: RuntimeConfig, *, num_gpus: int | None = None, log_to_driver: bool = True) -> None:
    """Join `rt.ray_address`, or start a local Ray that sees `num_gpus` GPUs (None: Ray
    counts them). `log_to_driver`: Ray prints its workers' output on this console (a job
    passes `trainer.verbose`; otherwise it stays in the Ray session's log directory).

    Local: dashboard UI off, bound to loopback, usage stats off (the job reports to
    nothing outside). Ray has no switch for its dashboard *processes*: with the dashboard
    off it still starts a headless dashboard head (usage-stats module only, no port) and
    the raylet's dashboard agent. When stdout is not a terminal, library progress bars
    are turned off for the processes started from here on. The private Ray names this
    relies on are `offbeat.core.compat`'s (a unit test fails loudly if an upgrade moves one).
    """
    # Under `uv run`, Ray would start every worker through `uv run` again with the
    # working directory uploaded as a package (minutes per worker here); workers of a
    # job share the driver's environment, so use its interpreter directly.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import sys

    if not (hasattr(sys.stdout, "isatty") and sys.stdout.isatty()):
        # Model-loading progress bars (transformers here; tqdm in the processes Ray starts)
        # redraw with carriage returns: keep them out of a log file.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # Ray's "(pid=...)" in plain text
    import ray

    if os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] in ("0", "false", "False"):
        compat.ray_skip_uv_run()
    if ray.is_initialized():
        return
    if rt.ray_address:
        ray.init(address=rt.ray_address, log_to_driver=log_to_driver)
        return
    # Ray swaps a loopback node IP for the machine's reachable one, and its servers bind to
    # the node IP: keep loopback so a local job listens on nothing else.
    with compat.local_ray_on(rt.node_ip):
        ray.init(
            address="local",  # a new local Ray, never one found running on the machine
            num_cpus=rt.ray_num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            _node_ip_address=rt.node_ip,
            log_to_driver=log_to_driver,
            configure_logging=False,
        )


def announce_logs(cfg: RunConfig) -> Path | None:
    """Unless `trainer.verbose`: make the run's process-log directory (each replica writes
    its file there, see `offbeat.core.process_log`), link the Ray session's log directory
    into it as `ray` (found through a private Ray name: `compat.ray_session_logs_dir`), and name it
    on the console. Returns it as configured (None when verbose)."""
    from offbeat.core.process_log import link_ray_logs, run_logs_dir

    t = cfg.trainer
    if t.verbose:
        return None
    logs = Path(t.log_dir) / t.experiment_name / "logs"
    run_logs_dir(t.log_dir, t.experiment_name).mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(Exception):  # a joined cluster's logs may live elsewhere
        link_ray_logs(logs, compat.ray_session_logs_dir())
    print(
        f"offbeat: engine and Ray logs in {logs}/ (trainer.verbose=true prints them here)",
        flush=True,
    )
    return logs


def split_gpus(cfg: RunConfig) -> int | None:
    """On a CUDA machine with a local Ray: Ray is given the first `rollout_devices` GPUs
    (the replicas') and this process, the trainer, takes the next one, or with
    `runtime.share_trainer_gpu` the last replica's; returns the GPUs Ray may hand out
    (None: nothing to split). A Ray cluster that is joined places replicas on whatever
    GPUs it has: start it without the trainer's GPU."""
    if cfg.resources.device != "cuda" or cfg.runtime.ray_address or not _trainer_in_driver(cfg):
        return None  # a trainer group takes its GPUs from the trainer pool
    n = cfg.resources.rollout_devices
    torch.cuda.set_device(n - 1 if getattr(cfg.runtime, "share_trainer_gpu", False) else n)
    return n


def pin_trainer(rt: RuntimeConfig) -> None:
    """Pin every thread of this process (Ray's driver threads included) and whatever it
    starts from now on (torch's threads, the event loop's executor, subprocesses) to
    `rt.trainer_cpus`. Call after Ray started, so Ray's own daemons keep every core; the
    rollout replicas confine themselves to `rt.rollout_cpus`.

    Also sizes torch's threads to `rt.trainer_threads`, here on the calling thread: a
    torch call in a worker thread (`asyncio.to_thread`) before `prepare` otherwise runs
    with one OpenMP thread per machine core squeezed onto the pinned ones (a teacher's
    supervised build ran 6x slower so)."""
    if rt.trainer_cpus:
        pin_process(rt.trainer_cpus)
    torch.set_num_threads(rt.trainer_threads)


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


def make_tracer(trainer: TrainerConfig, run_dir: Path) -> Any:
    """The step timeline <run_dir>/trace.json: every step with `trainer.trace`, else the
    first `trainer.trace_steps` (None when that is 0)."""
    from offbeat.core.trace import Tracer

    if not trainer.trace and trainer.trace_steps <= 0:
        return None
    return Tracer(run_dir / "trace.json", steps=None if trainer.trace else trainer.trace_steps)


def reward_registry(cfg: JobConfig) -> Any:
    """The job's `RewardRegistry`: `reward.functions` (user functions by data_source) first,
    then the registered scorers; `reward.name` other than "task" scores every row."""
    from offbeat.core.rewards import RewardRegistry

    r = cfg.reward
    return RewardRegistry(r.functions, name=r.name, kwargs=r.kwargs, timeout_s=r.timeout_s)


# ---- the run -----------------------------------------------------------------------------
@dataclass
class Prepared:
    """A config whose model path and dataset files are resolved to local files."""

    cfg: RunConfig
    model_dir: Path
    train_files: list[str]
    val_files: list[str]
    setup_s: float
    notes: list[str] = field(default_factory=list)  # what prepare decided, for the log
    model_spec: str = ""  # model.path as configured (e.g. offbeat-tiny:tiny), before resolving


def prepare(cfg: RunConfig) -> Prepared:
    """Seeds, threads, the synthetic dataset, the (tiny, warm-started) model, and the step
    count `trainer.total_epochs` leaves."""
    from offbeat.core.tasks import read_parquet
    from offbeat.core.tasks.dataloader import count_rows, steps_within_epochs
    from offbeat.core.trainer.warm_start import warm_start

    t0 = time.perf_counter()
    seed = cfg.trainer.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(cfg.runtime.trainer_threads)
    from offbeat.core.models import cache_root

    cache_dir = cache_root()
    train_files, val_files = resolve_data(cfg, cache_dir / "tasks")
    model_dir = resolve_model(cfg.model.path, cache_dir / "models")
    notes = []
    if wants_warm_start(cfg):
        rows = [r for f in train_files for r in read_parquet(f)]
        model_dir = warm_start(
            model_dir, rows, cfg.warm_start, cache_dir=cache_dir / "warm_start",
            prompt_key=cfg.data.prompt_key, override_config=cfg.model.override_config,
        )  # fmt: skip
    elif cfg.warm_start.steps > 0 and cfg.warm_start.enabled is None:
        notes.append("no warm start (offbeat-tiny models only; warm_start.enabled=true)")
    t = cfg.trainer
    steps = steps_within_epochs(
        t.total_training_steps, t.total_epochs, count_rows(train_files), cfg.data.train_batch_size
    )
    if steps != t.total_training_steps:
        notes.append(f"trainer.total_epochs={t.total_epochs} leaves {steps} steps")
    job = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=str(model_dir)),
        trainer=dataclasses.replace(t, total_training_steps=steps),
    )
    return Prepared(
        job, model_dir, train_files, val_files, time.perf_counter() - t0, notes, cfg.model.path
    )


def run_header(p: Prepared, replicas: int, ready_s: float) -> str:
    """The run's first log line: its name (trainer.project_name/experiment_name) and what
    `prepare` decided."""
    t = p.cfg.trainer
    return (
        f"offbeat: run {t.project_name}/{t.experiment_name} mode={t.mode} "
        f"steps={t.total_training_steps} replicas={replicas} model={p.model_dir} "
        f"setup={p.setup_s:.1f}s replicas_ready={ready_s:.1f}s"
    ) + "".join(f"; {n}" for n in p.notes)


def start_replicas(p: Prepared, pools: Any = None) -> dict[str, Any]:
    """Start every rollout replica (not awaited: they come up while the trainer builds),
    each in its bundle of `pools`' rollout pool when given."""
    cfg = p.cfg
    from offbeat.core.config.support import replica_devices

    n = cfg.resources.rollout_devices // replica_devices(cfg.rollout)
    specs = [
        ReplicaSpec(cfg, str(p.model_dir), i, ray_options=replica_options(pools, i))
        for i in range(n)
    ]
    return {s.name: start_replica(s) for s in specs}


async def run_with_replicas(
    p: Prepared,
    servers: dict[str, Any],
    *,
    version_offset: int | None = None,
    pools: Any = None,
    side: Any = None,
    hybrids: dict[str, Any] | None = None,
    extensions: list[JobExtension] | tuple[JobExtension, ...] = (),
) -> dict[str, Any]:
    """Build the trainer side around running `servers` and train to the end; then each of
    `extensions` reports into the summary, and all of them close (also on failure).

    `version_offset=None` reads the version the replicas hold (0 for fresh ones). A trainer
    group goes into `pools`' trainer pool, or into a pool of its own made here. `side`: a
    trainer already built (a two-phase start: `run_job`), closed here at the end;
    `hybrids`: its hybrid replicas, asleep. The extensions' replicas, if any, were started
    by the caller (`run_job`); here they are set up once `servers` answer."""
    exts = list(extensions)
    try:
        summary = await _train(p, servers, version_offset, pools, side, hybrids, exts)
        for e in exts:
            await e.report(summary)
    finally:
        await ext.close_extensions(exts)
    return summary


async def _train(
    p: Prepared,
    servers: dict[str, Any],
    version_offset: int | None,
    pools: Any,
    side: Any,
    hybrids: dict[str, Any] | None,
    exts: list[JobExtension],
) -> dict[str, Any]:
    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.core.agent.loops import build_agent
    from offbeat.core.data.vision import load_tokenizer
    from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
    from offbeat.core.rollout.replay import attach
    from offbeat.core.tasks import PromptDataLoader, read_parquet
    from offbeat.core.trainer.checkpoint import make_checkpoints
    from offbeat.core.trainer.hybrid import HybridReplicas
    from offbeat.core.trainer.ppo import CriticAndReference
    from offbeat.core.trainer.replicas import ReplicaPool
    from offbeat.core.trainer.report import job_summary
    from offbeat.core.trainer.rollout import make_buffer, make_driver
    from offbeat.core.trainer.tracking import make_tracker
    from offbeat.core.trainer.trainer import Trainer

    t0 = time.perf_counter()
    cfg, rt = p.cfg, p.cfg.runtime
    servers = dict(servers)
    run_dir = Path(cfg.trainer.log_dir) / cfg.trainer.experiment_name
    run_dir.mkdir(parents=True, exist_ok=True)
    own_pools = None
    if side is None:
        side, pools, own_pools = await start_trainer_side(cfg, pools)
    engine = side.engine
    tokenizer, processor = load_tokenizer(p.model_dir, cfg.model)
    await asyncio.gather(*(s.refresh() for s in servers.values() if hasattr(s, "refresh")))
    for e in exts:
        await e.setup(p, pools)
    if version_offset is None:
        version_offset = max(int(s.weight_version) for s in servers.values())
    ready_s = time.perf_counter() - t0

    balancer = AsyncLoadBalancer(dict(servers))
    client = PartialRolloutClient(balancer, PartialRolloutConfig(max_tokens=cfg.rollout.max_tokens))
    manager = side.manager
    pool = tracker = tracer = None
    try:
        rewards = reward_registry(cfg)
        buffer = make_buffer(cfg)
        replacement = (
            replacement_for(p, pools, servers) if rt.replica_replace_attempts > 0 else None
        )
        pool = ReplicaPool(servers, balancer, manager, replacement=replacement)
        agent = build_agent(
            cfg.agent, client, tokenizer, rewards, base_sampling(cfg),
            prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
            on_engine_error=pool.on_engine_error,
            **({"processor": processor} if processor is not None else {}),
        )  # fmt: skip
        loader = PromptDataLoader(
            p.train_files, shuffle=cfg.data.shuffle, seed=cfg.data.seed,
            prompt_key=cfg.data.prompt_key,
        )  # fmt: skip
        train_agent = agent
        for e in exts:
            train_agent = e.wrap_agent(train_agent)
        # rollout.replay / rollout.record: the driver's loader and agent, the trainer's hooks.
        rr = await asyncio.to_thread(
            attach, cfg, model=p.model_spec or cfg.model.path, model_dir=p.model_dir,
            tokenizer=tokenizer, loader=loader, agent=train_agent,
            version=lambda: pool.last_sync.version if pool.last_sync else version_offset,
        )  # fmt: skip
        driver = make_driver(cfg, buffer, rr.loader, rr.agent)
        pool.on_pause = driver.clock.pause
        val_rows = [r for f in p.val_files for r in read_parquet(f)]
        validator = ext.job_validator(cfg, agent, val_rows, exts)
        checkpoints = make_checkpoints(cfg.trainer, rt.checkpoint_keep_last)
        tracker = make_tracker(cfg, run_dir, checkpoints)
        # The critic and the reference model, when the algorithm needs them: on the
        # trainer group's ranks (critic.placement=actor, ref.placement=actor; the one local
        # rank with the trainer in the driver) or on groups of their own; the side carries
        # their engines.
        critic_ref = CriticAndReference.build(
            cfg.algorithm, cfg.critic, cfg.rollout,
            critic_engine=side.critic_engine, reference_engine=side.reference_engine,
        )  # fmt: skip
        tracer = make_tracer(cfg.trainer, run_dir)
        hybrid = None
        if hybrids:
            hybrid = HybridReplicas(
                hybrids, pool, side.hybrid_manager(cfg), client=client,
                sleep_level=cfg.trainer.hybrid_sleep_level, phase_timeout_s=rt.sync_timeout_s,
            )  # fmt: skip
        memory = ReplicaMemory(pool.servers, hybrid.servers if hybrid is not None else None)
        trainer = Trainer(
            cfg, pad_token_id=tokenizer.pad_token_id or 0, engine=engine, buffer=buffer,
            driver=driver, pool=pool, tracker=tracker, checkpoints=checkpoints,
            validator=validator, rollout_memory=memory, version_offset=version_offset,
            tracer=tracer, hybrid=hybrid, critic_ref=critic_ref,
            step_hooks=[*rr.hooks, *(h for e in exts for h in e.step_hooks())],
            batch_hook=ext.batch_hook(exts),
        )  # fmt: skip
        tracker.event(run_header(p, len(servers), ready_s) + "".join(f"; {n}" for n in rr.notes))
        summary = await trainer.run()
        plot = tracker.finish(tracer.path if tracer is not None else None)
    finally:
        if tracker is not None:  # the run failed (after a clean close this does nothing)
            tracker.close(artifacts=[tracer.path if tracer is not None else None], failed=True)
        if pool is not None:
            await pool.close()
            await shutdown_replicas(pool.started)  # the replacements it started
        await side.close()
        if own_pools is not None:
            own_pools.remove()
    return job_summary(
        summary, run_dir=run_dir, tracker=tracker, plot=plot, tracer=tracer,
        startup_s=p.setup_s + ready_s, pool=pool, hybrid=hybrid, trainer=trainer,
    )  # fmt: skip


async def run_job(
    cfg: RunConfig, extensions: list[JobExtension] | tuple[JobExtension, ...] = ()
) -> dict[str, Any]:
    """Run `cfg` (already validated) to the end on fresh replicas, extended by
    `extensions` and then by the one `reward.name` declares; shut every replica down after
    (the extensions' too)."""
    t0 = time.perf_counter()
    exts = [*extensions, *ext.reward_extensions(cfg)]
    cfg = await asyncio.to_thread(ext.configure, cfg, exts)  # builds, before Ray and pinning
    init_ray(cfg.runtime, num_gpus=split_gpus(cfg), log_to_driver=cfg.trainer.verbose)
    logs = announce_logs(cfg)
    pin_trainer(cfg.runtime)
    p = await asyncio.to_thread(prepare, cfg)  # the replicas load the prepared model
    pools = await start_pools(p.cfg, extra=ext.extra_pools(p.cfg, exts))
    servers: dict[str, Any] = {}
    hybrids: dict[str, Any] = {}
    started: dict[str, Any] = {}  # the extensions' replicas
    order: list[str] = []
    try:
        side = None
        if hybrid_replicas(p.cfg):
            # Two-phase start. The trainer first: its ranks take their bundles, so the
            # hybrid replicas can be placed beside them. Phase 1: the hybrid replicas start
            # and go to sleep. Phase 2: the standalone replicas start.
            side = await start_trainer(p.cfg, pools)
            order.append("trainer")
            try:
                hybrids = await start_hybrid_replicas(p, pools)
                order.append("hybrid_asleep")
                servers = start_replicas(p, pools)
            except BaseException:
                await side.close()
                raise
        else:
            servers = start_replicas(p, pools)
        order.append("standalone")
        ext.start_extension_replicas(p.cfg, pools, exts, started)
        summary = await run_with_replicas(
            p, servers, version_offset=0, pools=pools, side=side, hybrids=hybrids, extensions=exts
        )
    finally:
        await shutdown_replicas({**servers, **hybrids, **started})
        pools.remove()
    summary["total_wall_s"] = time.perf_counter() - t0
    summary["start_order"] = order
    summary["logs"] = str(logs) if logs is not None else None
    return summary
