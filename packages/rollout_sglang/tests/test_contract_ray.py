"""The replica as a recipe gets it: `SGLangRolloutServer` inside a Ray actor, seen through
`RemoteSGLangServer`, against the shared SGLang app (attached by URL: the launch itself is
covered by the shared app start)."""

from __future__ import annotations

import pytest

from offbeat.ckpt_engine.target import ReceiveSpec
from offbeat.rollout_sglang import RemoteSGLangServer, SGLangServerConfig, sglang_server_actor

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def handle(sglang_app, ray_session):
    ray = ray_session.up()
    h = sglang_server_actor(
        SGLangServerConfig(model="m", url=sglang_app.url, server_id="ray-0"), num_cpus=0
    )
    yield h
    ray.kill(h)


async def test_the_proxy_generates_pauses_and_updates_through_the_actor(handle, control):
    proxy = RemoteSGLangServer(handle, weight_version=0)
    out = await proxy.generate("r", [4, 5], {"max_tokens": 3})
    assert out.token_ids == [(9 + 31 * i) % 1000 for i in range(3)]
    assert out.extra["server_id"] == "ray-0"
    await proxy.abort_all()
    assert (await proxy.status())["paused"]
    assert await proxy.update_weights(ReceiveSpec("disk", 1, {"model_path": "/ckpt"})) == 1
    await proxy.resume()
    assert proxy.weight_version == 1 and await proxy.refresh() == 1
    out = await proxy.generate("r2", [4, 5], {"max_tokens": 1})
    assert out.token_ids == [(9 + 7) % 1000] and out.weight_version == 1
    names = [c["call"] for c in await control.calls()]
    assert names == [
        "generate",
        "pause_generation",
        "abort_request",
        "update_weights_from_disk",
        "continue_generation",
        "generate",
    ]
