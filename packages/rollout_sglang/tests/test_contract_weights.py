"""Weight updates and memory control through SGLang's real HTTP layer: the endpoints, their
order, SGLang's own parsing of each body, and what a failure leaves behind."""

from __future__ import annotations

import base64

import pytest

from offbeat.ckpt_engine.target import ReceiveSpec
from offbeat.rollout_sglang import SGLangHTTPError, SGLangRolloutServer, SGLangServerConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NCCL = {
    "master_address": "10.0.0.1",
    "master_port": 29555,
    "world_size": 3,
    "names": ["model.embed_tokens.weight", "lm_head.weight"],
    "dtypes": ["torch.bfloat16", "bfloat16"],
    "shapes": [[1000, 64], [1000, 64]],
}
SESSION = ["begin_weight_update", "end_weight_update"]


async def test_nccl_update_joins_the_group_once_and_runs_inside_a_session(server, control):
    await server.abort_all()
    assert await server.update_weights(ReceiveSpec("broadcast", 1, NCCL, rank=1)) == 1
    assert await server.update_weights(ReceiveSpec("broadcast", 2, NCCL, rank=1)) == 2
    calls = await control.calls(
        "init_weights_update_group", "update_weights_from_distributed", *SESSION
    )
    assert [c["call"] for c in calls] == [
        "init_weights_update_group",
        "begin_weight_update",
        "update_weights_from_distributed",
        "end_weight_update",
        "begin_weight_update",
        "update_weights_from_distributed",
        "end_weight_update",
    ]
    init = calls[0]
    assert (init["master_address"], init["master_port"]) == ("10.0.0.1", 29555)
    assert (init["rank_offset"], init["world_size"]) == (2, 3)
    update = calls[2]
    assert update["names"] == NCCL["names"]
    assert update["dtypes"] == ["bfloat16", "bfloat16"] and update["shapes"] == NCCL["shapes"]
    assert [c["weight_version"] for c in calls if "weight_version" in c] == ["1", "2"]
    assert server.weight_version == 2 and (await control.state())["version"] == 2
    await server.resume()
    out = await server.generate("after", [5], {"max_tokens": 2})
    assert out.weight_version == out.min_weight_version == 2


async def test_cuda_ipc_update_sends_the_serialized_tensors(server, control):
    blob = base64.b64encode(b"handles of rank 0").decode()
    await server.abort_all()
    await server.update_weights(ReceiveSpec("cuda_ipc", 1, {"serialized_named_tensors": [blob]}))
    calls = await control.calls("update_weights_from_tensor", *SESSION)
    assert [c["call"] for c in calls] == [
        "begin_weight_update",
        "update_weights_from_tensor",
        "end_weight_update",
    ]
    assert calls[1]["serialized"] == ["handles of rank 0"]  # SGLang decoded the base64


async def test_disk_update_needs_no_session(server, control):
    await server.abort_all()
    await server.update_weights(ReceiveSpec("disk", 3, {"model_path": "/ckpt/step-3"}))
    [call] = await control.calls("update_weights_from_disk", *SESSION)
    assert call == {
        "call": "update_weights_from_disk",
        "weight_version": "3",
        "model_path": "/ckpt/step-3",
    }
    assert server.weight_version == 3


async def test_without_a_session_sglang_0_5_21_refuses_and_the_server_stops_serving(
    sglang_app, control
):
    old = SGLangRolloutServer(
        SGLangServerConfig(model="m", url=sglang_app.url, weight_update_session=False)
    )
    try:
        await old.abort_all()
        with pytest.raises(SGLangHTTPError) as e:
            await old.update_weights(ReceiveSpec("cuda_ipc", 1, {"serialized_named_tensors": []}))
        assert e.value.endpoint == "/update_weights_from_tensor" and e.value.status == 400
        assert "outside /begin_weight_update" in str(e.value)
        assert old.weight_version == 0
        await old.resume()
        with pytest.raises(RuntimeError, match="not serving: weight update to version 1 failed"):
            await old.generate("x", [1], {"max_tokens": 1})
    finally:
        await old.aclose()


async def test_a_failed_update_refuses_generation_until_one_succeeds(server, control):
    await control.script(fail={"update_weights_from_distributed": {"message": "NCCL timeout"}})
    await server.abort_all()
    with pytest.raises(
        SGLangHTTPError, match=r"/update_weights_from_distributed: HTTP 400: NCCL timeout"
    ):
        await server.update_weights(ReceiveSpec("broadcast", 1, NCCL))
    # The session was opened; the update failed; nothing closed it from this side.
    assert [c["call"] for c in await control.calls(*SESSION)] == ["begin_weight_update"]
    assert server.weight_version == 0
    await server.resume()
    with pytest.raises(RuntimeError, match="not serving"):
        await server.generate("x", [1], {"max_tokens": 1})
    await server.abort_all()
    assert await server.update_weights(ReceiveSpec("broadcast", 1, NCCL)) == 1
    await server.resume()
    assert (await server.generate("y", [1], {"max_tokens": 1})).weight_version == 1


async def test_update_rules_before_any_call(server, control):
    with pytest.raises(RuntimeError, match="needs the server paused"):
        await server.update_weights(ReceiveSpec("disk", 1, {"model_path": "/x"}))
    await server.abort_all()
    with pytest.raises(ValueError, match="backend 'shm' cannot reach an SGLang server"):
        await server.update_weights(ReceiveSpec("shm", 1, {}))
    await server.update_weights(ReceiveSpec("disk", 2, {"model_path": "/x"}))
    with pytest.raises(ValueError, match="refusing older version 1"):
        await server.update_weights(ReceiveSpec("disk", 1, {"model_path": "/x"}))
    assert not await control.calls("begin_weight_update")


async def test_memory_release_and_resume_use_tags(server, control):
    await server.release_kv_cache()
    assert (await control.state())["released"] == ["kv_cache"]
    await server.resume_kv_cache()
    await server.sleep()
    state = await control.state()
    assert state["released"] == ["kv_cache", "weights"] and state["paused"]
    await server.wake_up(["weights"])
    assert (await control.state())["released"] == ["kv_cache"]
    await server.wake_up()
    await server.resume()
    await server.flush_cache()
    calls = await control.calls(
        "release_memory_occupation", "resume_memory_occupation", "flush_cache"
    )
    assert [(c["call"], c.get("tags")) for c in calls] == [
        ("release_memory_occupation", ["kv_cache"]),
        ("resume_memory_occupation", ["kv_cache"]),
        ("release_memory_occupation", ["kv_cache", "weights"]),
        ("resume_memory_occupation", ["weights"]),
        ("resume_memory_occupation", ["weights", "kv_cache"]),
        ("flush_cache", None),
    ]
