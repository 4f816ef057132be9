"""The contract between offbeat and a rollout engine replica.

Knows nothing about any engine: token ids in, token ids + log-probs out. Adapters
(offbeat.rollout_vllm, offbeat.rollout_sglang) implement `RolloutServer`, and
`GroupRolloutServer` where the engine samples a group in one request; the
PartialRolloutClient and the trainer only ever talk to these protocols.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

StopReason = Literal["stop", "length", "aborted"]
STOP_REASONS: tuple[str, ...] = ("stop", "length", "aborted")


@dataclass
class TokenOutput:
    """What one generate call produced.

    `logprobs[i]` is the log-probability of `token_ids[i]` under the sampling distribution
    of the weights that produced it (needed for importance sampling). `weight_version` is
    the server's version when the output returned; `min_weight_version` /
    `max_weight_version` bound the versions that produced any of the tokens (they differ
    when a weight sync interrupted the request and it resumed on newer weights).
    """

    token_ids: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    weight_version: int
    min_weight_version: int | None = None
    max_weight_version: int | None = None
    num_preempted: int = 0
    routed_experts: list[Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(
                f"TokenOutput.stop_reason={self.stop_reason!r}: expected one of {STOP_REASONS}"
            )
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"TokenOutput: {len(self.token_ids)} token_ids but {len(self.logprobs)} logprobs"
            )
        if self.min_weight_version is None:
            self.min_weight_version = self.weight_version
        if self.max_weight_version is None:
            self.max_weight_version = self.weight_version


@runtime_checkable
class RolloutServer(Protocol):
    """One engine replica (one Ray actor per replica in a distributed run).

    `abort_all()` makes every `generate` the engine has started return
    `stop_reason="aborted"` with the tokens produced so far, and keeps the server paused
    (new `generate` calls wait) until `resume()`. A server may hold calls it has not yet
    passed to its engine (admission); those have produced nothing, and they simply wait
    through the pause and start after `resume()`, on the new weights. The weight-sync side (the target protocol of offbeat-ckpt-engine) is on the
    same object: see `offbeat.ckpt_engine.SyncTarget`. `weight_version` must not block: a
    proxy of a remote replica returns the last version it saw (None: none seen yet) and
    offers `async refresh() -> int` to ask.
    """

    @property
    def weight_version(self) -> int | None: ...

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]
    ) -> TokenOutput: ...

    async def abort_all(self) -> None: ...

    async def resume(self) -> None: ...

    async def release_kv_cache(self) -> None: ...

    async def resume_kv_cache(self) -> None: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...


@runtime_checkable
class GroupRolloutServer(RolloutServer, Protocol):
    """A `RolloutServer` that samples `n` responses to one prompt in one request (vLLM's
    `n`: one prefill, one shared prefix), e.g. a GRPO group. Optional: a client falls back
    to `n` `generate` calls on servers without it (`supports_group`).

    `generate_group` returns `n` TokenOutputs in sample order, each with its own tokens,
    log-probs, stop_reason and weight versions. `abort_all()` makes it return at once with
    every sample as it stands: finished samples keep their "stop" / "length", the others
    are "aborted" with the tokens they produced so far (possibly none). Sample `i` uses
    `sample_params(sampling_params, i)`.
    """

    async def generate_group(
        self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any], n: int
    ) -> list[TokenOutput]: ...


@runtime_checkable
class ScoringRolloutServer(RolloutServer, Protocol):
    """A `RolloutServer` that also scores given tokens: a teacher in on-policy
    distillation. Optional, like `GroupRolloutServer`: only the replicas a recipe scores
    with need it (`supports_scoring`).

    `compute_log_probs(request_id, token_ids, start)` returns the model's log-probability
    (temperature 1, no top-k/top-p) of each of `token_ids[start:]` given the tokens before
    it: `len(token_ids) - start` floats, `start >= 1`. It honours the pause gate like
    `generate`, and an `abort_all()` makes it raise rather than return partial scores.
    A vision-language server also takes `multi_modal_data=` (the prompt's images,
    `{"image": [PNG bytes, ...]}`, placeholders widened in `token_ids`), for both
    methods; callers pass it only for a prompt with images.
    """

    async def compute_log_probs(
        self, request_id: str, token_ids: list[int], start: int
    ) -> list[float]: ...


@runtime_checkable
class TopKScoringRolloutServer(ScoringRolloutServer, Protocol):
    """A `ScoringRolloutServer` that also returns the model's top-k alternatives at each
    scored position (a teacher for the top-k forward-KL loss; `supports_top_scoring`).

    `compute_top_log_probs(request_id, token_ids, start, k)` returns a dict of three lists,
    one entry per position of `token_ids[start:]`: `log_probs` (the given token's, as
    `compute_log_probs`), `top_ids` (the k most likely next tokens given the tokens
    before, most likely first) and `top_log_probs` (their log-probabilities, temperature
    1, not renormalised).
    """

    async def compute_top_log_probs(
        self, request_id: str, token_ids: list[int], start: int, k: int
    ) -> dict[str, list]: ...


def supports_top_scoring(server: Any) -> bool:
    """Whether `server` (a RolloutServer or a Ray actor handle of one) has
    `compute_top_log_probs`."""
    method = getattr(server, "compute_top_log_probs", None)
    return method is not None and (callable(method) or hasattr(method, "remote"))


def supports_scoring(server: Any) -> bool:
    """Whether `server` (a RolloutServer or a Ray actor handle of one) has
    `compute_log_probs`."""
    method = getattr(server, "compute_log_probs", None)
    return method is not None and (callable(method) or hasattr(method, "remote"))


def supports_group(server: Any) -> bool:
    """Whether `server` (a RolloutServer or a Ray actor handle of one) has
    `generate_group`."""
    method = getattr(server, "generate_group", None)
    return method is not None and (callable(method) or hasattr(method, "remote"))


def sample_params(params: Mapping[str, Any], index: int) -> dict[str, Any]:
    """The sampling params of sample `index` of a group, as vLLM derives them for `n > 1`:
    a per-request `seed` becomes `seed + index` (seeded samples differ from each other and
    stay reproducible); without a seed, the params as given. Returns a new dict."""
    out = dict(params)
    if out.get("seed") is not None:
        out["seed"] = int(out["seed"]) + index
    return out
