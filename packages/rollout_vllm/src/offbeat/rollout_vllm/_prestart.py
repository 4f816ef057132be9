"""A replica's engine-core process, forked from a process that imported vLLM beforehand.

vLLM starts its engine core (AsyncLLM's background process) with the `spawn` method when
it runs inside a Ray actor: a fresh interpreter that imports torch and vLLM again, after
the actor has imported them once, one after the other. On a CPU replica that import is
about half of the engine's start (here: 36 s ready with spawn, 18 s with this; the
actor's import and the second one were sequential).

`prestart()`, called when the package is imported and before it imports vLLM, starts a
`multiprocessing` forkserver whose preload imports vLLM's engine-core modules while the
actor imports vLLM itself, on another core. The engine core is then forked from that
server: a clean single-threaded process (never the actor's, whose Ray and gRPC threads
make `fork` unsafe, which is why vLLM refuses fork in a Ray actor). Each child takes the
starting process's environment, working directory and core mask as they are at `start()`
(a forkserver child would otherwise inherit the server's, from before the actor confined
itself), and dies with the server, which exits when the actor does
(`offbeat.core.forkserver`).

Only when the job asked for it (`OFFBEAT_VLLM_PRESTART=1` in the replica's environment:
a CPU replica started by `replica.py`); stdlib only, so it can run before vLLM's import.
`OFFBEAT_VLLM_PRESTART=0` on a job's `runtime.rollout_env` turns it off.
"""

from __future__ import annotations

import os
from multiprocessing import forkserver

from offbeat.core.forkserver import ForkServerContext, server_pids

__all__ = ["ENV", "PRELOAD", "ForkServerContext", "prestart", "server_pids", "started"]

ENV = "OFFBEAT_VLLM_PRESTART"
# What the engine-core process imports on top of what the actor does. A name that is not
# importable here (another vLLM release) is skipped by the forkserver.
PRELOAD = (
    "torch",
    "vllm",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.models.qwen2",
    "offbeat.core.forkserver",
)
_started = False


def prestart() -> bool:
    """Start the preloading forkserver when this process's environment asks for it (once;
    the variable is removed so the engine's own processes do not start another). Returns
    whether it started one."""
    global _started
    if os.environ.pop(ENV, None) != "1" or _started:
        return False
    _started = True
    forkserver.set_forkserver_preload(list(PRELOAD))
    forkserver.ensure_running()
    return True


def started() -> bool:
    """Whether `prestart` started the forkserver in this process."""
    return _started
