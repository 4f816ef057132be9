"""The vLLM compat layer: every name it relies on is in the installed vLLM, each supported
release gets its own API, and a missing or out-of-range vLLM fails with a message that
says what is installed, what is missing and what is supported. No engine starts."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from offbeat.rollout_vllm import compat
from offbeat.rollout_vllm.compat import SUPPORTED, VLLMVersionError, api_for, resolve


def test_every_name_of_the_installed_release_resolves():
    """Fails when an upstream name this package relies on moves in the installed vLLM
    (the import of `compat` fails the same way, naming it)."""
    import vllm

    api = api_for(vllm.__version__)
    assert api == compat.API
    missing = []
    for name in api.names:
        try:
            resolve(name)
        except VLLMVersionError as e:
            missing.append(str(e))
    assert missing == []


def test_the_package_imports_vllm_only_through_compat():
    from pathlib import Path

    src = Path(compat.__file__).parent
    offenders = [
        p.name
        for p in src.glob("*.py")
        if p.name != "compat.py"
        and any(
            line.lstrip().startswith(("import vllm", "from vllm"))
            for line in p.read_text().splitlines()
        )
    ]
    assert offenders == []


@pytest.mark.parametrize(
    ("version", "client_error", "release_kv", "preemptions"),
    [
        ("0.24.0", False, False, False),
        ("0.24.0+cu130", False, False, False),
        ("0.25.1", False, False, False),
        ("0.26.0", False, False, False),
        ("0.27.0", True, False, False),
        ("0.29.0", True, False, False),
        ("0.30.0", True, False, True),
        ("0.31.0", True, True, True),
        ("0.32.0", True, True, True),
        ("0.32.1.dev12+g1234abc", True, True, True),
        ("0.32.0rc1", True, True, True),  # a release candidate takes its release's API
    ],
)
def test_each_release_gets_its_api(version, client_error, release_kv, preemptions):
    api = api_for(version)
    assert api.version == version
    assert (api.request_error == "vllm.exceptions:VLLMClientError") is client_error
    assert api.release_kv is release_kv
    assert api.counts_preemptions is preemptions
    assert ("vllm.v1.engine.async_llm:AsyncLLM.release_kv_cache_memory" in api.names) is (
        release_kv
    )
    assert api.request_error in api.names


@pytest.mark.parametrize("version", ["0.23.1", "0.10.0", "0.23.0rc1"])
def test_an_older_release_is_refused_naming_the_range(version):
    with pytest.raises(VLLMVersionError, match=rf"vLLM {version} is installed.*{SUPPORTED}"):
        api_for(version)


def test_a_newer_release_warns_and_takes_the_newest_api():
    with pytest.warns(RuntimeWarning, match=r"vLLM 0\.33\.0 is installed"):
        api = api_for("0.33.0")
    newest = api_for("0.32.0")
    assert api.names == newest.names and api.release_kv and api.counts_preemptions


def test_an_unreadable_version_is_refused():
    with pytest.raises(VLLMVersionError, match=r"'not-a-version'.*>=0\.24,<0\.33"):
        api_for("not-a-version")


def test_a_missing_name_says_version_name_and_range():
    with pytest.raises(VLLMVersionError) as e:
        resolve("vllm.exceptions:NoSuchError", version="0.24.0")
    msg = str(e.value)
    assert "vLLM 0.24.0 is installed" in msg
    assert "`vllm.exceptions.NoSuchError`" in msg
    assert SUPPORTED in msg
    with pytest.raises(VLLMVersionError, match=r"`vllm\.no_such_module\.X`.*no module"):
        resolve("vllm.no_such_module:X")
    with pytest.raises(VLLMVersionError, match=r"AsyncLLM\.no_such_method"):
        resolve("vllm.v1.engine.async_llm:AsyncLLM.no_such_method")


def test_request_errors_catch_what_the_release_raises():
    from vllm.exceptions import VLLMValidationError

    # Before 0.27 VLLMValidationError is a ValueError; from 0.27 a VLLMClientError.
    assert issubclass(VLLMValidationError, compat.REQUEST_ERRORS)
    assert ValueError in compat.REQUEST_ERRORS


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_vllm_the_import_says_what_to_install():
    r = _run(
        """
        import sys
        sys.modules["vllm"] = None  # what an environment without vLLM looks like
        try:
            import offbeat.rollout_vllm.compat
        except ImportError as e:
            print(e)
        """
    )
    assert "offbeat.rollout_vllm needs vLLM: install offbeat-rollout-vllm[cpu]" in r.stdout, (
        r.stdout + r.stderr
    )


def test_a_release_missing_a_name_fails_naming_it(monkeypatch):
    """The installed vLLM as if the request error class of its release had moved: the
    check that runs at import names the version, the missing name and the range, and does
    not claim vLLM is absent."""
    import importlib

    module, name = compat.API.request_error.split(":")
    monkeypatch.delattr(importlib.import_module(module), name)
    with pytest.raises(VLLMVersionError) as e:
        compat.check_names(compat.API)
    msg = str(e.value)
    assert f"vLLM {compat.VLLM_VERSION} is installed" in msg
    assert f"`{module}.{name}`" in msg
    assert ">=0.24,<0.33" in msg
    assert "needs vLLM" not in msg


class _Platform:
    def __init__(self, cpu: bool):
        self.cpu = cpu

    def is_cpu(self) -> bool:
        return self.cpu


@pytest.mark.parametrize(
    ("cpu", "env", "kwargs", "folded"),
    [
        (True, None, {}, True),
        (True, None, {"distributed_executor_backend": "uni", "tensor_parallel_size": 1}, True),
        (True, None, {"tensor_parallel_size": 2}, False),
        (True, None, {"data_parallel_size": 2}, False),
        (True, None, {"distributed_executor_backend": "mp"}, False),
        (True, "1", {}, False),  # the user's choice stands
        (False, None, {}, False),  # GPUs: vLLM's own default
    ],
)
def test_a_one_worker_cpu_engine_runs_its_worker_in_the_engine_core(
    monkeypatch, cpu, env, kwargs, folded
):
    monkeypatch.setattr(compat, "_current_platform", _Platform(cpu))
    if env is None:
        monkeypatch.delenv(compat.ONE_PROCESS_ENV, raising=False)
    else:
        monkeypatch.setenv(compat.ONE_PROCESS_ENV, env)
    import os

    assert compat.one_process_engine(dict(kwargs)) is folded
    assert os.environ.get(compat.ONE_PROCESS_ENV) == ("0" if folded else env)


def test_shutdown_engine_waits_for_the_engine_core_where_the_release_can():
    """vLLM's own wait for its engine core after SIGTERM is 5 s, shorter than the
    core's teardown on a loaded machine (it then force-kills it): the replica passes its
    own wait where `AsyncLLM.shutdown` takes one."""
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM

    assert "timeout" in inspect.signature(AsyncLLM.shutdown).parameters  # 0.32 takes one

    calls = []

    class Takes:
        def shutdown(self, timeout=None):
            calls.append(timeout)

    class Older:
        def shutdown(self):
            calls.append("no timeout")

    compat.shutdown_engine(Takes(), 20.0)
    compat.shutdown_engine(Older(), 20.0)
    assert calls == [20.0, "no timeout"]
