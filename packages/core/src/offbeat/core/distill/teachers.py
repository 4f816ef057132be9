"""Teachers: routing a sample to its teacher, and scoring its tokens on that teacher.

`TeacherRouter` maps a dataset row to a teacher name by one row field (`teacher_key`,
e.g. `data_source`), with an optional default. `TeacherPool` holds one balancer per
teacher over that teacher's replicas (anything with `compute_log_probs`, see
`ScoringRolloutServer`) and scores (prompt + response) token sequences with retries on
other replicas, keeping per-teacher counts and latencies. A replica a call failed on is
probed, and one that does not answer is removed and, given a teacher's `Replacement`,
replaced (`offbeat.core.trainer.fixed_replicas.FixedReplicas`): the retries wait in the
balancer for the replacement. Knows nothing about how the replicas are started (the pool
only takes `{teacher: {server_id: server}}` and the replacements the job gives) or about
training.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["TeacherPool", "TeacherRouter", "TeacherScoringError"]


def _images_kwarg(multi_modal_data: Any) -> dict[str, Any]:
    """`{"multi_modal_data": ...}` for a prompt with images, else nothing: a text
    teacher's replicas are called as before."""
    return {"multi_modal_data": multi_modal_data} if multi_modal_data else {}


class TeacherScoringError(RuntimeError):
    """A sequence could not be scored by its teacher after every retry."""


class TeacherRouter:
    """`route(row) -> teacher name`; raises KeyError for a value with no teacher and no
    default."""

    def __init__(self, names: list[str], *, teacher_key: str = "data_source", default: str = ""):
        if default and default not in names:
            raise ValueError(f"default teacher {default!r} is not one of {names}")
        self.names = list(names)
        self.teacher_key = teacher_key
        self.default = default
        self.counts: dict[str, int] = defaultdict(int)  # rows routed, by teacher

    def route(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.teacher_key)
        name = str(value) if value is not None else ""
        if name not in self.names:
            if not self.default:
                raise KeyError(
                    f"row {self.teacher_key}={value!r} has no teacher (teachers: {self.names}; "
                    "set distillation.default_teacher)"
                )
            name = self.default
        self.counts[name] += 1
        return name

    def index(self, name: str) -> int:
        return self.names.index(name)


class TeacherPool:
    """One `AsyncLoadBalancer` per teacher; `score(teacher, ids, start)` with retries."""

    def __init__(
        self,
        servers: Mapping[str, Mapping[str, Any]],
        *,
        max_retries: int = 2,
        timeout_s: float = 120.0,
        retry_delay_s: float = 0.5,
        replacements: Mapping[str, Any] | None = None,
        health_timeout_s: float = 30.0,
    ) -> None:
        from offbeat.balancer.aio import AsyncLoadBalancer
        from offbeat.core.trainer.fixed_replicas import FixedReplicas

        self.servers = {name: dict(s) for name, s in servers.items()}
        self.balancers = {name: AsyncLoadBalancer(dict(s)) for name, s in self.servers.items()}
        replacements = dict(replacements or {})
        # Per teacher: its live replicas (the same dicts as `servers`), removals, replacements.
        self.replicas = {
            name: FixedReplicas(
                self.servers[name], b, replacement=replacements.get(name),
                health_timeout_s=health_timeout_s, kind=f"teacher {name}",
            )
            for name, b in self.balancers.items()
        }  # fmt: skip
        for name, r in self.replicas.items():
            self.servers[name] = r.servers  # one dict: replacements show up in `servers`
        self.max_retries = max_retries
        self.timeout_s = timeout_s
        self.retry_delay_s = retry_delay_s
        self._stats: dict[str, dict[str, float]] = {}
        self._calls = 0

    @property
    def names(self) -> list[str]:
        return list(self.servers)

    async def score(
        self, teacher: str, token_ids: list[int], start: int, multi_modal_data: Any = None
    ) -> list[float]:
        """The teacher's log-prob of each of `token_ids[start:]`. A failed or timed-out
        call retries (another replica where the balancer has one) up to `max_retries`
        times, then raises TeacherScoringError. `multi_modal_data`: the prompt's images
        (`{"image": [PNG bytes, ...]}`), sent to a vision-language teacher with the ids."""
        mm = _images_kwarg(multi_modal_data)
        out = await self._score(
            teacher, lambda h, rid: h.compute_log_probs(rid, token_ids, start, **mm),
            len(token_ids) - start, lambda r: r,
        )  # fmt: skip
        return [float(x) for x in out]

    async def score_top(
        self, teacher: str, token_ids: list[int], start: int, k: int, multi_modal_data: Any = None
    ) -> dict[str, list]:
        """`score`, plus the teacher's `k` most likely tokens at each scored position:
        `{"log_probs", "top_ids", "top_log_probs"}` (`compute_top_log_probs`)."""
        mm = _images_kwarg(multi_modal_data)
        return await self._score(
            teacher, lambda h, rid: h.compute_top_log_probs(rid, token_ids, start, k, **mm),
            len(token_ids) - start, lambda r: r["log_probs"],
        )  # fmt: skip

    async def _score(self, teacher: str, call: Any, expect: int, log_probs: Any) -> Any:
        balancer = self.balancers[teacher]
        self._calls += 1
        rid = f"{teacher}-score-{self._calls}"
        replicas = self.replicas[teacher]
        last: BaseException | None = None
        for attempt in range(self.max_retries + 1):
            t0 = time.perf_counter()
            sid = None
            try:
                async with balancer.lease(rid, timeout=self.timeout_s) as lease:
                    sid = lease.server_id
                    out = await asyncio.wait_for(
                        call(lease.handle, f"{rid}-{attempt}"), self.timeout_s
                    )
            except asyncio.CancelledError:
                raise
            except Exception as e:
                last = e
                self._add(teacher, errors=1)
                logger.warning(
                    "teacher %s: scoring %s failed on %s (%s), attempt %d", teacher, rid, sid,
                    e, attempt + 1,
                )  # fmt: skip
                # A dead replica is removed (and a replacement started) before the retry
                # leases again, which waits for the replacement when no other replica
                # serves (not cut by `timeout_s`: the start has its own bound); none left
                # and none coming: the retries cannot be served.
                if not await replicas.failed(sid, e) or not await replicas.wait_available():
                    break
                await asyncio.sleep(self.retry_delay_s * (attempt + 1))
                continue
            n = len(log_probs(out))
            if n != expect:
                last = RuntimeError(f"{n} log-probs for {expect} tokens")
                self._add(teacher, errors=1)
                continue
            self._add(teacher, calls=1, tokens=n, latency_s=time.perf_counter() - t0)
            return out
        left = "" if replicas.available else f"; no replica left: {replicas.summary()}"
        raise TeacherScoringError(
            f"teacher {teacher!r} could not score a sequence after {attempt + 1} "
            f"attempts: {type(last).__name__}: {last}{left}"
        )

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per teacher: the replicas removed (why), replaced (by which), given up on."""
        return {name: r.summary() for name, r in self.replicas.items()}

    @property
    def started(self) -> dict[str, Any]:
        """Every replacement the pool started (for the job to shut down)."""
        return {k: v for r in self.replicas.values() for k, v in r.started.items()}

    async def close(self) -> None:
        for r in self.replicas.values():
            await r.close()

    def _add(self, teacher: str, **values: float) -> None:
        s = self._stats.setdefault(teacher, defaultdict(float))
        for k, v in values.items():
            s[k] += v
        if "latency_s" in values:
            s["latency_max_s"] = max(s["latency_max_s"], values["latency_s"])

    def drain_metrics(self) -> dict[str, float]:
        """Per teacher since the last call: scoring calls, tokens scored, errors, mean and
        max latency (`distill/<name>/...`)."""
        out: dict[str, float] = {}
        for name, s in self._stats.items():
            calls = s.get("calls", 0.0)
            out[f"distill/{name}/score_calls"] = calls
            out[f"distill/{name}/scored_tokens"] = s.get("tokens", 0.0)
            out[f"distill/{name}/score_errors"] = s.get("errors", 0.0)
            if calls:
                out[f"distill/{name}/latency_mean_s"] = s["latency_s"] / calls
                out[f"distill/{name}/latency_max_s"] = s["latency_max_s"]
        self._stats = {}
        return out
