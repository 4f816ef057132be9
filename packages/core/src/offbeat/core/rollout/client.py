"""PartialRolloutClient: one call per trajectory turn, whatever interrupts it underneath.

`await client.generate(request_id, prompt_ids, sampling_params)` leases a server from the
balancer, calls it, and releases the lease in `finally`. When the server answers
"aborted" (a weight sync paused it) the client sends prompt + every token so far back to
the balancer under the same request id (stickiness returns it to the same server unless
that one left) with the remaining budget, until the answer is final. The agent loop sees
one `TokenOutput`, as if nothing had happened. `generate_group(..., n)` does the same for
the `n` samples of one prompt: one lease and one group request (where the server has
`generate_group`; else `n` requests under that lease), then each sample resumes on its
own. Each server call is a span on one of that server's lanes in the run's trace, if one
is active (`offbeat.core.trace`), and is tallied under its server id (`served_calls`,
`served_tokens`: each call once, where it ran), and is in flight in the run's progress
registry under stage "generation", keyed by that server id (`offbeat.core.progress`).

Knows nothing about engines, weights or Ray beyond one thing: a server handle is either
an object with `async generate(...)` (and maybe `generate_group(...)`) or a Ray actor
handle (`handle.generate.remote`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from offbeat.core import progress, trace
from offbeat.core.rollout.protocol import TokenOutput, sample_params, supports_group

__all__ = ["PartialRolloutClient", "PartialRolloutConfig"]


@dataclass
class PartialRolloutConfig:
    """`max_tokens`: the total response budget pinned when the caller's sampling params
    name none (so resumes cannot over-generate). `acquire_timeout_s`: how long to wait for
    a server when the pool is empty (None: until one comes back). `max_attempts`: bound on
    server calls per `generate` (None: no bound)."""

    max_tokens: int = 1024
    acquire_timeout_s: float | None = None
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"PartialRolloutConfig.max_tokens={self.max_tokens!r}: expected int")
        if self.max_tokens < 1:
            raise ValueError(f"PartialRolloutConfig.max_tokens={self.max_tokens}: must be >= 1")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(
                f"PartialRolloutConfig.max_attempts={self.max_attempts}: must be >= 1 or None"
            )


def _budget(params: Mapping[str, Any], default: int) -> int:
    given = {k: params[k] for k in ("max_tokens", "max_new_tokens") if params.get(k) is not None}
    if len(set(given.values())) > 1:
        raise ValueError(
            f"sampling_params has max_tokens={given['max_tokens']!r} and "
            f"max_new_tokens={given['max_new_tokens']!r}; give one of them"
        )
    if not given:
        return default
    key, value = next(iter(given.items()))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"sampling_params {key}={value!r}: expected an int >= 1")
    return value


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class _Sample:
    """One response assembled from the attempts that produced it.

    `min_weight_version` / `max_weight_version` bound the versions that produced the kept
    tokens: the min of the first attempt that kept a token and the max of the last one
    that did. An attempt aborted before its first token (queued, or paused at the gate,
    during a sync) produced nothing and bounds nothing. A response with no token at all
    takes both from the last attempt, the weights that ended it.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.routed: list[Any] | None = None
        self.num_preempted = 0
        self.cached_tokens = 0  # prefix-cache hits the servers reported, over attempts
        self.servers: list[str] = []
        self.first: TokenOutput | None = None
        self.last: TokenOutput | None = None
        self.first_kept: TokenOutput | None = None
        self.last_kept: TokenOutput | None = None
        self.stop: str | None = None  # set once final

    @property
    def remaining(self) -> int:
        return self.budget - len(self.tokens)

    def check_attempts(self, request_id: str, max_attempts: int | None) -> None:
        if max_attempts is not None and len(self.servers) >= max_attempts:
            raise RuntimeError(
                f"request {request_id!r}: still aborted after {len(self.servers)} attempts "
                f"(PartialRolloutConfig.max_attempts={max_attempts}); "
                f"{len(self.tokens)}/{self.budget} tokens generated"
            )

    def add(self, out: TokenOutput, server_id: str) -> None:
        """Keep what one attempt produced (cut back to the budget if it overshot)."""
        remaining = self.remaining
        self.servers.append(server_id)
        first_attempt = self.first is None
        self.first = self.first or out
        self.last = out
        n_new = min(len(out.token_ids), remaining)
        if n_new > 0:
            self.first_kept = self.first_kept or out
            self.last_kept = out
        self.tokens.extend(out.token_ids[:n_new])
        self.logprobs.extend(out.logprobs[:n_new])
        self.routed = _extend_routed(self.routed, out, n_new, first_attempt=first_attempt)
        self.num_preempted += out.num_preempted
        self.cached_tokens += int(out.extra.get("num_cached_tokens") or 0)
        if out.stop_reason != "aborted":
            self.stop = "length" if n_new < len(out.token_ids) else out.stop_reason
        elif n_new >= remaining:  # aborted, but the budget is spent
            self.stop = "length"

    def result(self) -> TokenOutput:
        assert self.stop is not None and self.first is not None and self.last is not None
        return TokenOutput(
            token_ids=self.tokens,
            logprobs=self.logprobs,
            stop_reason=self.stop,  # type: ignore[arg-type]
            weight_version=self.last.weight_version,
            min_weight_version=(self.first_kept or self.last).min_weight_version,
            max_weight_version=(self.last_kept or self.last).max_weight_version,
            num_preempted=self.num_preempted,
            routed_experts=self.routed,
            extra={
                "num_attempts": len(self.servers),
                "server_ids": self.servers,
                "num_cached_tokens": self.cached_tokens,
            },
        )


class PartialRolloutClient:
    """Generate through a balancer, resuming transparently after "aborted" answers.

    `balancer` is an `offbeat.balancer.aio.AsyncLoadBalancer` (or anything with an
    `acquire(request_id, *, group_id, prompt_ids, timeout)` returning a lease with
    `.handle` and `.server_id`, and a `release(lease)`; either may be async;
    `generate_group` also passes `cost=<samples in the request>`).
    """

    def __init__(self, balancer: Any, config: PartialRolloutConfig | None = None) -> None:
        self.balancer = balancer
        self.config = config or PartialRolloutConfig()
        # Per server id: the calls it answered and the tokens they brought back, each call
        # counted once where it ran (an interrupted sample's attempts count where each ran).
        self.served_calls: dict[str, int] = {}
        self.served_tokens: dict[str, int] = {}

    def _served(self, server_id: str, outs: Sequence[TokenOutput]) -> None:
        self.served_calls[server_id] = self.served_calls.get(server_id, 0) + len(outs)
        tokens = sum(len(o.token_ids) for o in outs)
        self.served_tokens[server_id] = self.served_tokens.get(server_id, 0) + tokens

    async def _call(self, handle: Any, request_id: str, prompt: list[int], params: dict):
        generate = handle.generate
        if hasattr(generate, "remote"):  # a Ray actor handle
            return await generate.remote(request_id, prompt, params)
        return await generate(request_id, prompt, params)

    async def _call_group(
        self, handle: Any, request_id: str, prompt: list[int], params: dict, indices: list[int]
    ) -> list[TokenOutput]:
        """The samples `indices` of group `request_id` on one server: one group request
        where the server has one, else one request per sample (ids `<request_id>-<i>`)."""
        if len(indices) > 1 and supports_group(handle):
            generate_group = handle.generate_group
            n = len(indices)
            if hasattr(generate_group, "remote"):  # a Ray actor handle
                outs = await generate_group.remote(request_id, prompt, params, n)
            else:
                outs = await generate_group(request_id, prompt, params, n)
            if len(outs) != n:
                raise RuntimeError(
                    f"generate_group({request_id!r}, n={n}) returned {len(outs)} outputs"
                )
            return list(outs)
        # vLLM's seed rule for n > 1, relative to the first sample of this call.
        return list(
            await asyncio.gather(
                *(
                    self._call(handle, f"{request_id}-{i}", prompt, sample_params(params, k))
                    for k, i in enumerate(indices)
                )
            )
        )

    async def _acquire(self, key: str, group_id: Any, prompt: list[int], cost: int) -> Any:
        # A group's lease costs its number of samples: the engine runs that many sequences.
        more = {"cost": cost} if cost != 1 else {}
        return await _maybe_await(
            self.balancer.acquire(
                key,
                group_id=group_id,
                prompt_ids=prompt,
                timeout=self.config.acquire_timeout_s,
                **more,
            )
        )

    async def _resume(
        self,
        key: str,
        request_id: str,
        prompt: list[int],
        base: dict[str, Any],
        sample: _Sample,
        group_id: Any,
    ) -> TokenOutput:
        """Call single requests until `sample` is final. `key` is the balancer's sticky key
        (a group's samples share their group's), `request_id` the server's."""
        while sample.stop is None:
            sample.check_attempts(request_id, self.config.max_attempts)
            full = prompt + sample.tokens
            lease = await self._acquire(key, group_id, full, 1)
            try:
                # One lane per request in flight on this server, in the run's trace if any.
                with (
                    trace.lane_span("generate", lease.server_id, request=request_id) as args,
                    progress.working("generation", lease.server_id, request_id),
                ):
                    out = await self._call(
                        lease.handle, request_id, full, {**base, "max_tokens": sample.remaining}
                    )
                    args.update(tokens=len(out.token_ids), stop=out.stop_reason)
                self._served(lease.server_id, [out])
            finally:
                await _maybe_await(self.balancer.release(lease))
            sample.add(out, lease.server_id)
        return sample.result()

    def _base(self, sampling_params: Mapping[str, Any] | None) -> tuple[dict[str, Any], int]:
        base = dict(sampling_params or {})
        budget = _budget(base, self.config.max_tokens)
        base.pop("max_new_tokens", None)
        return base, budget

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        group_id: Any = None,
        session_id: str | None = None,
    ) -> TokenOutput:
        """One finished response ("stop" or "length") for `prompt_ids`.

        `session_id`: the balancer's sticky key (default `request_id`): the turns of one
        multi-turn session pass the same one, so they reach the replica that holds their
        prefix in its cache.

        Never mutates `sampling_params`; never asks a server for more than the remaining
        budget (nor for a budget <= 0); `logprobs` and `routed_experts` stay aligned with
        `token_ids`; `num_preempted` is summed; `weight_version` is the last attempt's;
        `min_weight_version` / `max_weight_version` come from the attempts that kept
        tokens (see `_Sample`).
        """
        base, budget = self._base(sampling_params)
        key = session_id if session_id is not None else request_id
        return await self._resume(
            key, request_id, list(prompt_ids), base, _Sample(budget), group_id
        )

    async def generate_group(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None,
        n: int,
        *,
        group_id: Any = None,
    ) -> list[TokenOutput]:
        """`n` finished responses to `prompt_ids` (a GRPO group), in sample order.

        One lease (cost `n`) and one group request while no sample has a token: the
        server's `generate_group` where it has one, else `n` requests `<request_id>-<i>`
        on the leased server. After an abort, finished samples stay finished and each
        unfinished one resumes as its own request (`<request_id>-<i>`: prompt + its tokens
        so far, its remaining budget) leased under `request_id` (sticky: back to the
        group's server unless it left); if no unfinished sample has a token yet, they go
        again as one group request. Each sample keeps `generate`'s guarantees: budget,
        alignment, untouched `sampling_params`, version bounds and `max_attempts`.
        A per-request `seed` gives sample `i` the seed `seed + i` (`sample_params`).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"generate_group n={n!r}: expected an int >= 1")
        base, budget = self._base(sampling_params)
        if base.get("n") not in (None, 1):
            raise ValueError(
                f"sampling_params n={base['n']!r}: pass the group size as generate_group's n"
            )
        base.pop("n", None)
        prompt = list(prompt_ids)
        samples = [_Sample(budget) for _ in range(n)]
        while True:
            pending = [i for i, s in enumerate(samples) if s.stop is None]
            if not pending:
                break
            # A seeded group request gives its samples consecutive seeds, so only a
            # contiguous run of samples can go as one (each keeps seed + its index).
            contiguous = pending[-1] - pending[0] == len(pending) - 1
            fresh = not any(samples[i].tokens for i in pending)
            if not fresh or (base.get("seed") is not None and not contiguous):
                await asyncio.gather(
                    *(
                        self._resume(
                            request_id,
                            f"{request_id}-{i}",
                            prompt,
                            sample_params(base, i),
                            samples[i],
                            group_id,
                        )
                        for i in pending
                    )
                )
                break
            for i in pending:
                samples[i].check_attempts(f"{request_id}-{i}", self.config.max_attempts)
            params = {**sample_params(base, pending[0]), "max_tokens": budget}
            lease = await self._acquire(request_id, group_id, prompt, len(pending))
            try:
                with (
                    trace.lane_span(
                        "generate", lease.server_id, request=request_id, n=len(pending)
                    ) as args,
                    progress.working(
                        "generation", lease.server_id, f"{request_id} x{len(pending)}"
                    ),
                ):
                    outs = await self._call_group(lease.handle, request_id, prompt, params, pending)
                    args.update(
                        tokens=sum(len(o.token_ids) for o in outs),
                        stop=",".join(sorted({o.stop_reason for o in outs})),
                    )
                self._served(lease.server_id, outs)
            finally:
                await _maybe_await(self.balancer.release(lease))
            for i, out in zip(pending, outs, strict=True):
                samples[i].add(out, lease.server_id)
        return [s.result() for s in samples]


def _extend_routed(
    acc: list[Any] | None, out: TokenOutput, n_new: int, *, first_attempt: bool
) -> list[Any] | None:
    """Append the routed-experts rows of this attempt's kept tokens.

    Servers may return rows for the generated tokens only or for prompt + generated; in both
    cases the rows end with the generated tokens. The first attempt keeps everything up to
    its last kept token; a resumed attempt (whose prompt already holds earlier tokens) keeps
    only the rows of its new tokens.
    """
    rows = out.routed_experts
    if rows is None:
        return acc
    end = len(rows) - (len(out.token_ids) - n_new)
    start = 0 if first_attempt else max(end - n_new, 0)
    return [*(acc or []), *rows[start:end]]
