"""The replica as a recipe gets it: `SGLangRolloutServer` inside a Ray actor, seen through
core's shared proxy (`sglang_proxy`), against the shared SGLang app (attached by URL: the launch itself is
covered by the shared app start)."""

from __future__ import annotations

import pytest

from offbeat.ckpt_engine.target import ReceiveSpec
from offbeat.rollout_sglang import SGLangServerConfig, sglang_proxy, sglang_server_actor

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
    proxy = sglang_proxy(handle, weight_version=0)
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


async def test_the_engine_factory_launches_a_replica_as_the_job_does(
    tmp_path, monkeypatch, ray_session
):
    """`rollout.engine=sglang` as the job starts it: a `ReplicaSpec` through the registry,
    core's shared actor, SGLang's launch command (`<python> -m sglang.launch_server` with
    the job's flags, here a python that serves the test engine behind SGLang's real HTTP
    layer), the replica's log file, then a batched generate through the shared proxy."""
    import dataclasses
    import sys
    from pathlib import Path

    from offbeat.core.cli import load_recipe_config
    from offbeat.core.rollout.replica_spec import ReplicaSpec, start_replica
    from offbeat.rollout_sglang.replica import SGLANG_PYTHON

    ray = ray_session.up()
    server = Path(__file__).with_name("sglang_test_server.py")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {server} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv(SGLANG_PYTHON, str(python))
    nulls = [f"rollout.engine_kwargs.{k}=null" for k in ("max_model_len", "enforce_eager", "seed")]
    _, cfg = load_recipe_config(
        "separate_async",
        ["rollout.engine=sglang", f"trainer.log_dir={tmp_path}", "runtime.rollout_cpus=[]",
         "rollout.engine_kwargs.max_num_seqs=null", *nulls],
    )  # fmt: skip
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, rollout_num_cpus=0))
    proxy = start_replica(ReplicaSpec(cfg, "offbeat/test-model", 0, server_id="sglang-job-0"))
    try:
        assert await proxy.refresh() == 0  # /health answered through the actor
        out = await proxy.generate("j", [4, 5], {"max_tokens": 2})
        assert out.token_ids == [(9 + 31 * i) % 1000 for i in range(2)]
        assert out.extra["server_id"] == "sglang-job-0"
        status = await proxy.status()
        assert status["log"].endswith("sglang-job-0.server.log")
        assert proxy.generate_group is None  # SGLang's server has no group call
    finally:
        await proxy.handle.shutdown.remote()
        ray.kill(proxy.handle)
