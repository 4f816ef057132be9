"""RemoteRolloutServer turns an actor handle into the RolloutServer / SyncTarget protocols
(checked with a fake handle; the real Ray path runs in test_e2e_replica_actor.py and the
separate_async e2e test)."""

from __future__ import annotations

import asyncio

import pytest

from offbeat.ckpt_engine import ReceiveSpec, SyncTarget
from offbeat.core.rollout import GroupRolloutServer, RolloutServer, TokenOutput, supports_group
from offbeat.core.rollout._batching import GenerateStream
from offbeat.rollout_vllm import RemoteRolloutServer


class _Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def remote(self, *args):
        self.actor.calls.append((self.name, args))
        method = getattr(self.actor, "_" + self.name)
        if self.name == "generate_results":
            return method(*args)  # a stream of awaitables, as Ray's streaming generator
        return asyncio.ensure_future(method(*args))


async def _ready(value):
    return value


class FakeActor:
    """Stands in for `ray.remote(VLLMRolloutServer)` handles: `handle.m.remote(...)`."""

    def __init__(self):
        self.calls = []
        self.version = 3
        self.stream = GenerateStream(self._generate, self._generate_group)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    async def _submit_generate(self, client_id, calls):
        self.stream.submit(client_id, calls)

    async def _generate_results(self, client_id):
        async for items in self.stream.results(client_id):
            yield _ready(items)

    async def _generate(self, request_id, prompt_ids, params):
        return TokenOutput([1, 2], [-0.1, -0.2], "length", weight_version=self.version)

    async def _generate_group(self, request_id, prompt_ids, params, n):
        return [TokenOutput([k], [-0.1], "stop", weight_version=self.version + 1) for k in range(n)]

    async def _update_weights(self, spec):
        self.version = spec.version
        return spec.version

    async def _get_weight_version(self):
        return self.version

    async def _device_memory(self):
        return {"free_bytes": 5, "total_bytes": 8}

    async def _noop(self, *args):
        return None

    _abort_all = _resume = _release_kv_cache = _resume_kv_cache = _sleep = _wake_up = _noop


async def test_proxy_forwards_every_call_and_tracks_the_version():
    actor = FakeActor()
    proxy = RemoteRolloutServer(actor, weight_version=0)
    assert isinstance(proxy, RolloutServer) and isinstance(proxy, SyncTarget)
    assert await proxy.refresh() == 3 and proxy.weight_version == 3

    params = {"max_tokens": 2}
    out = await proxy.generate("r", [5], params)
    assert out.token_ids == [1, 2]
    await proxy.abort_all()
    await proxy.release_kv_cache()
    assert await proxy.update_weights(ReceiveSpec("shm", 7)) == 7
    assert proxy.weight_version == 7
    await proxy.resume_kv_cache()
    await proxy.resume()
    await proxy.sleep(2)
    await proxy.wake_up(["weights"])
    assert await proxy.device_memory() == {"free_bytes": 5, "total_bytes": 8}
    names = [name for name, _ in actor.calls]
    # generate travels batched: the result stream opens, then the batch of calls goes.
    assert names == [
        "get_weight_version",
        "generate_results",
        "submit_generate",
        "abort_all",
        "release_kv_cache",
        "update_weights",
        "resume_kv_cache",
        "resume",
        "sleep",
        "wake_up",
        "device_memory",
    ]
    (_client, calls) = actor.calls[2][1]
    assert [c[1:] for c in calls] == [("r", [5], {"max_tokens": 2})]
    assert actor.calls[8][1] == (2,) and actor.calls[9][1] == (["weights"],)


async def test_unbatched_proxy_makes_one_call_per_generate():
    actor = FakeActor()
    proxy = RemoteRolloutServer(actor, weight_version=0, batched=False)
    outs = await asyncio.gather(
        *(proxy.generate(f"r{i}", [5], {"max_tokens": 2}) for i in range(3))
    )
    assert [o.token_ids for o in outs] == [[1, 2]] * 3
    assert [name for name, _ in actor.calls] == ["generate"] * 3
    assert proxy.weight_version == 3


async def test_kv_cache_calls_stop_once_the_replica_says_they_do_nothing():
    actor = FakeActor()

    async def no_sleep_mode(*args):
        return False

    actor._release_kv_cache = actor._resume_kv_cache = no_sleep_mode
    proxy = RemoteRolloutServer(actor, weight_version=0)
    for _ in range(3):
        await proxy.release_kv_cache()
        await proxy.resume_kv_cache()
    assert [name for name, _ in actor.calls] == ["release_kv_cache"]


@pytest.mark.parametrize("batched", [True, False])
async def test_proxy_forwards_a_group_and_keeps_its_version(batched):
    actor = FakeActor()
    proxy = RemoteRolloutServer(actor, weight_version=0, batched=batched)
    assert isinstance(proxy, GroupRolloutServer) and supports_group(proxy)
    params = {"max_tokens": 2}
    outs = await proxy.generate_group("g", [5], params, 3)
    assert [o.token_ids for o in outs] == [[0], [1], [2]]
    if batched:  # one call carrying n, on the batched path
        assert [name for name, _ in actor.calls] == ["generate_results", "submit_generate"]
        (_client, calls) = actor.calls[1][1]
        assert [c[1:] for c in calls] == [("g", [5], {"max_tokens": 2}, 3)]
        sent = calls[0][3]
    else:
        assert actor.calls == [("generate_group", ("g", [5], {"max_tokens": 2}, 3))]
        sent = actor.calls[0][1][2]
    assert sent == params and sent is not params  # the actor gets its own copy
    assert proxy.weight_version == 4


async def test_weight_version_never_asks_the_actor(monkeypatch):
    import ray

    def no_blocking_get(*args, **kwargs):
        raise AssertionError("ray.get blocks the event loop")

    monkeypatch.setattr(ray, "get", no_blocking_get)
    actor = FakeActor()
    unknown = RemoteRolloutServer(actor)
    assert unknown.weight_version is None  # not known yet, and not asked for
    started = RemoteRolloutServer(actor, weight_version=0)
    assert started.weight_version == 0
    assert actor.calls == []
    assert await unknown.refresh() == 3 and unknown.weight_version == 3
    assert [name for name, _ in actor.calls] == ["get_weight_version"]
