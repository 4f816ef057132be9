"""One SGLang server as an offbeat `RolloutServer` and ckpt-engine `SyncTarget`.

A plain class over SGLang's native HTTP API (the Ray actor is a thin shell, `replica.py`):
`/generate` with `input_ids` and `return_logprob`, `/pause_generation` and
`/continue_generation`, `/abort_request`, `/release_memory_occupation` and
`/resume_memory_occupation`, `/flush_cache`, and the weight-update endpoints `_weights.py`
picks. Token ids in, token ids + per-token log-probs out; nothing is detokenised. It
starts the server process itself (`_process.py`) unless given the URL of a running one.

Pausing, as in the vLLM adapter: `abort_all()` closes a gate (new `generate` calls wait),
pauses SGLang in "abort" mode (everything it holds returns with what it produced) and
returns once every in-flight call has returned `"aborted"`. `resume()` reopens both.
A failed weight update leaves the server refusing to generate until an update succeeds.
Knows nothing about the balancer, the client's resume logic, or how the trainer sends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from offbeat.ckpt_engine.target import ReceiveSpec
from offbeat.core.rollout.protocol import TokenOutput
from offbeat.rollout_sglang._http import SGLangHTTP, SGLangHTTPError, SGLangRequestRejected
from offbeat.rollout_sglang._process import SGLangProcess
from offbeat.rollout_sglang._sampling import to_sglang_sampling
from offbeat.rollout_sglang._weights import group_key, update_plan

__all__ = ["SGLangRolloutServer", "SGLangServerConfig"]

logger = logging.getLogger(__name__)

_FINISH_TO_STOP = {"stop": "stop", "length": "length", "abort": "aborted"}


@dataclass
class SGLangServerConfig:
    """What one replica needs. `server_args` become `sglang.launch_server` flags unchanged
    (`{"tp_size": 2, "mem_fraction_static": 0.7}` -> `--tp-size 2 --mem-fraction-static
    0.7`); the adapter adds `--enable-memory-saver` (needed for release/resume of memory)
    unless given. `url`: attach to a server that is already running instead of launching
    one. `command`: what replaces `python -m sglang.launch_server` (another environment's
    python, or a test server). `weight_update_session`: wrap tensor and NCCL updates in
    `/begin_weight_update` ... `/end_weight_update` (SGLang >= 0.5.21 requires it; set False
    for 0.5.18-0.5.20, which lack those endpoints)."""

    model: str
    server_args: dict[str, Any] = field(default_factory=dict)
    server_id: str = "sglang-0"
    weight_version: int = 0
    url: str | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    command: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    log_path: str | None = None
    startup_timeout_s: float = 900.0
    # Every control call; a generate call is bounded by generate_timeout_s (None: no bound).
    request_timeout_s: float = 120.0
    generate_timeout_s: float | None = None
    # How long abort_all() waits for aborted calls to return before it raises.
    abort_timeout_s: float = 60.0
    # After SGLang's pause returned, calls still in flight this long were held at SGLang's
    # pause gate before they reached the scheduler (they hold no tokens): they are dropped
    # client-side and return "aborted" with nothing.
    abort_grace_s: float = 2.0
    weight_update_session: bool = True


class SGLangRolloutServer:
    """An SGLang server: `generate`, pause/resume, memory control, weight sync."""

    def __init__(self, config: SGLangServerConfig | None = None, /, **kwargs: Any) -> None:
        if config is None:
            config = SGLangServerConfig(**kwargs)
        elif kwargs:
            raise TypeError("SGLangRolloutServer: pass an SGLangServerConfig or keywords, not both")
        self.config = config
        self.process: SGLangProcess | None = None
        if config.url is None:
            args = {"enable_memory_saver": True, **config.server_args}
            self.process = SGLangProcess(
                config.model,
                host=config.host,
                port=config.port,
                server_args=args,
                command=config.command,
                env=config.env,
                log_path=config.log_path,
            )
            self.process.wait_healthy(config.startup_timeout_s)
            url = self.process.url
        else:
            url = config.url
        self.http = SGLangHTTP(
            url,
            timeout_s=config.request_timeout_s,
            generate_timeout_s=config.generate_timeout_s,
        )
        self._weight_version = config.weight_version
        self._ids = itertools.count()
        self._running = asyncio.Event()
        self._running.set()
        self._abort_epoch = 0
        # internal request id -> (task of its HTTP call, abort epoch it started in)
        self._inflight: dict[str, tuple[asyncio.Task, int]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._broken: str | None = None  # a weight update failed part-way
        self._failure: str | None = None  # the server answered badly (5xx, malformed, timeout)
        self._joined_groups: set[tuple[Any, ...]] = set()
        self.last_abort: dict[str, Any] | None = None

    # ---- identity and state ---------------------------------------------------------
    @property
    def server_id(self) -> str:
        return self.config.server_id

    @property
    def url(self) -> str:
        return self.http.base_url

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def get_weight_version(self) -> int:
        return self._weight_version

    @property
    def is_paused(self) -> bool:
        return not self._running.is_set()

    def status(self) -> dict[str, Any]:
        return {
            "server_id": self.server_id,
            "url": self.url,
            "weight_version": self._weight_version,
            "paused": self.is_paused,
            "inflight": len(self._inflight),
            "broken": self._broken,
            "failure": self._failure,
            "last_abort": self.last_abort,
            "log": None if self.process is None else str(self.process.log_path),
        }

    async def refresh(self) -> int:
        """Health probe (what `ReplicaPool.check_health` calls): raises if the server
        answered a call badly since it was last healthy, or if `/health` is not 200.
        Returns the weight version."""
        if self._failure is not None:
            raise SGLangHTTPError("(earlier call)", None, f"replica unhealthy: {self._failure}")
        try:
            await self.http.get_ok("/health")
        except SGLangHTTPError as e:
            self._failure = str(e)
            raise
        return self._weight_version

    async def _control(self, endpoint: str, payload: dict[str, Any] | None = None) -> Any:
        """A control call: any failure marks the replica unhealthy and raises."""
        try:
            return await self.http.call(endpoint, payload if payload is not None else {})
        except SGLangHTTPError as e:
            self._failure = str(e)
            raise

    # ---- generation -----------------------------------------------------------------
    @staticmethod
    def _check_prompt(prompt_ids: Sequence[int]) -> list[int]:
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
            raise ValueError(
                f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}"
            )
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: at least one token id is needed")
        ids = []
        for t in prompt_ids:
            if isinstance(t, bool) or not hasattr(t, "__index__") or t.__index__() < 0:
                raise ValueError(f"prompt_ids contains {t!r}: token ids are ints >= 0")
            ids.append(t.__index__())
        return ids

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: Mapping[str, Any]
    ) -> TokenOutput:
        """Generate one sequence. Waits while the server is paused; returns
        `stop_reason="aborted"` with the tokens produced so far if `abort_all()` interrupts
        it. Bad input raises ValueError (before the server sees it, or SGLang's own 4xx)."""
        ids = self._check_prompt(prompt_ids)
        sampling = to_sglang_sampling(sampling_params)
        while not self._running.is_set():
            await self._running.wait()
        if self._broken is not None:
            raise RuntimeError(f"server {self.server_id} is not serving: {self._broken}")
        epoch = self._abort_epoch
        version = self._weight_version
        rid = f"{request_id}#{next(self._ids)}"
        payload = {
            "rid": rid,
            "input_ids": ids,
            "sampling_params": sampling,
            "return_logprob": True,
            "stream": False,
        }
        task = asyncio.ensure_future(
            self.http.call(
                "/generate",
                payload,
                timeout_s=self.config.generate_timeout_s,
                rejected_is_request_error=True,
            )
        )
        self._inflight[rid] = (task, epoch)
        self._idle.clear()
        try:
            body = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                # The caller was cancelled: drop the request on the server too.
                task.cancel()
                await self._abort_quietly(rid)
                raise
            # abort_all() dropped it: it was held at SGLang's pause gate, no tokens yet.
            return self._output([], [], "aborted", version)
        except SGLangRequestRejected:
            raise  # the request's fault (SGLang's 4xx): the replica stays healthy
        except SGLangHTTPError as e:
            self._failure = str(e)  # a 5xx, a malformed body, no answer
            raise
        finally:
            self._inflight.pop(rid, None)
            if not self._inflight:
                self._idle.set()
        return self._parse(rid, body, version, aborted_by_us=epoch != self._abort_epoch)

    def _parse(self, rid: str, body: Any, version: int, aborted_by_us: bool) -> TokenOutput:
        def bad(why: str) -> SGLangHTTPError:
            self._failure = f"/generate answered {why} for request {rid}"
            return SGLangHTTPError("/generate", 200, f"malformed body: {why}")

        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
            raise bad(f"no meta_info in {str(body)[:200]!r}")
        meta = body["meta_info"]
        token_ids = body.get("output_ids")
        pairs = meta.get("output_token_logprobs")
        if not isinstance(token_ids, list) or not isinstance(pairs, list):
            raise bad("output_ids or meta_info.output_token_logprobs missing")
        if len(pairs) != len(token_ids) or any(
            int(p[1]) != t for p, t in zip(pairs, token_ids, strict=True)
        ):
            raise bad(f"{len(token_ids)} output_ids but {len(pairs)} log-probs, or ids differ")
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        stop = _FINISH_TO_STOP.get(kind)
        if stop is None:
            raise bad(f"finish_reason {finish!r}")
        if stop == "aborted" and not aborted_by_us:
            message = finish.get("message") if isinstance(finish, dict) else None
            raise SGLangHTTPError(
                "/generate", 200, f"request {rid} aborted by the server: {message or finish}"
            )
        return self._output(
            [int(t) for t in token_ids], [float(p[0]) for p in pairs], stop, version
        )

    def _output(self, token_ids: list[int], logprobs: list[float], stop: str, version: int):
        return TokenOutput(
            token_ids=token_ids,
            logprobs=logprobs,
            stop_reason=stop,
            weight_version=self._weight_version,
            min_weight_version=version,
            max_weight_version=self._weight_version,
            extra={"server_id": self.server_id},
        )

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self.http.call("/abort_request", {"rid": rid}, expect_json=False)
        except SGLangHTTPError as e:
            logger.warning("server %s: abort of %s failed: %s", self.server_id, rid, e)

    # ---- pause / resume -------------------------------------------------------------
    async def abort_all(self) -> None:
        """Stop accepting, abort everything in flight (SGLang's pause in "abort" mode),
        wait until every interrupted `generate` has returned. Stays paused until
        `resume()`."""
        inflight = len(self._inflight)
        self._running.clear()
        self._abort_epoch += 1
        await self._control("/pause_generation", {"mode": "abort"})
        try:
            await asyncio.wait_for(self._idle.wait(), self.config.abort_grace_s)
        except TimeoutError:
            held = [rid for rid, (_, ep) in self._inflight.items() if ep < self._abort_epoch]
            for rid in held:
                self._inflight[rid][0].cancel()
                await self._abort_quietly(rid)
        try:
            await asyncio.wait_for(self._idle.wait(), self.config.abort_timeout_s)
        except TimeoutError as e:
            raise TimeoutError(
                f"server {self.server_id}: {len(self._inflight)} request(s) still running "
                f"{self.config.abort_timeout_s}s after abort_all()"
            ) from e
        self.last_abort = {"inflight": inflight}

    async def resume(self) -> None:
        """Accept and schedule requests again."""
        await self._control("/continue_generation", {})
        self._running.set()

    # ---- memory ---------------------------------------------------------------------
    async def flush_cache(self) -> None:
        await self.http.call("/flush_cache", method="POST", expect_json=False)

    async def release_kv_cache(self) -> bool:
        await self._control("/release_memory_occupation", {"tags": ["kv_cache"]})
        return True

    async def resume_kv_cache(self) -> bool:
        await self._control("/resume_memory_occupation", {"tags": ["kv_cache"]})
        return True

    async def sleep(self, level: int = 1) -> None:
        """Pause like `abort_all()`, then free the KV cache and the weights (SGLang keeps
        no host copy it could restore at level 2: either level releases both)."""
        await self.abort_all()
        await self._control("/release_memory_occupation", {"tags": ["kv_cache", "weights"]})

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep()` freed (`tags`: "weights", "kv_cache"; None = both). It
        does not reopen the gate: call `resume()`."""
        await self._control(
            "/resume_memory_occupation", {"tags": list(tags or ["weights", "kv_cache"])}
        )

    # ---- weight sync (offbeat.ckpt_engine.SyncTarget) ----------------------------------
    async def update_weights(self, spec: ReceiveSpec) -> int:
        """Load `spec.version` through SGLang's update endpoints (`_weights.py`); advance
        `weight_version` only when every call succeeded. Needs the server paused."""
        if spec.version < self._weight_version:
            raise ValueError(
                f"server {self.server_id} holds weight version {self._weight_version}; "
                f"refusing older version {spec.version}"
            )
        if self._running.is_set():
            raise RuntimeError(
                f"server {self.server_id}: update_weights needs the server paused; "
                "call abort_all() first"
            )
        plan = update_plan(
            spec, session=self.config.weight_update_session, joined_groups=self._joined_groups
        )
        try:
            for endpoint, payload in plan:
                body = await self._control(endpoint, payload)
                if isinstance(body, dict) and body.get("success") is False:
                    raise SGLangHTTPError(endpoint, 200, str(body.get("message")))
                if endpoint == "/init_weights_update_group":
                    self._joined_groups.add(group_key(spec))
        except BaseException as e:
            # Cancelled included: part of the weights may be loaded already.
            self._broken = f"weight update to version {spec.version} failed: {e}"
            raise
        self._broken = None
        self._weight_version = spec.version
        return self._weight_version

    # ---- lifecycle ------------------------------------------------------------------
    async def aclose(self) -> None:
        await self.http.aclose()

    def shutdown(self) -> None:
        """Stop the server process (if this object started it)."""
        if self.process is not None:
            self.process.stop()
