"""Bad input gets a clear ValueError naming the problem, and the engine keeps serving."""

from __future__ import annotations

import pytest

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.core.rollout import PartialRolloutClient

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], {"max_tokens": 4}, "prompt_ids is empty"),
        ("too long", {"max_tokens": 4}, "max_model_len is"),
        ([1, 2, 10_000], {"max_tokens": 4}, r"token ids are ints in \[0, 260\)"),
        ("text", {"max_tokens": 4}, "must be a list of token ids"),
        ([1, 2], {"max_tokenz": 4}, r"unknown sampling key\(s\) \['max_tokenz'\].*temperature"),
        ([1, 2], {"max_tokens": 0}, "max_tokens=0"),
        ([1, 2], {"max_tokens": 4, "temperature": -1.0}, "temperature"),
        ([1, 2], {"max_tokens": 4, "n": 2}, "n=2"),
    ],
)
async def test_bad_input_is_refused_and_engine_keeps_serving(server, prompt, params, match):
    if prompt == "too long":
        prompt = [65] * (server.max_model_len + 5)
    with pytest.raises(ValueError, match=match):
        await server.generate("bad", prompt, params)
    assert not server.is_paused
    out = await server.generate("good", [72, 105], {"max_tokens": 3})
    assert len(out.token_ids) == 3


async def test_bad_input_through_the_client_releases_the_lease(server):
    balancer = AsyncLoadBalancer({server.server_id: server})
    client = PartialRolloutClient(balancer)
    with pytest.raises(ValueError, match="unknown sampling key"):
        await client.generate("bad", [1, 2, 3], {"max_tokens": 2, "temprature": 0.5})
    assert balancer.inflight(server.server_id) == 0
    out = await client.generate("good", [1, 2, 3], {"max_tokens": 2})
    assert len(out.token_ids) == 2
