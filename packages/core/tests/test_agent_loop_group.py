"""SingleTurnAgentLoop sends a GRPO group as one request where the client can, keeps the
engine-error retry, and seeds sample i with seed + i on either path."""

from __future__ import annotations

import pytest
from trainer_fakes import FakeTokenizer

from offbeat.core.rewards import RewardRegistry, register_reward
from offbeat.core.rollout import TokenOutput
from offbeat.core.trainer import GroupFailed, SingleTurnAgentLoop

ROW = {"prompt": "add: 3+4", "data_source": "group_source", "ground_truth": "7"}


@pytest.fixture(autouse=True)
def _reward():
    register_reward("group_source", lambda response, ground_truth, **_: float(response == "7"))


def answer(seed: int | None) -> TokenOutput:
    """Answers "7" for seed 7, else a digit from the seed: samples are told apart by their seed."""
    digit = ord("0") + (seed or 0) % 10
    return TokenOutput([digit], [-0.1], "stop", 3, min_weight_version=2)


class SingleClient:
    """A client without generate_group."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def generate(self, request_id, prompt_ids, params):
        self.calls.append(("single", request_id, dict(params)))
        return answer(params.get("seed"))


class GroupClient(SingleClient):
    """Fails its first `fail` group calls (an engine error), then answers."""

    def __init__(self, fail: int = 0) -> None:
        super().__init__()
        self.fail = fail

    async def generate_group(self, request_id, prompt_ids, params, n):
        self.calls.append(("group", request_id, dict(params), n))
        if self.fail:
            self.fail -= 1
            raise ConnectionError("replica gone")
        return [answer(params.get("seed", 0) + i) for i in range(n)]


def agent(client, **kw) -> SingleTurnAgentLoop:
    return SingleTurnAgentLoop(client, FakeTokenizer(), RewardRegistry(), {"max_tokens": 4}, **kw)


async def test_a_group_is_one_request_when_the_client_has_generate_group():
    client = GroupClient()
    trajectories = await agent(client).sample("g0", ROW, 4, {"seed": 5})
    assert client.calls == [("group", "g0", {"max_tokens": 4, "seed": 5}, 4)]
    # in sample order: seeds 5, 6, 7, 8 -> only the third answers "7"
    assert [t.reward for t in trajectories] == [0.0, 0.0, 1.0, 0.0]
    assert all(t.group_uid == "g0" for t in trajectories)
    assert [(t.min_weight_version, t.max_weight_version) for t in trajectories] == [(2, 3)] * 4


async def test_one_sample_and_clients_without_groups_send_single_requests():
    client = GroupClient()
    await agent(client).sample("g1", ROW, 1)
    assert [c[:2] for c in client.calls] == [("single", "g1-0")]

    single = SingleClient()
    trajectories = await agent(single).sample("g2", ROW, 3, {"seed": 6})
    assert [(c[1], c[2]["seed"]) for c in single.calls] == [("g2-0", 6), ("g2-1", 7), ("g2-2", 8)]
    assert [t.reward for t in trajectories] == [0.0, 1.0, 0.0]  # same seeds as a group


async def test_an_engine_error_retries_the_group():
    healed = []

    async def on_engine_error(exc):
        healed.append(str(exc))
        return True

    client = GroupClient(fail=1)
    trajectories = await agent(client, on_engine_error=on_engine_error).sample("g3", ROW, 2)
    assert healed == ["replica gone"]
    assert [c[0] for c in client.calls] == ["group", "group"]
    assert len(trajectories) == 2

    client = GroupClient(fail=5)
    loop = agent(client, on_engine_error=on_engine_error, max_retries=2)
    with pytest.raises(GroupFailed, match=r"generate\(g4\) failed: ConnectionError"):
        await loop.sample("g4", ROW, 2)
    assert len(client.calls) == 3  # the first try and two retries
