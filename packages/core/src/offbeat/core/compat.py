"""Every use of Ray's and torch's internals in offbeat.core, in one place.

Each function names the private upstream names it relies on; `tests/test_compat.py` (and
`tests/test_ray_init.py` for Ray's) fails when an upgrade moves one. The rest of core asks
here and imports no private name itself. Knows nothing of jobs or engines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = [
    "RAY_NAMES",
    "TORCH_NAMES",
    "local_ray_on",
    "parameters_on_meta",
    "raise_recompile_limit",
    "ray_session_logs_dir",
    "ray_skip_uv_run",
]

# The private names used below, as "module:attribute[.attribute]" (the test resolves each).
RAY_NAMES = [
    "ray._private.services:resolve_ip_for_localhost",
    "ray._private.services:is_localhost",
    "ray._private.ray_constants:RAY_ENABLE_UV_RUN_RUNTIME_ENV",
    "ray._private.ray_constants:WORKER_PROCESS_SETUP_HOOK_ENV_VAR",
    "ray._private.worker:_global_node",
]
TORCH_NAMES = [
    "torch.nn:Module.register_parameter",
    "torch.nn:Module._parameters",  # an instance attribute of every module
    "torch._dynamo:config",
]


# ---- Ray ---------------------------------------------------------------------------------
def ray_skip_uv_run() -> None:
    """Ray read `RAY_ENABLE_UV_RUN_RUNTIME_ENV` when it was imported, maybe before the job
    set it to 0: turn it off in `ray._private.ray_constants` too."""
    from ray._private import ray_constants

    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False


@contextlib.contextmanager
def local_ray_on(node_ip: str) -> Iterator[None]:
    """Within: a local `ray.init` keeps a loopback `node_ip` (Ray swaps it for the
    machine's reachable address through `ray._private.services.resolve_ip_for_localhost`,
    and its servers bind to the node IP). Raises RuntimeError naming the missing name on a
    Ray without it."""
    import ray
    from ray._private import services

    missing = [f for f in ("resolve_ip_for_localhost", "is_localhost") if not hasattr(services, f)]
    if missing:
        raise RuntimeError(
            f"ray {ray.__version__} has no ray._private.services.{missing[0]}, which offbeat "
            "patches to keep a local Ray on loopback; use the Ray version in uv.lock, or set "
            "runtime.ray_address to a cluster you started yourself"
        )
    original = services.resolve_ip_for_localhost
    if services.is_localhost(node_ip):
        services.resolve_ip_for_localhost = lambda host: host
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = original


def ray_session_logs_dir() -> str | None:
    """The log directory of the Ray session this process started or joined (None: none
    known), from `ray._private.worker._global_node`."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    return node.get_logs_dir_path() if node is not None else None


# ---- torch -------------------------------------------------------------------------------
@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (one real tensor at a
    time, while it is created) and keep real buffers (e.g. rotary frequencies, which no
    checkpoint holds). Parameters assigned twice (tied embeddings) stay one object.
    Process-wide while inside: swaps `nn.Module.register_parameter` and writes the module's
    `_parameters`."""
    from torch import nn

    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: Any) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def raise_recompile_limit(at_least: int) -> None:
    """Let torch.compile recompile a function at least `at_least` times before it falls
    back to eager (`torch._dynamo.config.recompile_limit`; `cache_size_limit`, its older name, on
    the older releases core's `torch>=2.6` admits)."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), at_least))
