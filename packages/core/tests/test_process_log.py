"""Where a replica's process writes (`offbeat.core.process_log`): the paths a job gives its
replicas, the environment that carries them, the redirect itself (in a child process:
it changes file descriptors 1 and 2 for good), and the private Ray name it relies on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from offbeat.core.process_log import (
    HOOK,
    LOG_ENV,
    RAY_SETUP_HOOK_ENV,
    link_ray_logs,
    replica_log_env,
    replica_log_path,
    run_logs_dir,
)


def job(tmp: Path, verbose: bool = False) -> SimpleNamespace:
    trainer = SimpleNamespace(log_dir=str(tmp), experiment_name="e1", verbose=verbose)
    return SimpleNamespace(trainer=trainer)


def test_replica_files_live_under_the_run_log_dir(tmp_path):
    assert run_logs_dir(tmp_path, "e1") == tmp_path / "e1" / "logs"
    assert replica_log_path(job(tmp_path), "rollout-1") == tmp_path / "e1/logs/rollout-1.log"


def test_a_relative_log_dir_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a Ray worker may start elsewhere: it gets the full path
    path = replica_log_path(SimpleNamespace(trainer=job(Path("out")).trainer), "rollout-0")
    assert path == tmp_path / "out/e1/logs/rollout-0.log" and path.is_absolute()


def test_verbose_keeps_replicas_on_the_console(tmp_path):
    assert replica_log_path(job(tmp_path, verbose=True), "rollout-0") is None
    assert replica_log_path(SimpleNamespace(), "rollout-0") is None  # no trainer section
    assert replica_log_env(None) == {}


def test_the_env_names_the_file_and_the_hook(tmp_path):
    env = replica_log_env(tmp_path / "r.log")
    assert env == {LOG_ENV: str(tmp_path / "r.log"), RAY_SETUP_HOOK_ENV: HOOK}
    module, _, name = HOOK.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name).__name__ == "redirect_from_env"


CHILD = """
import os, subprocess, sys, warnings
from offbeat.core.process_log import redirect_from_env
print("before")
redirect_from_env()
redirect_from_env()  # a second call changes nothing
print("to stdout")
print("to stderr", file=sys.stderr)
warnings.warn("a warning")
os.write(1, b"fd 1\\n")
subprocess.run([sys.executable, "-c", "print('grandchild')"], check=True)
"""


def run_child(tmp: Path, env_path: str | None) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k != LOG_ENV}
    if env_path is not None:
        env[LOG_ENV] = env_path
    return subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60
    )


def test_redirect_sends_the_process_and_its_children_to_the_file(tmp_path):
    log = tmp_path / "new" / "dir" / "rollout-0.log"
    out = run_child(tmp_path, str(log))
    assert out.returncode == 0, out.stderr
    assert out.stdout == "before\n" and out.stderr == ""
    text = log.read_text()
    assert text.count("stdout and stderr from here on") == 1
    for line in ("to stdout", "to stderr", "UserWarning: a warning", "fd 1", "grandchild"):
        assert line in text, text


def test_without_the_variable_nothing_moves(tmp_path):
    out = run_child(tmp_path, None)
    assert out.returncode == 0 and "grandchild" in out.stdout and "to stderr" in out.stderr


def test_an_unwritable_file_leaves_the_output_where_it_was(tmp_path):
    (tmp_path / "f").write_text("")  # a file where the directory would go
    out = run_child(tmp_path, str(tmp_path / "f" / "r.log"))
    assert out.returncode == 0
    assert "to stdout" in out.stdout and "cannot write there" in out.stderr


def test_link_ray_logs(tmp_path):
    ray_logs = tmp_path / "session" / "logs"
    assert link_ray_logs(tmp_path / "run", ray_logs) is None  # no such directory
    ray_logs.mkdir(parents=True)
    link = link_ray_logs(tmp_path / "run", ray_logs)
    assert link == tmp_path / "run" / "ray" and link.resolve() == ray_logs
    newer = tmp_path / "session2"
    newer.mkdir()
    assert link_ray_logs(tmp_path / "run", newer).resolve() == newer  # a rerun's session
    mine = tmp_path / "other"
    (mine / "ray").mkdir(parents=True)
    assert link_ray_logs(mine, ray_logs) is None and (mine / "ray").is_dir()  # left alone


def test_ray_still_names_its_setup_hook_variable():
    from ray._private import ray_constants

    assert ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR == RAY_SETUP_HOOK_ENV, (
        "Ray renamed the environment variable that names a worker's setup hook: update "
        "offbeat.core.process_log.RAY_SETUP_HOOK_ENV (replicas would write to the console)"
    )
    from ray._private.workers import default_worker

    assert "WORKER_PROCESS_SETUP_HOOK_ENV_VAR" in Path(default_worker.__file__).read_text()
