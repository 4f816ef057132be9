"""Generation, abort and resume through SGLang's real HTTP layer (test engine behind it)."""

from __future__ import annotations

import asyncio

import pytest

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.ckpt_engine.target import ReceiveSpec
from offbeat.core.rollout.client import PartialRolloutClient, PartialRolloutConfig
from offbeat.rollout_sglang import SGLangRequestRejected

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [11, 12, 13]


def expected(prompt: list[int], n: int, version: int = 0, start: int = 0) -> list[int]:
    # The test engine's tokens (sglang_test_engine.token_at), repeated here on purpose.
    return [(sum(prompt) + 31 * i + 7 * version) % 1000 for i in range(start, start + n)]


async def until(predicate, what: str) -> None:
    for _ in range(2000):
        if await predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def test_launch_waited_for_health_and_kept_the_log(sglang_app):
    proc = sglang_app.process
    assert proc.proc.poll() is None
    assert "--enable-memory-saver" in proc.argv  # added by the adapter
    assert proc.argv[proc.argv.index("--mem-fraction-static") + 1] == "0.5"
    assert "test engine behind SGLang's app" in proc.log_path.read_text()


async def test_generate_sends_input_ids_and_reads_ids_and_logprobs(server, control):
    out = await server.generate("r1", PROMPT, {"max_tokens": 5, "temperature": 1.0, "seed": 3})
    assert out.token_ids == expected(PROMPT, 5)
    assert out.logprobs == pytest.approx([-0.01 * (i + 1) for i in range(5)])
    assert out.stop_reason == "length"
    assert out.weight_version == out.min_weight_version == out.max_weight_version == 0
    [call] = await control.calls("generate")
    assert call["rid"].startswith("r1#") and call["input_ids"] == PROMPT
    assert call["sampling"] == {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 3}


async def test_a_stop_token_maps_to_stop(server):
    stop = expected(PROMPT, 3)[2]
    out = await server.generate("r2", PROMPT, {"max_tokens": 50, "stop_token_ids": [stop]})
    assert out.stop_reason == "stop"
    assert out.token_ids == expected(PROMPT, 3)


async def test_sglang_request_validation_becomes_a_value_error(server, control):
    with pytest.raises(SGLangRequestRejected) as e:
        await server.generate("bad", PROMPT, {"max_tokens": 4, "temperature": -1})
    assert isinstance(e.value, ValueError)
    assert e.value.endpoint == "/generate" and e.value.status == 400
    assert "temperature must be a non-negative" in str(e.value)
    assert await server.refresh() == 0  # the request's fault: the replica stays healthy
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        await server.generate("empty", [], {"max_tokens": 4})


async def test_abort_all_returns_partial_tokens_and_holds_until_resume(server, control):
    await control.script(token_delay_s=0.02)
    tasks = [
        asyncio.create_task(server.generate(f"a{i}", [i + 1, 2], {"max_tokens": 5000}))
        for i in range(3)
    ]

    async def running():
        return len((await control.state())["running"]) == 3

    await until(running, "three requests running")
    await server.abort_all()
    outs = [t.result() for t in tasks]  # abort_all returned: every call has returned
    for i, out in enumerate(outs):
        assert out.stop_reason == "aborted"
        assert out.token_ids == expected([i + 1, 2], len(out.token_ids))
        assert len(out.logprobs) == len(out.token_ids) < 5000
    assert [c["call"] for c in await control.calls("pause_generation")] == ["pause_generation"]
    assert (await control.state())["paused"]

    await control.script(token_delay_s=0.0)
    late = asyncio.create_task(server.generate("late", PROMPT, {"max_tokens": 3}))
    await asyncio.sleep(0.1)
    assert not late.done() and not [
        c for c in await control.calls("generate") if "late" in c["rid"]
    ]
    await server.resume()
    assert (await asyncio.wait_for(late, 30)).token_ids == expected(PROMPT, 3)
    names = [c["call"] for c in await control.calls()]
    assert names.index("continue_generation") < len(names) - 1  # late ran after resume


async def test_partial_rollout_client_resumes_across_a_weight_update(server, control):
    """The client's rules through the real HTTP layer: on "aborted" it resends prompt +
    tokens so far with the remaining budget, and records both weight versions."""
    budget = 400
    await control.script(token_delay_s=0.01)
    client = PartialRolloutClient(
        AsyncLoadBalancer({server.server_id: server}), PartialRolloutConfig(max_tokens=budget)
    )
    params = {"temperature": 1.0}
    task = asyncio.create_task(client.generate("traj", PROMPT, params))

    async def running():
        return len((await control.state())["running"]) == 1

    await until(running, "the request running")
    await server.abort_all()
    await server.update_weights(ReceiveSpec("disk", 1, {"model_path": "/ckpt/step-1"}))
    await control.script(token_delay_s=0.0)
    await server.resume()
    out = await asyncio.wait_for(task, 60)

    first, second = await control.calls("generate")
    k = len(second["input_ids"]) - len(PROMPT)
    assert 0 < k < budget
    assert second["input_ids"][: len(PROMPT)] == PROMPT
    assert second["sampling"]["max_new_tokens"] == budget - k
    assert first["sampling"]["max_new_tokens"] == budget
    assert params == {"temperature": 1.0}  # never mutated
    assert len(out.token_ids) == budget == len(out.logprobs) and out.stop_reason == "length"
    assert out.token_ids[:k] == expected(PROMPT, k, version=0)
    assert out.token_ids[k:] == expected(second["input_ids"], budget - k, version=1)
    assert (out.min_weight_version, out.max_weight_version) == (0, 1)
