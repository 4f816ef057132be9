"""How a job starts Ray (`offbeat.core.runtime.host.init_ray`): the private Ray names it
patches still exist and still do what it patches them for; a local Ray stays on loopback
with no dashboard UI and no usage stats.

The first tests start no Ray (ray.init is replaced); the last one starts a real local Ray.
"""

from __future__ import annotations

import inspect
import io
import os
import sys

import psutil
import pytest
import ray
from ray._private import ray_constants, services
from ray._private import worker as ray_worker

from offbeat.core.runtime.config import RuntimeConfig
from offbeat.core.runtime.host import init_ray

_ENV = (
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV",
    "RAY_USAGE_STATS_ENABLED",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "TQDM_DISABLE",
    "RAY_COLOR_PREFIX",
)
UPGRADE = (
    f"ray {ray.__version__}: offbeat.core.runtime.host.init_ray relies on this private Ray "
    "name; a Ray upgrade removed or moved it, so update init_ray (and this test) for it"
)


def test_private_ray_names_init_ray_patches_still_exist():
    assert callable(getattr(services, "resolve_ip_for_localhost", None)), (
        f"ray._private.services.resolve_ip_for_localhost is gone. {UPGRADE}"
    )
    assert callable(getattr(services, "is_localhost", None)), (
        f"ray._private.services.is_localhost is gone. {UPGRADE}"
    )
    assert hasattr(ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV"), (
        f"ray._private.ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV is gone. {UPGRADE}"
    )
    # Patching a module attribute only works if Ray still reads it through the module.
    assert "services.resolve_ip_for_localhost(" in inspect.getsource(ray_worker.init), (
        f"ray.init no longer calls services.resolve_ip_for_localhost. {UPGRADE}"
    )
    assert "ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV" in inspect.getsource(
        ray_worker._maybe_modify_runtime_env
    ), f"ray no longer reads ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV. {UPGRADE}"


def test_resolve_ip_for_localhost_is_what_would_leave_loopback(monkeypatch):
    # unpatched, Ray swaps a loopback node IP for the machine's address
    monkeypatch.setattr(services, "get_node_ip_address", lambda *a, **k: "10.9.9.9")
    assert services.resolve_ip_for_localhost("127.0.0.1") == "10.9.9.9", UPGRADE
    assert services.resolve_ip_for_localhost("10.1.2.3") == "10.1.2.3"
    assert services.is_localhost("127.0.0.1") and not services.is_localhost("10.1.2.3")


@pytest.fixture
def fake_ray_init(monkeypatch):
    """ray.init replaced: records its kwargs and what a loopback IP resolves to inside it."""
    calls = []

    def init(**kwargs):
        calls.append({**kwargs, "resolved": services.resolve_ip_for_localhost("127.0.0.1")})

    # on a machine whose only address is loopback the unpatched call would pass too
    monkeypatch.setattr(services, "get_node_ip_address", lambda *a, **k: "10.9.9.9")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", True)
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a log file, not a terminal
    saved = dict(os.environ)
    for name in _ENV:
        os.environ.pop(name, None)
    yield calls
    os.environ.clear()
    os.environ.update(saved)


def test_local_init_keeps_loopback_and_turns_dashboard_uv_and_usage_stats_off(fake_ray_init):
    original = services.resolve_ip_for_localhost
    init_ray(RuntimeConfig())
    (call,) = fake_ray_init
    assert call["resolved"] == "127.0.0.1"  # patched during ray.init ...
    assert services.resolve_ip_for_localhost is original  # ... and restored after
    assert call["include_dashboard"] is False
    assert call["_node_ip_address"] == "127.0.0.1"
    # a new local Ray even where another one runs on the machine (never joined)
    assert call["address"] == "local"
    assert ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV is False
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    # stdout is a log file: no library progress bars in the processes started from here
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert os.environ["TQDM_DISABLE"] == "1"
    assert os.environ["RAY_COLOR_PREFIX"] == "0"  # Ray's "(pid=...)" prefixes uncoloured
    assert call["log_to_driver"] is True  # a job passes trainer.verbose


def test_a_quiet_job_keeps_ray_workers_off_the_console(fake_ray_init):
    init_ray(RuntimeConfig(), log_to_driver=False)
    assert fake_ray_init[0]["log_to_driver"] is False
    # announce_logs links the Ray session's logs into the run's through these private names
    from ray._private.node import Node

    assert hasattr(ray_worker, "_global_node"), f"ray._private.worker._global_node? {UPGRADE}"
    assert callable(getattr(Node, "get_logs_dir_path", None)), f"Node.get_logs_dir_path? {UPGRADE}"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_library_progress_bars_stay(fake_ray_init, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _Terminal())
    init_ray(RuntimeConfig())
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
    assert "TQDM_DISABLE" not in os.environ
    assert "RAY_COLOR_PREFIX" not in os.environ


def test_a_user_choice_in_the_environment_is_kept(fake_ray_init):
    os.environ.update({name: "1" for name in _ENV})
    os.environ["TQDM_DISABLE"] = "0"
    init_ray(RuntimeConfig())
    assert ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV is True
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "1"
    assert os.environ["TQDM_DISABLE"] == "0"


def test_a_ray_without_the_patched_function_fails_with_a_clear_error(fake_ray_init, monkeypatch):
    monkeypatch.delattr(services, "resolve_ip_for_localhost")
    with pytest.raises(RuntimeError, match=r"no ray\._private\.services\.resolve_ip_for_localhost"):
        init_ray(RuntimeConfig())
    assert fake_ray_init == []  # nothing started


def _ray_processes() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


@pytest.mark.ray
@pytest.mark.slow
def test_local_ray_has_no_dashboard_ui_and_listens_on_loopback_only(ray_session):
    ray_session.own(ray_num_cpus=1)
    try:
        assert not ray_worker.global_worker.node.webui_url  # no dashboard URL published
        heads, listening = [], []
        for proc in psutil.Process().children(recursive=True):
            try:
                cmd = proc.cmdline()
                ports = [
                    (proc.name(), c.laddr.ip, c.laddr.port)
                    for c in proc.net_connections(kind="tcp")
                    if c.status == psutil.CONN_LISTEN
                ]
            except psutil.Error:
                continue
            listening += ports
            if any(a.endswith(os.path.join("dashboard", "dashboard.py")) for a in cmd):
                heads.append((cmd, ports))
        # Ray has no switch for the dashboard head process: it must be the headless one
        # (no frontend, the usage-stats module only) and listen on no port.
        for cmd, ports in heads:
            assert "--disable-frontend" in cmd, cmd
            assert "--modules-to-load=UsageStatsHead" in cmd, cmd
            assert ports == [], f"the dashboard head listens on {ports}"
        assert not [x for x in listening if x[2] == ray_constants.DEFAULT_DASHBOARD_PORT]
        loopback = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
        assert listening and all(ip in loopback for _, ip, _ in listening), listening
    finally:
        ray.shutdown()
