"""PartialRolloutClient against fake servers that abort every k tokens.

The fake's next token is a function of the whole sequence so far (like greedy decoding),
so an interrupted-and-resumed generation must equal an uninterrupted one exactly: any lost
or duplicated token changes every token after it.
"""

from __future__ import annotations

import asyncio
import copy
from types import MappingProxyType
from typing import Any

import pytest

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig, TokenOutput

EOS = 0


def next_token(seq: list[int]) -> int:
    return (31 * seq[-1] + 7 * len(seq)) % 997 + 1  # never EOS by itself


def logprob_of(token: int) -> float:
    return -token / 1000.0


class FakeServer:
    """Generates `next_token` greedily; answers "aborted" after every `k` tokens (the
    weight version then advances, as if a sync happened); stops with EOS once the full
    sequence reaches `eos_at` tokens."""

    def __init__(self, k: int, *, eos_at: int | None = None, preempt: int = 0) -> None:
        self.k = k
        self.eos_at = eos_at
        self.preempt = preempt
        self.version = 0
        self.calls: list[dict[str, Any]] = []

    @property
    def weight_version(self) -> int:
        return self.version

    async def generate(self, request_id, prompt_ids, sampling_params) -> TokenOutput:
        self.calls.append(
            {"request_id": request_id, "prompt": list(prompt_ids), "params": dict(sampling_params)}
        )
        max_tokens = sampling_params["max_tokens"]
        assert "max_new_tokens" not in sampling_params
        assert isinstance(max_tokens, int) and max_tokens >= 1
        await asyncio.sleep(0)
        seq = list(prompt_ids)
        out: list[int] = []
        stop = "length"
        while len(out) < max_tokens:
            if self.eos_at is not None and len(seq) + 1 >= self.eos_at:
                tok, stop = EOS, "stop"
            else:
                tok = next_token(seq)
            out.append(tok)
            seq.append(tok)
            if stop == "stop":
                break
            if len(out) >= self.k and len(out) < max_tokens:
                stop = "aborted"
                break
        v = self.version
        if stop == "aborted":
            self.version += 1
        return TokenOutput(
            token_ids=out,
            logprobs=[logprob_of(t) for t in out],
            stop_reason=stop,
            weight_version=v,
            num_preempted=self.preempt,
            routed_experts=[[t, t % 8] for t in out],
        )


def reference(prompt: list[int], budget: int, eos_at: int | None = None) -> list[int]:
    """The uninterrupted greedy continuation."""
    seq, out = list(prompt), []
    while len(out) < budget:
        tok = EOS if eos_at is not None and len(seq) + 1 >= eos_at else next_token(seq)
        out.append(tok)
        seq.append(tok)
        if tok == EOS:
            break
    return out


def make_client(server, **config) -> PartialRolloutClient:
    balancer = AsyncLoadBalancer({"s0": server})
    return PartialRolloutClient(balancer, PartialRolloutConfig(**config))


@pytest.mark.parametrize("k", [1, 7, 1000])
@pytest.mark.parametrize("key", ["max_tokens", "max_new_tokens"])
async def test_resume_matches_uninterrupted(k, key):
    server = FakeServer(k)
    client = make_client(server)
    prompt = [5, 9, 2]
    params = MappingProxyType({key: 50, "temperature": 1.0, "top_p": 0.9})
    before = copy.deepcopy(dict(params))
    out = await client.generate("r1", prompt, params)

    assert dict(params) == before  # (a MappingProxy also cannot be written to)
    assert out.token_ids == reference(prompt, 50)
    assert out.stop_reason == "length"
    assert out.logprobs == [logprob_of(t) for t in out.token_ids]
    assert out.routed_experts == [[t, t % 8] for t in out.token_ids]
    expected_calls = -(-50 // k)
    assert len(server.calls) == expected_calls == out.extra["num_attempts"]
    # every call asked for exactly what was left, never more, never <= 0
    sent = [c["params"]["max_tokens"] for c in server.calls]
    assert sent == [50 - min(i * k, 50) for i in range(expected_calls)]
    assert all(c["params"]["temperature"] == 1.0 for c in server.calls)
    # resumed calls carry the prompt plus everything generated so far
    for i, call in enumerate(server.calls):
        assert call["prompt"] == prompt + out.token_ids[: i * k]
        assert call["request_id"] == "r1"
    assert out.min_weight_version == 0
    assert out.max_weight_version == out.weight_version == expected_calls - 1


@pytest.mark.parametrize("k", [1, 7, 1000])
async def test_budget_from_config_when_caller_gives_none(k):
    server = FakeServer(k)
    client = make_client(server, max_tokens=23)
    params: dict[str, Any] = {"temperature": 0.0}
    out = await client.generate("r", [1], params)
    assert params == {"temperature": 0.0}
    assert len(out.token_ids) == 23 and out.stop_reason == "length"
    assert all(c["params"]["max_tokens"] == 23 - (len(c["prompt"]) - 1) for c in server.calls)
    assert out.token_ids == reference([1], 23)


@pytest.mark.parametrize("k", [1, 7, 1000])
async def test_stop_before_budget_is_kept(k):
    server = FakeServer(k, eos_at=20)
    client = make_client(server)
    out = await client.generate("r", [3, 4], {"max_tokens": 100})
    assert out.stop_reason == "stop"
    assert out.token_ids == reference([3, 4], 100, eos_at=20)
    assert out.token_ids[-1] == EOS and len(out.token_ids) == 18


async def test_num_preempted_is_summed():
    server = FakeServer(5, preempt=2)
    out = await make_client(server).generate("r", [1], {"max_tokens": 12})
    assert out.extra["num_attempts"] == 3
    assert out.num_preempted == 6


async def test_server_overshooting_the_budget_is_cut_back():
    class Greedy(FakeServer):
        async def generate(self, request_id, prompt_ids, sampling_params):
            return await super().generate(
                request_id, prompt_ids, {**sampling_params, "max_tokens": 99}
            )

    out = await make_client(Greedy(1000)).generate("r", [1], {"max_tokens": 10})
    assert len(out.token_ids) == len(out.logprobs) == len(out.routed_experts) == 10
    assert out.stop_reason == "length"


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"max_new_tokens": -3}, "max_new_tokens=-3"),
        ({"max_tokens": 4, "max_new_tokens": 5}, "give one of them"),
        ({"max_tokens": 2.5}, "expected an int"),
    ],
)
async def test_bad_budget_is_refused_before_any_call(params, match):
    server = FakeServer(3)
    with pytest.raises(ValueError, match=match):
        await make_client(server).generate("r", [1], params)
    assert server.calls == []


def test_config_is_checked():
    with pytest.raises(ValueError, match="max_tokens"):
        PartialRolloutConfig(max_tokens=0)
    with pytest.raises(ValueError, match="max_attempts"):
        PartialRolloutConfig(max_attempts=0)


async def test_max_attempts_bounds_an_endless_abort_loop():
    client = make_client(FakeServer(1), max_attempts=3)
    with pytest.raises(RuntimeError, match="max_attempts=3"):
        await client.generate("r", [1], {"max_tokens": 10})


async def test_lease_released_on_success_abort_and_error():
    class Failing(FakeServer):
        async def generate(self, *args):
            raise RuntimeError("engine died")

    good = FakeServer(4)
    balancer = AsyncLoadBalancer({"good": good})
    client = PartialRolloutClient(balancer)
    await client.generate("a", [1], {"max_tokens": 9})
    assert balancer.inflight("good") == 0

    bad_balancer = AsyncLoadBalancer({"bad": Failing(1)})
    with pytest.raises(RuntimeError, match="engine died"):
        await PartialRolloutClient(bad_balancer).generate("b", [1], {"max_tokens": 3})
    assert bad_balancer.inflight("bad") == 0


async def test_waits_for_a_server_when_the_pool_is_empty():
    server = FakeServer(3)
    balancer = AsyncLoadBalancer({})
    client = PartialRolloutClient(balancer)
    task = asyncio.create_task(client.generate("r", [1], {"max_tokens": 8}))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()
    balancer.add_servers({"late": server})
    out = await asyncio.wait_for(task, 5)
    assert out.token_ids == reference([1], 8)


async def test_resume_waits_while_the_only_server_is_being_synced():
    """The server leaves the pool when it aborts (as during a sync) and comes back later:
    the resumed request waits instead of failing."""
    balancer = AsyncLoadBalancer({})

    class Leaving(FakeServer):
        async def generate(self, request_id, prompt_ids, sampling_params):
            out = await super().generate(request_id, prompt_ids, sampling_params)
            if out.stop_reason == "aborted":
                balancer.remove_servers(["s"])
                asyncio.get_running_loop().call_later(0.01, balancer.add_servers, {"s": self})
            return out

    server = Leaving(4)
    balancer.add_servers({"s": server})
    out = await PartialRolloutClient(balancer).generate("r", [2], {"max_tokens": 10})
    assert out.token_ids == reference([2], 10)
    assert out.extra["num_attempts"] == 3


async def test_sticky_resume_returns_to_the_same_server():
    servers = {f"s{i}": FakeServer(2) for i in range(4)}
    client = PartialRolloutClient(AsyncLoadBalancer(servers))
    outs = await asyncio.gather(
        *(client.generate(f"r{i}", [i + 1], {"max_tokens": 6}) for i in range(8))
    )
    for out in outs:
        assert len(set(out.extra["server_ids"])) == 1
        assert len(out.extra["server_ids"]) == 3


async def test_ray_style_handle_is_called_through_remote():
    class RemoteMethod:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args):
            return asyncio.ensure_future(self.fn(*args))  # awaitable, like an ObjectRef

    class ActorHandle:
        def __init__(self, server):
            self.generate = RemoteMethod(server.generate)

    server = FakeServer(5)
    client = PartialRolloutClient(AsyncLoadBalancer({"actor": ActorHandle(server)}))
    out = await client.generate("r", [4, 4], {"max_tokens": 12})
    assert out.token_ids == reference([4, 4], 12)
    assert len(server.calls) == 3


async def test_concurrent_requests_with_aborts_never_exceed_budget():
    servers = {f"s{i}": FakeServer(k) for i, k in enumerate([1, 3, 7])}
    client = PartialRolloutClient(AsyncLoadBalancer(servers), PartialRolloutConfig(max_tokens=17))
    outs = await asyncio.gather(
        *(
            client.generate(f"r{i}", [i % 5 + 1, i], {} if i % 2 else {"max_tokens": 11})
            for i in range(30)
        )
    )
    for i, out in enumerate(outs):
        budget = 17 if i % 2 else 11
        assert out.token_ids == reference([i % 5 + 1, i], budget)
        assert len(out.logprobs) == len(out.token_ids) == budget
    for s in servers.values():
        for c in s.calls:
            assert c["params"]["max_tokens"] >= 1
