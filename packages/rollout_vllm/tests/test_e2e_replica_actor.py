"""A real replica as a Ray actor: every process it starts stays on its cores, and generate
calls travel batched through `RemoteRolloutServer`, abort and resume included."""

from __future__ import annotations

import asyncio
import os

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

from offbeat.rollout_vllm import RemoteRolloutServer, VLLMServerConfig, vllm_server_actor  # noqa: E402
from offbeat.rollout_vllm.replica import OMP_BIND, PRESTART_ENV  # noqa: E402

ENGINE_KWARGS = {
    "max_model_len": 256,
    "dtype": "float32",
    "enforce_eager": True,
    "max_num_seqs": 32,
}


@pytest.fixture(scope="module")
def replica(tiny_model, ray_session):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores: confinement to one must be visible")
    core = cores[-1]
    ray = ray_session.up()
    handle = vllm_server_actor(
        VLLMServerConfig(model=str(tiny_model), engine_kwargs=dict(ENGINE_KWARGS)),
        cpus=[core],
        # PRESTART_ENV: as the job starts a CPU replica (its engine core forks from a
        # preloaded server, which must end on the replica's core too).
        runtime_env={
            "env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", OMP_BIND: str(core), PRESTART_ENV: "1"}
        },
    )
    yield handle, core
    ray.get(handle.shutdown.remote())
    ray.kill(handle)


def test_every_process_and_thread_of_the_replica_is_on_its_cores(replica):
    import ray

    handle, core = replica
    tree = ray.get(handle.process_cpus.remote())
    # The actor, the preloaded forkserver and vLLM's engine core forked from it (and its
    # worker, where vLLM starts one).
    assert len(tree) >= 3 and any(name.startswith("VLLM") for name, _ in tree.values()), tree
    wrong = {pid: (name, cpus) for pid, (name, cpus) in tree.items() if cpus != [core]}
    assert not wrong, f"processes outside core {core}: {wrong}"


@pytest.mark.asyncio
async def test_batched_generate_abort_and_resume_through_the_actor(replica, prompt_ids):
    handle, _ = replica
    server = RemoteRolloutServer(handle)
    await server.refresh()
    params = {"max_tokens": 150, "temperature": 0.0, "ignore_eos": True}
    calls = [
        asyncio.create_task(server.generate(f"b-{i}", prompt_ids[i % len(prompt_ids)], params))
        for i in range(48)
    ]  # more than max_num_seqs (32) + the server's queue (8): some wait in the server
    for _ in range(2000):
        status = await server.status()
        if status["inflight"] + status["waiting"] == len(calls):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)
    await server.abort_all()
    last = (await server.status())["last_abort"]
    # The engine held max_num_seqs + 8; the rest waited in the server, untouched.
    assert (last["inflight"], last["waiting"]) == (40, 8)
    for _ in range(2000):
        if sum(c.done() for c in calls) >= 40:
            break
        await asyncio.sleep(0.01)
    aborted = [c.result() for c in calls if c.done()]
    assert len(aborted) == 40
    assert {o.stop_reason for o in aborted} <= {"aborted", "length"}
    assert any(o.stop_reason == "aborted" for o in aborted)
    assert all(len(o.token_ids) == len(o.logprobs) <= 150 for o in aborted)
    untouched = [c for c in calls if not c.done()]

    # Paused: a new batched call waits until resume(), then finishes; so do the calls
    # that were waiting, whole.
    late = asyncio.create_task(server.generate("late", prompt_ids[0], {"max_tokens": 3}))
    await asyncio.sleep(0.3)
    assert not late.done() and not any(c.done() for c in untouched)
    await server.resume()
    assert len((await asyncio.wait_for(late, 60)).token_ids) == 3
    whole = await asyncio.wait_for(asyncio.gather(*untouched), 60)
    assert [(o.stop_reason, len(o.token_ids)) for o in whole] == [("length", 150)] * 8

    # A caller that gives up cancels its request on the replica.
    slow = asyncio.create_task(server.generate("slow", prompt_ids[0], params))
    await asyncio.sleep(0.3)
    slow.cancel()
    for _ in range(500):
        if (await server.status())["inflight"] == 0:
            break
        await asyncio.sleep(0.01)
    assert (await server.status())["inflight"] == 0


@pytest.mark.asyncio
async def test_a_group_through_the_actor_survives_an_abort_under_the_client(replica, prompt_ids):
    """Groups travel the batched path too: an abort mid-group returns each sample as it
    stands and the client resumes each one on its own, to its full budget."""
    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig

    handle, _ = replica
    server = RemoteRolloutServer(handle)
    await server.refresh()
    client = PartialRolloutClient(
        AsyncLoadBalancer({"r": server}), PartialRolloutConfig(max_tokens=120)
    )
    params = {"temperature": 0.8, "ignore_eos": True, "seed": 3}
    groups = [
        asyncio.create_task(client.generate_group(f"g-{i}", prompt_ids[i], params, 4))
        for i in range(3)
    ]
    for _ in range(2000):
        if (await server.status())["inflight"] == len(groups):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    await server.abort_all()
    await server.resume()
    outs = await asyncio.wait_for(asyncio.gather(*groups), 120)
    samples = [o for group in outs for o in group]
    assert [len(group) for group in outs] == [4, 4, 4]
    assert all(len(o.token_ids) == len(o.logprobs) == 120 for o in samples)
    assert all(o.stop_reason == "length" for o in samples)
    assert any(o.extra["num_attempts"] == 2 for o in samples)  # the abort landed mid-group
    last = (await server.status())["last_abort"]
    assert last["inflight"] == len(groups)  # one call per group in flight, not one per sample


@pytest.mark.asyncio
async def test_a_killed_engine_core_fails_its_calls_and_the_health_probe(replica, prompt_ids):
    """Last in the module (it ends the replica's engine): vLLM's engine-core process alone
    gets SIGKILL, the actor lives on. The calls in flight and new calls raise, and the
    health probe (`refresh`: what `ReplicaPool.check_health` asks) raises vLLM's
    EngineDeadError, so the pool removes the replica and replaces it."""
    import signal

    handle, _ = replica
    server = RemoteRolloutServer(handle)
    await server.refresh()
    tree = await handle.process_cpus.remote()
    (engine,) = [pid for pid, (name, _) in tree.items() if "EngineCore" in name]
    params = {"max_tokens": 150, "temperature": 0.0, "ignore_eos": True}
    calls = [
        asyncio.create_task(server.generate(f"k-{i}", prompt_ids[i % len(prompt_ids)], params))
        for i in range(4)
    ]
    for _ in range(2000):
        if (await server.status())["inflight"] == len(calls):
            break
        await asyncio.sleep(0.01)
    os.kill(engine, signal.SIGKILL)
    outs = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)
    assert all(isinstance(o, Exception) for o in outs), outs
    with pytest.raises(Exception, match="EngineDeadError"):
        await asyncio.wait_for(server.refresh(), 30)
    with pytest.raises(Exception, match="EngineCore encountered an issue"):  # vLLM's words
        await asyncio.wait_for(server.generate("after", prompt_ids[0], {"max_tokens": 2}), 30)
    assert (await server.status())["server_id"]  # the actor itself still answers
