"""The SGLang server process: started, waited on until healthy, its log kept, stopped.

`python -m sglang.launch_server --model-path M --host H --port P [server_args...]` runs as a
child of the caller (the replica's Ray actor), stdout and stderr into one log file whose
tail goes into every error. Knows nothing about what the server is asked afterwards.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

__all__ = ["SGLangProcess", "free_port", "server_args_to_cli"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_args_to_cli(server_args: Mapping[str, object]) -> list[str]:
    """{"mem_fraction_static": 0.7, "enable_memory_saver": True} ->
    ["--mem-fraction-static", "0.7", "--enable-memory-saver"] (SGLang's ServerArgs flags;
    False and None leave a flag out, lists repeat their values after one flag)."""
    out: list[str] = []
    for key, value in server_args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


class SGLangProcess:
    """One server process. `command` replaces `[python, -m, sglang.launch_server]` (the
    tests start SGLang's HTTP layer with a test engine this way; a GPU machine may point it
    at another environment's python)."""

    def __init__(
        self,
        model: str,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        server_args: Mapping[str, object] | None = None,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        base = list(command) if command else [sys.executable, "-m", "sglang.launch_server"]
        self.argv = [
            *base,
            "--model-path",
            model,
            "--host",
            host,
            "--port",
            str(self.port),
            *server_args_to_cli(server_args or {}),
        ]
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"sglang-{self.port}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # stop() signals the whole group (SGLang's schedulers too)
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, timeout_s: float = 600.0, poll_s: float = 0.5) -> None:
        """Block until GET /health answers 200 (SGLang answers 503 while it loads the model
        and warms up). Raises RuntimeError with the log's tail if the process exits first
        or `timeout_s` passes. Called from the actor's constructor, before any event loop
        work: it does not run inside one."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                code = self.proc.poll()
                if code is not None:
                    raise RuntimeError(
                        f"SGLang server exited with code {code} before it was healthy "
                        f"({' '.join(self.argv)}); log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    r = client.get(f"{self.url}/health")
                    if r.status_code == 200:
                        return
                    last = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    last = f"{type(e).__name__}"
                time.sleep(poll_s)
        self.stop()
        raise RuntimeError(
            f"SGLang server at {self.url} not healthy after {timeout_s}s (last /health: "
            f"{last}); log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
