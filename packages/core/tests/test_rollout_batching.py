"""The batched call path between driver and replica actor, over a fake actor handle that
counts messages: many `generate` calls, few messages, every answer to its own caller."""

from __future__ import annotations

import asyncio

import pytest

from offbeat.core.rollout._batching import BatchedGenerateClient, GenerateStream


class _Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def remote(self, *args):
        self.actor.messages.append(self.name)
        if self.actor.dead:
            if self.name == "generate_results":
                return _failed_stream()
            return _Failed()
        method = getattr(self.actor, "_" + self.name)
        if self.name == "generate_results":
            return method(*args)  # a stream of awaitables, as Ray's streaming generator
        return asyncio.ensure_future(method(*args))


class _Failed:
    """A reference whose value is an error (awaited or not, like a Ray ObjectRef)."""

    def __await__(self):
        raise RuntimeError("actor died")
        yield


async def _failed_stream():
    raise RuntimeError("actor died")
    yield


async def _value(v):
    return v


class FakeReplica:
    """An actor handle whose methods run a `GenerateStream` over `fake_generate` in this
    loop: `handle.m.remote(...)` is one message; `generate_results` yields awaitables
    (Ray's streaming ObjectRefs)."""

    def __init__(self):
        self.messages: list[str] = []
        self.dead = False
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.release = asyncio.Event()
        self.stream = GenerateStream(self.fake_generate, self.fake_generate_group)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    async def fake_generate(self, request_id, prompt_ids, params):
        self.started.append(request_id)
        if request_id.startswith("bad"):
            raise ValueError(f"{request_id}: prompt rejected")
        try:
            if request_id.startswith("slow"):
                await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        return (request_id, list(prompt_ids), params["max_tokens"])

    async def fake_generate_group(self, request_id, prompt_ids, params, n):
        self.started.append(request_id)
        return [(f"{request_id}/{k}", params["max_tokens"]) for k in range(n)]

    async def _submit_generate(self, client_id, calls):
        self.stream.submit(client_id, calls)

    async def _cancel_generate(self, client_id, keys):
        self.stream.cancel(client_id, keys)

    async def _close_generate(self, client_id):
        self.stream.close(client_id)

    async def _generate_results(self, client_id):
        async for items in self.stream.results(client_id):
            if self.dead:
                raise RuntimeError("actor died")
            yield _value(items)


async def test_one_tick_of_calls_is_one_message_and_each_caller_gets_its_answer():
    actor = FakeReplica()
    client = BatchedGenerateClient(actor)
    outs = await asyncio.gather(
        *(client.generate(f"r{i}", [i, i + 1], {"max_tokens": i + 1}) for i in range(512))
    )
    assert outs == [(f"r{i}", [i, i + 1], i + 1) for i in range(512)]
    assert actor.messages.count("submit_generate") == 1
    assert actor.messages.count("generate_results") == 1
    assert client.waiting == 0


async def test_errors_reach_their_own_caller_with_their_type():
    actor = FakeReplica()
    client = BatchedGenerateClient(actor)
    good, bad = await asyncio.gather(
        client.generate("ok", [1], {"max_tokens": 1}),
        client.generate("bad-1", [1], {"max_tokens": 1}),
        return_exceptions=True,
    )
    assert good == ("ok", [1], 1)
    assert isinstance(bad, ValueError) and "bad-1" in str(bad)


async def test_a_cancelled_call_is_cancelled_on_the_actor():
    actor = FakeReplica()
    client = BatchedGenerateClient(actor)
    slow = asyncio.create_task(client.generate("slow-1", [1], {"max_tokens": 1}))
    other = asyncio.create_task(client.generate("slow-2", [1], {"max_tokens": 1}))
    while len(actor.started) < 2:
        await asyncio.sleep(0)
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    while "slow-1" not in actor.cancelled:
        await asyncio.sleep(0)
    assert "cancel_generate" in actor.messages and actor.cancelled == ["slow-1"]
    actor.release.set()
    assert await other == ("slow-2", [1], 1)


async def test_a_dead_actor_fails_every_waiting_call():
    actor = FakeReplica()
    client = BatchedGenerateClient(actor)
    waiting = [
        asyncio.create_task(client.generate(f"slow-{i}", [1], {"max_tokens": 1})) for i in range(3)
    ]
    while len(actor.started) < 3:
        await asyncio.sleep(0)
    actor.dead = True
    actor.release.set()
    for task in waiting:
        with pytest.raises(RuntimeError, match="actor died"):
            await task
    assert client.waiting == 0
    # A later call meets the same error instead of hanging.
    with pytest.raises(RuntimeError, match="actor died"):
        await asyncio.wait_for(client.generate("late", [1], {"max_tokens": 1}), 5)


def test_a_new_event_loop_starts_a_new_client_and_closes_the_old_one():
    actor_box = {}

    async def first():
        actor = actor_box.setdefault("a", FakeReplica())
        client = actor_box.setdefault("c", BatchedGenerateClient(actor))
        return await client.generate("one", [1], {"max_tokens": 1}), client.client_id

    out, first_id = asyncio.run(first())
    assert out == ("one", [1], 1)

    async def second():
        actor, client = actor_box["a"], actor_box["c"]
        # The fake's stream lived on the first loop: give the actor a fresh one.
        actor.stream = GenerateStream(actor.fake_generate)
        return await client.generate("two", [2], {"max_tokens": 2}), client.client_id

    out, second_id = asyncio.run(second())
    assert out == ("two", [2], 2)
    assert second_id != first_id
    assert "close_generate" in actor_box["a"].messages


async def test_close_ends_the_actor_side_stream():
    actor = FakeReplica()
    client = BatchedGenerateClient(actor)
    await client.generate("one", [1], {"max_tokens": 1})
    assert actor.stream.clients == 1
    await client.close()
    assert actor.stream.clients == 0


async def test_groups_and_single_calls_share_one_message():
    actor = FakeReplica()
    client = BatchedGenerateClient(actor)
    single, group, other = await asyncio.gather(
        client.generate("one", [1], {"max_tokens": 1}),
        client.generate_group("g", [2], {"max_tokens": 3}, 4),
        client.generate_group("h", [3], {"max_tokens": 2}, 2),
    )
    assert single == ("one", [1], 1)
    assert group == [(f"g/{k}", 3) for k in range(4)]
    assert other == [("h/0", 2), ("h/1", 2)]
    assert actor.messages.count("submit_generate") == 1


async def test_a_group_call_to_a_replica_without_groups_fails_that_call_only():
    actor = FakeReplica()
    actor.stream = GenerateStream(actor.fake_generate)
    client = BatchedGenerateClient(actor)
    group, single = await asyncio.gather(
        client.generate_group("g", [2], {"max_tokens": 3}, 4),
        client.generate("one", [1], {"max_tokens": 1}),
        return_exceptions=True,
    )
    assert isinstance(group, TypeError) and "n=4" in str(group)
    assert single == ("one", [1], 1)
