"""Judge calls through the balancer over fake judge replicas: a dead one is removed, and
replaced when the transport has a `Replacement`."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from offbeat.core.rewards.genrm import GenRMConfig, GenRMJudge
from offbeat.core.rewards.genrm_replicas import BalancedJudgeTransport


class Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class Replica:
    def __init__(self, reply: str, dead: bool = False):
        self.reply, self.dead, self.calls = reply, dead, 0

    async def generate(self, request_id, prompt_ids, params):
        self.calls += 1
        await asyncio.sleep(0)
        if self.dead:
            raise RuntimeError("replica died")
        return SimpleNamespace(token_ids=[ord(c) for c in self.reply])

    async def refresh(self):  # the health probe after a failed call
        if self.dead:
            raise RuntimeError("replica died")
        return 0


def test_dead_judge_replica_is_removed_and_scoring_goes_on():
    cfg = GenRMConfig(retries=1)
    a, b = Replica("ok 9", dead=True), Replica("ok 9")
    transport = BalancedJudgeTransport({"judge-0": a, "judge-1": b}, Tok(), cfg)
    judge = GenRMJudge(cfg, post=transport, urls=["balancer"])

    async def go():
        return [await judge.score("q", str(i)) for i in range(6)]

    assert asyncio.run(go()) == [0.9] * 6
    assert transport.removed == ["judge-0"] and a.calls == 1 and b.calls == 6
    assert transport.balancer.servers() == ["judge-1"]


def test_setup_judge_installs_a_url_judge_only_for_reward_name_genrm():
    import dataclasses

    from offbeat.core.config import JobConfig, RewardConfig
    from offbeat.core.rewards import RewardRegistry, genrm
    from offbeat.core.rewards.genrm_replicas import setup_judge

    async def post(url, payload, timeout):
        return {"choices": [{"text": f"{url} says 10"}]}

    assert setup_judge(JobConfig()) is None
    reward = RewardConfig(name="genrm", genrm={"url": "http://j", "weights": {"a": 1}})
    cfg = dataclasses.replace(JobConfig(), reward=reward)

    async def go():
        judge = setup_judge(cfg, post=post)
        score = await asyncio.to_thread(RewardRegistry(name="genrm").score, "a", "r", "t")
        return judge, score

    try:
        judge, score = asyncio.run(go())
    finally:
        genrm.install(None)
    assert score == 1.0 and judge.cfg.weights == {"a": 1.0} and judge.judgments == 1


def test_concurrent_calls_on_a_dead_replica_remove_it_once():
    cfg = GenRMConfig(retries=2, max_concurrency=8)
    a, b = Replica("ok 9", dead=True), Replica("ok 9")
    transport = BalancedJudgeTransport({"judge-0": a, "judge-1": b}, Tok(), cfg)
    judge = GenRMJudge(cfg, post=transport, urls=["balancer"])

    async def go():
        return await asyncio.gather(*(judge.score("q", str(i)) for i in range(8)))

    assert asyncio.run(go()) == [0.9] * 8
    assert a.calls > 1  # several calls were in flight on it when it died
    assert transport.removed == ["judge-0"] and judge.removed_replicas == ["judge-0"]
    assert judge.errors == a.calls and judge.judgments == 8
