"""The machine a job runs on: Ray (joined, or started locally and kept to loopback), the
GPU the trainer takes beside the replicas', the trainer's cores, the run's process logs,
and what the job listens on.

Knows the runtime's config and Ray's private names through `offbeat.core.compat`; not the
job's replicas, trainer or loop.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from offbeat.core import compat
from offbeat.core.config.run import RunConfig
from offbeat.core.cpus import pin_process
from offbeat.core.runtime.config import RuntimeConfig
from offbeat.core.runtime.launch import trainer_in_driver as _trainer_in_driver

__all__ = ["announce_logs", "init_ray", "listening_addresses", "pin_trainer", "split_gpus"]


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
