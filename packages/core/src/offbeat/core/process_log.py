"""Where the processes a job starts write: each rollout replica's process (its Ray actor,
the engine's own processes it starts) writes into one file under the run's log directory,
so the console keeps offbeat's lines.

A replica's actor is told its file through its environment (`replica_log_env`). Ray runs a
worker's setup hook before the worker loads any class, so the worker points its stdout and
stderr (file descriptors 1 and 2) at the file before it imports an engine: what the
engine prints at import, and every process it starts afterwards (vLLM's engine core, a
forkserver, SGLang's server), writes there too. Ray names that hook through a private
environment variable (`RAY_SETUP_HOOK_ENV`; a unit test fails when Ray moves it). That
works on a Ray the job started and on one it joined, whatever `log_to_driver` says.

Stdlib only: the hook runs first thing in a fresh Ray worker. Knows nothing of which
engine runs in the process, nor of Ray beyond that one variable name.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

__all__ = [
    "LOG_ENV",
    "RAY_SETUP_HOOK_ENV",
    "link_ray_logs",
    "redirect_from_env",
    "redirect_stdio",
    "replica_log_env",
    "replica_log_path",
    "run_logs_dir",
]

# The file a process started with this variable sends its stdout and stderr to.
LOG_ENV = "OFFBEAT_PROCESS_LOG"
# Ray's worker process runs the function this names (module.function) before anything else
# (ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR).
RAY_SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
HOOK = f"{__name__}.redirect_from_env"


def run_logs_dir(log_dir: str | os.PathLike, experiment_name: str) -> Path:
    """The run's process logs: `<log_dir>/<experiment_name>/logs`, absolute (a Ray worker
    need not start in the driver's working directory)."""
    return Path(log_dir).absolute() / experiment_name / "logs"


def replica_log_path(job: JobConfig, server_id: str) -> Path | None:
    """The file replica `server_id` of `job` (a RunConfig) writes to, or None when
    `trainer.verbose` keeps its output on the console (through Ray's log forwarding)."""
    t = getattr(job, "trainer", None)
    if t is None or getattr(t, "verbose", False):
        return None
    return run_logs_dir(t.log_dir, t.experiment_name) / f"{server_id}.log"


def replica_log_env(path: str | os.PathLike | None) -> dict[str, str]:
    """Environment variables for a replica's Ray actor (its `runtime_env` env_vars) that
    send the actor's process, and every process it starts, to `path` (None: nothing)."""
    if path is None:
        return {}
    return {LOG_ENV: str(path), RAY_SETUP_HOOK_ENV: HOOK}


def _writes_to(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def redirect_stdio(path: str | os.PathLike) -> bool:
    """Point this process's file descriptors 1 and 2 (and so `sys.stdout`, `sys.stderr`,
    and every process started from now on) at `path`, appended to, its directory made.
    Returns False when they already write there."""
    path = Path(path)
    if _writes_to(1, path) and _writes_to(2, path):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.reconfigure(line_buffering=True)  # a file someone tails
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[offbeat] {stamp} process {os.getpid()}: stdout and stderr from here on", flush=True)
    return True


def redirect_from_env() -> None:
    """Ray's setup hook: `redirect_stdio($OFFBEAT_PROCESS_LOG)` when it is set. Never
    raises (Ray would end the worker): a file it cannot open leaves the output where it
    was, with one line that says why."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    try:
        redirect_stdio(path)
    except OSError as e:
        print(f"[offbeat] {LOG_ENV}={path}: cannot write there ({e}); output stays here",
              file=sys.stderr)  # fmt: skip


def link_ray_logs(logs_dir: str | os.PathLike, ray_logs: str | os.PathLike | None) -> Path | None:
    """`<logs_dir>/ray` -> `ray_logs` (the Ray session's log directory, where the other
    workers' output goes), replacing an older link; None when there is nothing to link
    (no directory on this machine) or the link cannot be made."""
    if not ray_logs or not Path(ray_logs).is_dir():
        return None
    link = Path(logs_dir) / "ray"
    try:
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        elif link.exists():
            return None  # something of the user's: leave it
        link.symlink_to(Path(ray_logs).absolute(), target_is_directory=True)
    except OSError:
        return None
    return link
