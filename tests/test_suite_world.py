"""The test session's own rules (the root conftest.py), checked in a pytest of their own:
a timeout prints every thread's and asyncio task's stack and fails that test only; the
fast tier leaves marked tests out and refuses a Ray; the cache is the session's, never
the user's. These run in the fast tier: a child pytest on a few probe tests, no Ray."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBES = """
import asyncio, os, threading, time
import pytest

@pytest.mark.timeout(2)
def test_hangs_in_a_task():
    threading.Thread(target=lambda: time.sleep(60), name="probe-sleeper", daemon=True).start()
    async def stuck_forever():
        await asyncio.Event().wait()
    async def main():
        asyncio.create_task(stuck_forever(), name="probe-stuck-task")
        await asyncio.sleep(60)
    asyncio.run(main())

def test_after_the_timeout_the_session_goes_on():
    print("CACHE", os.environ["OFFBEAT_CACHE_DIR"], os.environ["XDG_CACHE_HOME"])

@pytest.mark.e2e
def test_marked_e2e():
    raise AssertionError("the fast tier ran a test marked e2e")

@pytest.mark.slow
def test_marked_slow_timeout(request):
    print("MARKED", request.node.get_closest_marker("timeout").args)

def test_starts_ray_unmarked():
    import ray
    ray.init(num_cpus=1)

def test_prints_then_runs_long():
    print("PROBE-LONG-CALL-OUTPUT")
    time.sleep(1.5)

def test_prints_and_is_quick():
    print("PROBE-QUICK-CALL-OUTPUT")

@pytest.mark.prebuilt("tools")
def test_prints_after_a_failed_build():
    pass  # its setup waits for the build and says it failed
"""


def child_pytest(
    tmp_path: Path, *args: str, capture: bool = False, **env_extra: str
) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probes.py").write_text(PROBES)
    env = {k: v for k, v in os.environ.items() if k not in ("OFFBEAT_TEST_CACHE",)}
    flags = ["-p", "no:cacheprovider", "-q"] + ([] if capture else ["-s"])
    return subprocess.run(
        [sys.executable, "-m", "pytest", *flags, *args],
        cwd=tmp_path, env={**env, **env_extra}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_a_timeout_prints_every_thread_and_task_and_fails_only_that_test(tmp_path):
    out = child_pytest(tmp_path, "-k", "hangs or goes_on")
    text = out.stdout + out.stderr
    assert "FAILED test_probes.py::test_hangs_in_a_task" in text, text[-3000:]
    assert "Timeout after 2 s" in text
    assert "--- thread probe-sleeper" in text and "--- thread MainThread" in text
    assert "--- asyncio task probe-stuck-task" in text
    assert "in stuck_forever" in text  # the task's own frame, not just its name
    assert "1 failed, 1 passed" in text


def test_a_marked_test_without_a_timeout_of_its_own_gets_the_marked_default(tmp_path):
    out = child_pytest(tmp_path, "-k", "marked_slow_timeout")
    assert "MARKED (900,)" in out.stdout, out.stdout[-2000:]  # conftest.MARKED_TIMEOUT_S


def test_the_fast_tier_deselects_marked_tests_and_refuses_ray(tmp_path):
    pytest.importorskip("ray")
    out = child_pytest(tmp_path, "--fast", "-k", "not hangs and not prints", "-rA")
    text = out.stdout + out.stderr
    assert "6 deselected" in text, text[-3000:]  # -k's four and the tier's two
    assert "test_marked_e2e" not in text  # never run, so never reported under -rA
    assert "starts Ray in the fast tier: mark it @pytest.mark.ray" in text
    assert "1 failed, 1 passed" in text


def test_a_passing_call_over_the_slow_limit_shows_its_output_in_the_summary(tmp_path):
    out = child_pytest(
        tmp_path, "-k", "prints_then_runs_long or prints_and_is_quick", capture=True,
        OFFBEAT_SLOW_CALL_S="1",
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert "2 passed" in text, text[-3000:]
    assert "slow call: test_probes.py::test_prints_then_runs_long took 2 s" in text, text[-3000:]
    assert "PROBE-LONG-CALL-OUTPUT" in text
    assert "PROBE-QUICK-CALL-OUTPUT" not in text  # under the limit: captured, not shown
    off = child_pytest(tmp_path, "-k", "prints_then_runs_long", capture=True,
                       OFFBEAT_SLOW_CALL_S="0")  # fmt: skip
    assert "slow call" not in off.stdout and "PROBE-LONG-CALL-OUTPUT" not in off.stdout


def test_a_background_build_that_failed_is_reported_with_its_log(tmp_path):
    """The test then builds the target itself, in its call: the setup says so, with the
    end of the build's log (before, a slow call showed nothing of it)."""
    cache = tmp_path / "cache"
    (cache / "prebuild").mkdir(parents=True)  # made already: this session starts no builds
    (cache / "prebuild" / "tools.pid").write_text("999999999\n")  # long gone
    (cache / "prebuild" / "tools.done").write_text("1\n")
    (cache / "prebuild" / "tools.log").write_text("Traceback ...\nPROBE-BUILD-BOOM\n")
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "prebuild.py", tmp_path / "tests" / "prebuild.py")
    out = child_pytest(
        tmp_path, "-k", "failed_build", "-rA", capture=True, OFFBEAT_TEST_CACHE=str(cache)
    )
    text = out.stdout + out.stderr
    assert "1 passed" in text, text[-3000:]
    assert "prebuild tools failed; this test builds it." in text
    assert "PROBE-BUILD-BOOM" in text


def test_the_cache_is_the_sessions_own_never_the_users(tmp_path):
    out = child_pytest(tmp_path, "-k", "goes_on")
    line = next(x for x in out.stdout.splitlines() if x.startswith("CACHE"))
    _, offbeat_cache, xdg = line.split()
    home_cache = Path.home() / ".cache"
    for path in (offbeat_cache, xdg):
        assert not Path(path).is_relative_to(home_cache), path
    assert not Path(offbeat_cache).exists()  # the child removed the cache it made
    # and this session's own cache is not the user's either
    assert not Path(os.environ["OFFBEAT_CACHE_DIR"]).is_relative_to(home_cache)


@pytest.fixture(scope="module")
def pinned_world():
    """What a module's job world does at set-up: pin this process, torch on one thread."""
    import torch

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    yield


def test_inside_a_world_that_pins_the_process(pinned_world):
    import torch

    assert len(os.sched_getaffinity(0)) == 1 and torch.get_num_threads() == 1


def test_after_it_the_next_test_gets_the_whole_machine_back():
    import torch

    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip("one core: pinning is not visible")
    assert len(os.sched_getaffinity(0)) == cores  # the session's, not the world's
    assert torch.get_num_threads() >= 2


def _root_conftest():
    import importlib.util

    spec = importlib.util.spec_from_file_location("offbeat_root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Item:
    def __init__(self, nodeid: str, *markers: str):
        self.nodeid, self.markers = nodeid, set(markers)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def test_units_first_then_e2e_then_what_waits_for_the_background_builds():
    c = _root_conftest()
    items = [
        _Item("tests/test_genrm_e2e.py::a", "e2e", "prebuilt"),
        _Item("tests/test_elastic_e2e.py::a", "e2e"),
        _Item("packages/core/tests/test_batch.py::a"),
        _Item("tests/test_elastic_e2e.py::b", "e2e"),
        _Item("packages/core/tests/test_batch.py::b"),
        _Item("tests/test_opd_e2e.py::a", "slow", "prebuilt"),
    ]
    c.session_order(items)
    assert [i.nodeid for i in items] == [
        "packages/core/tests/test_batch.py::a", "packages/core/tests/test_batch.py::b",
        "tests/test_elastic_e2e.py::a", "tests/test_elastic_e2e.py::b",
        "tests/test_genrm_e2e.py::a", "tests/test_opd_e2e.py::a",
    ]  # fmt: skip


def test_xdist_keeps_a_directory_sharing_a_session_engine_on_one_worker():
    scope = _root_conftest().xdist_scope
    assert scope("packages/rollout_vllm/tests/test_e2e_greedy.py::t") == (
        scope("packages/rollout_vllm/tests/test_e2e_group.py::t[x]")
    )
    assert (
        scope("packages/rollout_sglang/tests/test_unit.py::t") == "packages/rollout_sglang/tests/"
    )
    assert scope("tests/test_elastic_e2e.py::a") == scope("tests/test_elastic_e2e.py::b")
    assert scope("tests/test_elastic_e2e.py::a") != scope("tests/test_opd_e2e.py::a")


def test_a_background_build_is_waited_for_and_its_result_read(tmp_path, monkeypatch):
    c = _root_conftest()
    monkeypatch.setenv("OFFBEAT_TEST_CACHE", str(tmp_path))
    d = tmp_path / "prebuild"
    d.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    (d / "judge.pid").write_text(str(sleeper.pid))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (d / "tools.pid").write_text(str(dead.pid))  # ended without writing done: not waited for
    import threading

    (d / "judge.done").write_text("")  # created, not yet written: still building
    threading.Timer(1.0, lambda: (d / "judge.done").write_text("0\n")).start()
    got = c.wait_for_prebuild(["judge", "tools", "never-started"], timeout_s=30)
    sleeper.wait()
    assert got == {"judge": "0", "tools": None, "never-started": None}


def test_only_the_builds_the_selected_tests_wait_for_are_started(tmp_path, monkeypatch):
    c = _root_conftest()
    monkeypatch.setenv("OFFBEAT_TEST_CACHE", str(tmp_path))
    started: list[str] = []

    class Popen:
        pid = 4242

        def __init__(self, argv, **kwargs):
            started.append(argv[-1])

    monkeypatch.setattr(subprocess, "Popen", Popen)
    monkeypatch.setattr(c, "_PREBUILD", [])
    c._start_prebuild({"students", "judge"})
    assert started == ["judge", "students"]  # in TARGETS' order; no teacher, no tools
    assert sorted(p.name for p in (tmp_path / "prebuild").glob("*.pid")) == [
        "judge.pid",
        "students.pid",
    ]
    monkeypatch.setenv("OFFBEAT_TEST_CACHE", str(tmp_path / "another"))
    with pytest.raises(pytest.UsageError, match="no target \\['judg'\\]"):
        c._start_prebuild({"judg"})
