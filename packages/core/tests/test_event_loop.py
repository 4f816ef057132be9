"""Slow work never blocks the event loop: a heartbeat task keeps ticking while a checkpoint
save, a reward function, the detokeniser or the chat template takes a long, blocking
second. (Counts of ticks during the slow call, not durations: a blocked loop ticks at most
once while it is blocked.)"""

from __future__ import annotations

import asyncio
import time

import pytest
from trainer_fakes import FakeEngine, FakeTokenizer, Harness

from offbeat.core.rewards import RewardRegistry, register_reward
from offbeat.core.rollout import TokenOutput
from offbeat.core.trainer import SingleTurnAgentLoop

PERIOD_S = 0.01  # the heartbeat's period
SLOW_S = 1.0  # each slow call blocks its thread this long
MIN_TICKS = 10  # a free loop ticks ~SLOW_S / PERIOD_S = 100 times; a blocked one <= 1


class Heartbeat:
    def __init__(self) -> None:
        self.ticks: list[float] = []

    async def run(self) -> None:
        while True:
            self.ticks.append(time.perf_counter())
            await asyncio.sleep(PERIOD_S)

    def during(self, start: float, end: float) -> int:
        return sum(start <= t <= end for t in self.ticks)


class Slow:
    """Records the (start, end) of each call of a blocking, slow function."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def block(self, seconds: float) -> None:
        t0 = time.perf_counter()
        time.sleep(seconds)
        self.spans.append((t0, time.perf_counter()))


async def test_the_loop_ticks_through_a_slow_checkpoint_save(tmp_path):
    h = Harness(tmp_path, engine=FakeEngine(save_s=SLOW_S), save_freq=1, total_training_steps=2)
    beat = Heartbeat()
    task = asyncio.create_task(beat.run())
    try:
        await h.run()
    finally:
        task.cancel()
    assert [s for s, _ in h.checkpoints.complete()] == [1, 2]
    assert len(h.engine.saves) == 2
    for start, end in h.engine.saves:
        assert beat.during(start, end) >= MIN_TICKS


class SlowTokenizer(FakeTokenizer):
    def __init__(self, slow: Slow, where: str) -> None:
        self.slow, self.where = slow, where

    def apply_chat_template(self, *args, **kwargs):
        if self.where == "template":
            self.slow.block(SLOW_S)
        return super().apply_chat_template(*args, **kwargs)

    def decode(self, ids, skip_special_tokens=True):
        if self.where == "detokeniser":
            self.slow.block(SLOW_S / 2)  # per response: a group of 2 decodes for SLOW_S
        return super().decode(ids, skip_special_tokens)


class Client:
    async def generate(self, request_id, prompt_ids, params):
        return TokenOutput([ord("7")], [-0.1], "stop", 0)


@pytest.mark.parametrize("where", ["scorer", "detokeniser", "template"])
async def test_the_loop_ticks_through_slow_agent_loop_work(where):
    slow = Slow()

    def slow_reward(response, ground_truth, **_):
        if where == "scorer":
            slow.block(SLOW_S / 2)  # per response: a group of 2 scores for SLOW_S
        return float(response == ground_truth)

    register_reward("slow_source", slow_reward)
    agent = SingleTurnAgentLoop(
        Client(), SlowTokenizer(slow, where), RewardRegistry(), {"max_tokens": 4}
    )
    row = {"prompt": "add: 3+4", "data_source": "slow_source", "ground_truth": "7"}
    beat = Heartbeat()
    task = asyncio.create_task(beat.run())
    try:
        trajectories = await agent.sample("g0", row, 2)
    finally:
        task.cancel()
    assert [t.reward for t in trajectories] == [1.0, 1.0]
    assert slow.spans, f"the slow {where} was not called"
    start, end = slow.spans[0][0], slow.spans[-1][1]
    assert beat.during(start, end) >= MIN_TICKS


async def test_a_group_is_detokenised_in_one_batch():
    class Batching(FakeTokenizer):
        def __init__(self) -> None:
            self.batches: list[int] = []

        def batch_decode(self, ids, skip_special_tokens=True):
            self.batches.append(len(ids))
            return [self.decode(x, skip_special_tokens) for x in ids]

    tok = Batching()
    register_reward("slow_source", lambda response, ground_truth, **_: 1.0)
    agent = SingleTurnAgentLoop(Client(), tok, RewardRegistry(), {"max_tokens": 4})
    row = {"prompt": "add: 3+4", "data_source": "slow_source", "ground_truth": "7"}
    await agent.sample("g0", row, 3)
    assert tok.batches == [3]
