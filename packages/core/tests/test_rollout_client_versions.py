"""The weight-version bounds the PartialRolloutClient reports, against a scripted server.

The server records which weight version produced each token. Every attempt is aborted
after a scripted number of tokens (0 included: a request aborted while queued or waiting
at the gate during a sync), one or more syncs then advance the version, and the client
resumes. `min_weight_version` / `max_weight_version` must bound exactly the versions that
produced the kept tokens; a response with no token at all takes the last attempt's.
"""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.core.rollout import PartialRolloutClient, TokenOutput


class ScriptedServer:
    """Attempt i produces `aborts[i]` tokens and answers "aborted"; then `syncs[i]` weight
    syncs advance the version. The attempt after the script produces `final` tokens (capped
    by the budget) and answers "stop" (or "length" when the budget cut it).
    `produced_by[j]` is the version that produced the j-th token the server returned."""

    def __init__(self, aborts: list[int], syncs: list[int], final: int, start: int = 0) -> None:
        assert len(aborts) == len(syncs)
        self.aborts, self.syncs, self.final = aborts, syncs, final
        self.version = start
        self.attempt = 0
        self.produced_by: list[int] = []
        self.attempt_versions: list[int] = []

    @property
    def weight_version(self) -> int:
        return self.version

    async def generate(self, request_id, prompt_ids, sampling_params) -> TokenOutput:
        await asyncio.sleep(0)
        i, self.attempt = self.attempt, self.attempt + 1
        budget = sampling_params["max_tokens"]
        aborted = i < len(self.aborts)
        n = min(self.aborts[i] if aborted else self.final, budget)
        v = self.version
        self.attempt_versions.append(v)
        tokens = [len(prompt_ids) + j for j in range(n)]  # position ids: resumes are exact
        self.produced_by += [v] * n
        if aborted:
            stop = "aborted"
            self.version += self.syncs[i]
        else:
            stop = "length" if n == budget and self.final > budget else "stop"
        return TokenOutput(tokens, [-0.5] * n, stop, weight_version=self.version,
                           min_weight_version=v, max_weight_version=v)  # fmt: skip


async def _run(server: ScriptedServer, budget: int) -> TokenOutput:
    client = PartialRolloutClient(AsyncLoadBalancer({"s0": server}))
    return await client.generate("r", [7, 7, 7], {"max_tokens": budget})


def _check(out: TokenOutput, server: ScriptedServer, prompt_len: int = 3) -> None:
    kept = server.produced_by[: len(out.token_ids)]
    assert out.token_ids == list(range(prompt_len, prompt_len + len(out.token_ids)))
    if kept:
        assert out.min_weight_version == min(kept)
        assert out.max_weight_version == max(kept)
    else:  # nothing produced: the weights that ended the request
        assert out.min_weight_version == out.max_weight_version == server.attempt_versions[-1]
    assert out.weight_version == server.version


@settings(max_examples=300, deadline=None)
@given(
    budget=st.integers(1, 12),
    script=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3)), max_size=8),
    final=st.integers(0, 12),
    start=st.integers(0, 4),
)
def test_version_bounds_cover_exactly_the_versions_that_produced_tokens(
    budget, script, final, start
):
    # Aborts at every position (0: before the first token), one to three syncs after each.
    aborts = [a for a, _ in script]
    syncs = [s for _, s in script]
    server = ScriptedServer(aborts, syncs, final, start)
    out = asyncio.run(_run(server, budget))
    assert len(out.token_ids) <= budget
    assert out.extra["num_attempts"] == server.attempt
    _check(out, server)


async def test_abort_before_the_first_token_does_not_set_the_min():
    # Queued at v0, aborted by the sync to v1 before any token; resumed on v1.
    server = ScriptedServer(aborts=[0], syncs=[1], final=4)
    out = await _run(server, 8)
    assert out.token_ids == [3, 4, 5, 6]
    assert (out.min_weight_version, out.max_weight_version) == (1, 1)
    assert server.attempt_versions == [0, 1]


async def test_several_empty_aborts_then_tokens_across_syncs():
    server = ScriptedServer(aborts=[0, 2, 0, 0, 3], syncs=[2, 1, 1, 3, 1], final=0, start=5)
    out = await _run(server, 10)
    # v5: aborted empty; v7: 2 tokens; v8, v9: empty; v12: 3 tokens; v13: final, empty.
    assert server.attempt_versions == [5, 7, 8, 9, 12, 13]
    assert len(out.token_ids) == 5
    assert (out.min_weight_version, out.max_weight_version) == (7, 12)
    assert out.weight_version == 13


async def test_no_token_at_all_takes_the_last_attempt():
    server = ScriptedServer(aborts=[0, 0], syncs=[1, 1], final=0)
    out = await _run(server, 4)
    assert out.token_ids == [] and out.stop_reason == "stop"
    assert (out.min_weight_version, out.max_weight_version) == (2, 2)
