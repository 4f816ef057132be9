"""`offbeat.core.forkserver`: a forkserver child runs in the starting process's
environment, working directory and core mask (not the server's, from before the starter
changed them), and ends with the server."""

from __future__ import annotations

import os
import signal
import time
from multiprocessing import forkserver

import pytest

from offbeat.core.forkserver import ForkServerContext, server_pid

# The children's code, run by the builtin `exec` (a forkserver child unpickles its target
# by module name, and a test module's is not importable there).
REPORT = "import os; q.put((os.environ.get(m), os.getcwd(), sorted(os.sched_getaffinity(0))))"
SLEEP = "import os, time; q.put(os.getpid()); time.sleep(600)"


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_runs_in_the_starters_env_cwd_and_cores(tmp_path, monkeypatch):
    ctx = ForkServerContext()
    forkserver.ensure_running()  # the server's env, cwd and mask are this moment's
    cores = sorted(os.sched_getaffinity(0))
    mask = cores[-1:]
    marker = "OFFBEAT_TEST_PRESTART_MARKER"
    monkeypatch.setenv(marker, "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)
    queue = ctx.Queue()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, mask)
    try:
        proc = ctx.Process(target=exec, args=(REPORT, {"q": queue, "m": marker}))
        proc.start()
    finally:
        os.sched_setaffinity(0, before)
    env, cwd, cpus = queue.get(timeout=30)
    proc.join(60)
    assert proc.exitcode == 0
    assert env == "set-after-the-server-started"
    assert os.path.samefile(cwd, tmp_path)
    assert cpus == mask


def test_a_child_ends_with_the_server():
    ctx = ForkServerContext()
    queue = ctx.Queue()
    proc = ctx.Process(target=exec, args=(SLEEP, {"q": queue}))
    proc.start()
    child = queue.get(timeout=30)
    server = server_pid()
    assert server is not None
    os.kill(server, signal.SIGKILL)  # as when the actor dies: the server goes
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), f"the child {child} outlived its server {server}"
    forkserver._forkserver._stop()  # the next test gets a fresh server


def test_a_child_can_name_itself_after_its_environment_was_replaced():
    """vLLM names its engine core with setproctitle; the title must take."""
    pytest.importorskip("setproctitle")
    ctx = ForkServerContext()
    queue = ctx.Queue()
    code = (
        "import setproctitle; setproctitle.setproctitle('VLLM::EngineCore');"
        "q.put(open('/proc/self/comm').read().strip())"
    )
    proc = ctx.Process(target=exec, args=(code, {"q": queue}))
    proc.start()
    assert queue.get(timeout=30) == "VLLM::EngineCor"  # comm keeps 15 characters
    proc.join(30)
