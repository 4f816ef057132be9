"""PartialRolloutClient: one call per trajectory turn, whatever interrupts it underneath.

`await client.generate(request_id, prompt_ids, sampling_params)` leases a server from the
balancer, calls it, and releases the lease in `finally`. When the server answers
"aborted" (a weight sync paused it) the client sends prompt + every token so far back to
the balancer under the same request id (stickiness returns it to the same server unless
that one left) with the remaining budget, until the answer is final. The agent loop sees
one `TokenOutput`, as if nothing had happened. Each server call is a span on one of that
server's lanes in the run's trace, if one is active (`offbeat.core.trace`).

Knows nothing about engines, weights or Ray beyond one thing: a server handle is either
an object with `async generate(...)` or a Ray actor handle (`handle.generate.remote`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from offbeat.core import trace
from offbeat.core.rollout.protocol import TokenOutput

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


class PartialRolloutClient:
    """Generate through a balancer, resuming transparently after "aborted" answers.

    `balancer` is an `offbeat.balancer.aio.AsyncLoadBalancer` (or anything with an
    `acquire(request_id, *, group_id, prompt_ids, timeout)` returning a lease with
    `.handle` and `.server_id`, and a `release(lease)`; either may be async).
    """

    def __init__(self, balancer: Any, config: PartialRolloutConfig | None = None) -> None:
        self.balancer = balancer
        self.config = config or PartialRolloutConfig()

    async def _call(self, handle: Any, request_id: str, prompt: list[int], params: dict):
        generate = handle.generate
        if hasattr(generate, "remote"):  # a Ray actor handle
            return await generate.remote(request_id, prompt, params)
        return await generate(request_id, prompt, params)

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        group_id: Any = None,
    ) -> TokenOutput:
        """One finished response ("stop" or "length") for `prompt_ids`.

        Never mutates `sampling_params`; never asks a server for more than the remaining
        budget (nor for a budget <= 0); `logprobs` and `routed_experts` stay aligned with
        `token_ids`; `num_preempted` is summed; `weight_version` is the last attempt's.

        `min_weight_version` / `max_weight_version` bound the versions that produced the
        kept tokens: the min of the first attempt that kept a token and the max of the
        last one that did. An attempt aborted before its first token (queued, or paused at
        the gate, during a sync) produced nothing and bounds nothing. A response with no
        token at all takes both from the last attempt, the weights that ended it.
        """
        base = dict(sampling_params or {})
        budget = _budget(base, self.config.max_tokens)
        base.pop("max_new_tokens", None)
        prompt = list(prompt_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        routed: list[Any] | None = None
        num_preempted = 0
        servers: list[str] = []
        first: TokenOutput | None = None
        last: TokenOutput | None = None
        # The first and the last attempt that kept at least one token (version bounds).
        first_kept: TokenOutput | None = None
        last_kept: TokenOutput | None = None
        stop = "length"
        while True:
            remaining = budget - len(tokens)
            if remaining <= 0:
                stop = "length"
                break
            if self.config.max_attempts is not None and len(servers) >= self.config.max_attempts:
                raise RuntimeError(
                    f"request {request_id!r}: still aborted after {len(servers)} attempts "
                    f"(PartialRolloutConfig.max_attempts={self.config.max_attempts}); "
                    f"{len(tokens)}/{budget} tokens generated"
                )
            full = prompt + tokens
            lease = await _maybe_await(
                self.balancer.acquire(
                    request_id,
                    group_id=group_id,
                    prompt_ids=full,
                    timeout=self.config.acquire_timeout_s,
                )
            )
            try:
                # One lane per request in flight on this server, in the run's trace if any.
                with trace.lane_span("generate", lease.server_id, request=request_id) as args:
                    out = await self._call(
                        lease.handle, request_id, full, {**base, "max_tokens": remaining}
                    )
                    args.update(tokens=len(out.token_ids), stop=out.stop_reason)
            finally:
                await _maybe_await(self.balancer.release(lease))
            servers.append(lease.server_id)
            if first is None:
                first = out
            last = out
            # A server that overshoots the budget is cut back to it.
            n_new = min(len(out.token_ids), remaining)
            if n_new > 0:
                first_kept = first_kept or out
                last_kept = out
            tokens.extend(out.token_ids[:n_new])
            logprobs.extend(out.logprobs[:n_new])
            routed = _extend_routed(routed, out, n_new, first_attempt=out is first)
            num_preempted += out.num_preempted
            if out.stop_reason != "aborted":
                stop = "length" if n_new < len(out.token_ids) else out.stop_reason
                break
        assert first is not None and last is not None
        return TokenOutput(
            token_ids=tokens,
            logprobs=logprobs,
            stop_reason=stop,
            weight_version=last.weight_version,
            min_weight_version=(first_kept or last).min_weight_version,
            max_weight_version=(last_kept or last).max_weight_version,
            num_preempted=num_preempted,
            routed_experts=routed,
            extra={"num_attempts": len(servers), "server_ids": servers},
        )


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
