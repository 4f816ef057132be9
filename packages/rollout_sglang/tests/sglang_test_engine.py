"""A test engine that stands where SGLang's `TokenizerManager` stands, behind SGLang's real
FastAPI app (`sglang.srt.entrypoints.http_server`).

SGLang's route handlers parse every request into SGLang's own request types and shape
every response; this engine only answers the calls those handlers make, the way the
tokenizer manager does: `generate_request` yields SGLang's output dict (`output_ids`,
`meta_info.output_token_logprobs` as (logprob, token id, text) triples, `finish_reason`
dicts), `pause_generation(mode="abort")` ends running requests with what they produced and
holds new ones until `continue_generation`, weight updates answer (success, message).
Tokens are a deterministic function of the prompt, the position and the weight version.
It records every call in order and can be told to fail (`script`). Knows nothing of offbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace
from typing import Any

VOCAB = 1000


class InjectedError(ValueError):
    """Raised inside an engine call. SGLang's handlers turn a ValueError into their error
    response with `status_code` as its status (`/generate`); others answer 500."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


def token_at(prompt: list[int], i: int, version: int) -> int:
    return (sum(prompt) + 31 * i + 7 * version) % VOCAB


def logprob_at(i: int, version: int) -> float:
    return -0.01 * (i + 1) - 0.001 * version


class TestEngine:
    """The TokenizerManager surface SGLang's HTTP handlers use."""

    is_generation = True

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        # A request still hanging from the previous test ends now, without a trace.
        old = getattr(self, "hang_release", None)
        if old is not None:
            old.set()
        self.hang_release = asyncio.Event()
        self.server_status = ServerStatus.Up
        self.gracefully_exit = False
        self.last_receive_tstamp = 0.0
        self.rid_to_state: dict[str, Any] = {}
        self.calls: list[dict[str, Any]] = []
        self.failures: dict[str, dict[str, Any]] = {}
        self.token_delay_s = 0.0
        self.hang_s = 0.0
        self.version = 0
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.abort_events: dict[str, asyncio.Event] = {}
        self.released: set[str] = set()
        self.groups: list[str] = []
        self.in_session = False

    # ---- test control ---------------------------------------------------------------
    def record(self, name: str, **payload: Any) -> None:
        self.calls.append({"call": name, **payload})

    def maybe_fail(self, name: str) -> tuple[bool, str] | None:
        """(False, message) for a 4xx-style refusal, or raises for a 5xx."""
        f = self.failures.get(name)
        if not f or f.get("times", 1) <= 0:
            return None
        f["times"] = f.get("times", 1) - 1
        if f.get("status", 400) >= 500 or f.get("raise"):
            raise InjectedError(f.get("message", f"injected failure in {name}"), f["status"])
        return False, f.get("message", f"injected failure in {name}")

    # ---- generation -----------------------------------------------------------------
    async def generate_request(self, obj: Any, request: Any = None):
        from sglang.srt.sampling.sampling_params import SamplingParams

        obj.normalize_batch_and_arguments()  # SGLang's own argument handling
        rid = obj.rid
        self.record(
            "generate", rid=rid, input_ids=list(obj.input_ids), sampling=obj.sampling_params
        )
        failed = self.maybe_fail("generate")
        if failed:
            raise InjectedError(failed[1], 400)
        sp = SamplingParams(**(obj.sampling_params or {}))
        sp.normalize(None)
        sp.verify(VOCAB)  # SGLang's own validation: a bad value is a ValueError -> 400
        if self.hang_s:
            release = self.hang_release
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(release.wait(), self.hang_s)
            if release.is_set():  # reset() since: this request belongs to an earlier test
                raise InjectedError("engine reset while the request hung", 503)
        async with self.is_pause_cond:
            await self.is_pause_cond.wait_for(lambda: not self.is_pause)
        aborted = self.abort_events.setdefault(rid, asyncio.Event())
        prompt = list(obj.input_ids)
        out: list[int] = []
        lps: list[float] = []
        finish: dict[str, Any] = {"type": "length", "length": sp.max_new_tokens}
        stops = set(sp.stop_token_ids or [])
        try:
            for i in range(sp.max_new_tokens):
                if aborted.is_set():
                    finish = {"type": "abort", "message": "Abort in waiting queue"}
                    break
                if self.token_delay_s:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(aborted.wait(), self.token_delay_s)
                    if aborted.is_set():
                        finish = {"type": "abort", "message": "Abort in waiting queue"}
                        break
                t = token_at(prompt, i, self.version)
                out.append(t)
                lps.append(logprob_at(i, self.version))
                self.last_receive_tstamp = time.time()
                if t in stops:
                    finish = {"type": "stop", "matched": t}
                    break
        finally:
            self.abort_events.pop(rid, None)
        yield {
            "text": "",
            "output_ids": out,
            "meta_info": {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(out),
                "cached_tokens": 0,
                "weight_version": str(self.version),
                "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, out, strict=True)],
                "e2e_latency": 0.0,
            },
        }

    def create_abort_task(self, obj: Any):
        return None

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.record("abort_request", rid=rid, abort_all=abort_all)
        for key, ev in list(self.abort_events.items()):
            if abort_all or key == rid:
                ev.set()

    async def pause_generation(self, obj: Any) -> None:
        self.record("pause_generation", mode=obj.mode)
        async with self.is_pause_cond:
            self.is_pause = True
            if obj.mode == "abort":
                self.abort_request(abort_all=True)

    async def continue_generation(self, obj: Any) -> None:
        self.record("continue_generation")
        async with self.is_pause_cond:
            self.is_pause = False
            self.is_pause_cond.notify_all()

    async def flush_cache(self, timeout_s: float = 0.0):
        self.record("flush_cache")
        failed = self.maybe_fail("flush_cache")
        return SimpleNamespace(success=failed is None, message=failed and failed[1])

    # ---- memory ---------------------------------------------------------------------
    async def release_memory_occupation(self, obj: Any, request: Any = None) -> None:
        self.record("release_memory_occupation", tags=obj.tags)
        if self.maybe_fail("release_memory_occupation"):
            raise InjectedError("injected failure in release_memory_occupation", 400)
        self.released |= set(obj.tags or ["kv_cache", "weights"])

    async def resume_memory_occupation(self, obj: Any, request: Any = None) -> None:
        self.record("resume_memory_occupation", tags=obj.tags)
        self.released -= set(obj.tags or ["kv_cache", "weights"])

    # ---- weights --------------------------------------------------------------------
    def _load(self, name: str, weight_version: str | None, **payload: Any):
        self.record(name, weight_version=weight_version, **payload)
        failed = self.maybe_fail(name)
        if failed:
            return failed
        if weight_version is not None:
            self.version = int(weight_version)
        return True, f"{name}: loaded version {weight_version}"

    async def begin_weight_update(self, obj: Any, request: Any = None):
        self.record("begin_weight_update")
        self.in_session = True
        return self.maybe_fail("begin_weight_update") or (True, "session open")

    async def end_weight_update(self, obj: Any, request: Any = None):
        self.record("end_weight_update")
        self.in_session = False
        return self.maybe_fail("end_weight_update") or (True, "session closed")

    async def init_weights_update_group(self, obj: Any, request: Any = None):
        self.record(
            "init_weights_update_group",
            master_address=obj.master_address,
            master_port=obj.master_port,
            rank_offset=obj.rank_offset,
            world_size=obj.world_size,
            group_name=obj.group_name,
        )
        self.groups.append(obj.group_name)
        return self.maybe_fail("init_weights_update_group") or (True, "group ready")

    def _session_needed(self, name: str):
        if not self.in_session:
            return False, f"{name} outside /begin_weight_update ... /end_weight_update"
        return None

    async def update_weights_from_distributed(self, obj: Any, request: Any = None):
        refused = self._session_needed("update_weights_from_distributed")
        if refused:
            self.record("update_weights_from_distributed", weight_version=obj.weight_version)
            return refused
        return self._load(
            "update_weights_from_distributed",
            obj.weight_version,
            names=list(obj.names),
            dtypes=list(obj.dtypes),
            shapes=[list(s) for s in obj.shapes],
            group_name=obj.group_name,
        )

    async def update_weights_from_tensor(self, obj: Any, request: Any = None):
        refused = self._session_needed("update_weights_from_tensor")
        if refused:
            self.record("update_weights_from_tensor", weight_version=obj.weight_version)
            return refused
        return self._load(
            "update_weights_from_tensor",
            obj.weight_version,
            serialized=[bytes(b).decode() for b in obj.serialized_named_tensors],
        )

    async def update_weights_from_disk(self, obj: Any, request: Any = None):
        ok, message = self._load(
            "update_weights_from_disk", obj.weight_version, model_path=obj.model_path
        )
        return ok, message, 0
