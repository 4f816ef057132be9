"""One SGLang HTTP app per test session, shared by every contract test of this package.

The app is SGLang's own (`sglang.srt.entrypoints.http_server`) with the test engine of
`sglang_test_engine.py` behind it; `SGLangRolloutServer` launches it through its real
launcher (`--model-path/--host/--port` command line, health wait, log capture). Importing
SGLang takes 30-40 s, hence one start. Each test gets its own adapter attached to that app
and a reset engine.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from offbeat.rollout_sglang import SGLangRolloutServer, SGLangServerConfig

TEST_SERVER = Path(__file__).with_name("sglang_test_server.py")
MODEL = "offbeat/test-model"


@pytest.fixture(scope="session")
def sglang_app(tmp_path_factory):
    """The launched app (an `SGLangRolloutServer` that owns the process)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (dependency group sglang-contract)")
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    launcher = SGLangRolloutServer(
        SGLangServerConfig(
            model=MODEL,
            command=[sys.executable, str(TEST_SERVER)],
            server_args={"mem_fraction_static": 0.5},
            log_path=str(log),
            startup_timeout_s=600,
        )
    )
    yield launcher
    launcher.shutdown()


class Control:
    """The test-only routes of the app: reset, script failures, read the call log."""

    def __init__(self, url: str) -> None:
        self.http = httpx.AsyncClient(base_url=url, timeout=30)

    async def reset(self) -> None:
        (await self.http.post("/_test/reset")).raise_for_status()

    async def script(self, **body: Any) -> None:
        (await self.http.post("/_test/script", json=body)).raise_for_status()

    async def calls(self, *names: str) -> list[dict[str, Any]]:
        calls = (await self.http.get("/_test/calls")).json()
        return [c for c in calls if not names or c["call"] in names]

    async def state(self) -> dict[str, Any]:
        return (await self.http.get("/_test/state")).json()


@pytest_asyncio.fixture
async def control(sglang_app):
    ctl = Control(sglang_app.url)
    await ctl.reset()
    yield ctl
    await ctl.reset()
    await ctl.http.aclose()


@pytest_asyncio.fixture
async def server(sglang_app, control):
    """A fresh adapter on the shared app (no process of its own)."""
    srv = SGLangRolloutServer(
        SGLangServerConfig(
            model=MODEL, url=sglang_app.url, server_id="sglang-test", abort_grace_s=1.0
        )
    )
    yield srv
    await srv.aclose()
