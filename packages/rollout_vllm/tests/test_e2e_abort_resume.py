"""Abort mid-generation from another task, then resume: through the server alone and
through client + balancer with a weight sync in between."""

from __future__ import annotations

import asyncio

import pytest

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.ckpt_engine import CheckpointEngineManager
from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
from offbeat.rollout_vllm import compat

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]

BUDGET = 200  # longest prompt (48 tokens) + 200 < max_model_len (256)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def tokens_received(server) -> list[int]:
    """Output tokens each request inside the engine has delivered to this process so far
    (read from vLLM's output processor: an abort returns exactly these)."""
    return compat.tokens_received(server.engine)


async def wait_until_running(server, n: int, tokens: int = 2) -> None:
    """Until `n` requests are inside the engine and the first `min(n, max_num_seqs)` of
    them have each delivered `tokens` tokens."""
    for _ in range(6000):
        got = sorted(tokens_received(server), reverse=True)
        if len(got) >= n and got[min(n, 32) - 1] >= tokens:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"requests did not start decoding: {tokens_received(server)}")


async def uninterrupted(server, prompt_ids, tag):
    outs = await asyncio.gather(
        *(
            server.generate(f"{tag}-{i}", p, {"max_tokens": BUDGET, **GREEDY})
            for i, p in enumerate(prompt_ids)
        )
    )
    return [o.token_ids for o in outs]


async def test_abort_all_returns_partial_outputs_and_pauses(server, prompt_ids):
    tasks = [
        asyncio.create_task(server.generate(f"ab-{i}", p, {"max_tokens": BUDGET, **GREEDY}))
        for i, p in enumerate(prompt_ids)
    ]
    await wait_until_running(server, len(tasks))
    await server.abort_all()
    # abort_all returns only after every interrupted call has returned.
    assert all(t.done() for t in tasks)
    outs = [t.result() for t in tasks]
    assert all(o.stop_reason == "aborted" for o in outs)
    assert any(o.token_ids for o in outs)
    for o in outs:
        assert len(o.token_ids) == len(o.logprobs) < BUDGET

    # Paused: a new call waits at the gate until resume().
    waiting = asyncio.create_task(server.generate("late", prompt_ids[0], {"max_tokens": 3}))
    await asyncio.sleep(0.2)
    assert server.is_paused and not waiting.done()
    await server.resume()
    assert len((await asyncio.wait_for(waiting, 60)).token_ids) == 3

    # The partial outputs are prefixes of the uninterrupted greedy outputs.
    full = await uninterrupted(server, prompt_ids, "ab-ref")
    for o, ref in zip(outs, full, strict=True):
        assert o.token_ids == ref[: len(o.token_ids)]


async def test_client_resumes_across_a_weight_sync(
    server, tiny_model, prompt_ids, load_named_tensors
):
    """A sync (abort -> transfer -> resume) lands mid-generation. The same weights are
    synced, so the resumed greedy outputs must equal uninterrupted ones exactly: a lost or
    duplicated token would shift everything after it."""
    reference = await uninterrupted(server, prompt_ids, "ref")
    client = PartialRolloutClient(
        AsyncLoadBalancer({server.server_id: server}), PartialRolloutConfig(max_tokens=BUDGET)
    )
    v0 = server.weight_version
    tasks = [
        asyncio.create_task(client.generate(f"resume-{i}", p, GREEDY))
        for i, p in enumerate(prompt_ids)
    ]
    await wait_until_running(server, len(tasks))
    manager = CheckpointEngineManager("shm", phase_timeout_s=120)
    try:
        result = await manager.sync(load_named_tensors(tiny_model), v0 + 1, {"vllm": server})
    finally:
        manager.close()
    assert result.ok, result.failed
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 300)

    interrupted = [o for o in outs if o.extra["num_attempts"] > 1]
    assert interrupted, "the sync landed after every request had finished"
    for out, ref in zip(outs, reference, strict=True):
        assert len(out.token_ids) == BUDGET == len(out.logprobs)
        assert out.stop_reason == "length"
        assert out.token_ids == ref
        assert out.max_weight_version == out.weight_version == v0 + 1
    for out in interrupted:
        assert out.min_weight_version == v0 < out.max_weight_version


async def test_abort_touches_only_what_the_engine_holds(server, prompt_ids):
    """More calls than the engine's capacity (max_num_seqs + queue): the ones inside are
    aborted with their tokens; the ones still waiting in the server are not touched, and
    run whole after resume()."""
    capacity = server._admission.limit
    n = capacity + 12
    params = {"max_tokens": 64, **GREEDY}
    tasks = [
        asyncio.create_task(server.generate(f"cap-{i}", prompt_ids[i % len(prompt_ids)], params))
        for i in range(n)
    ]
    await wait_until_running(server, capacity)
    assert server.status()["inflight"] == capacity
    assert server.status()["waiting"] == n - capacity
    await server.abort_all()
    assert server.last_abort["inflight"] == capacity
    assert server.last_abort["waiting"] == n - capacity
    done = [t for t in tasks if t.done()]
    assert len(done) == capacity
    assert all(t.result().stop_reason in ("aborted", "length") for t in done)
    assert any(t.result().stop_reason == "aborted" for t in done)
    waiting = [t for t in tasks if not t.done()]
    await asyncio.sleep(0.2)
    assert not any(t.done() for t in waiting)  # paused: nothing admitted
    await server.resume()
    outs = await asyncio.wait_for(asyncio.gather(*waiting), 120)
    assert [len(o.token_ids) for o in outs] == [64] * len(waiting)
    assert all(o.stop_reason == "length" for o in outs)
