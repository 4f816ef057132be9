"""The PD replica's routing and lifecycle against recording engines (no vLLM engine, no
Ray): prefill then decode, KV folders held and removed, one prefill per prompt prefix,
aborts in either phase, every engine reached by control calls and weight syncs; the
connector's folder naming against vLLM's own."""

from __future__ import annotations

import asyncio
import os

import pytest

from offbeat.ckpt_engine import CheckpointEngineManager
from offbeat.ckpt_engine.target import ReceiveSpec
from offbeat.core.rollout.protocol import TokenOutput
from offbeat.rollout_vllm.pd import PDRolloutServer, SharedStorage, pd_engine_kwargs


class RecordingEngine:
    """Records every call; `generate` writes the prompt's KV folder when it is a P engine
    (as the connector does) and checks the folder is there when it is a D engine."""

    def __init__(self, name: str, storage: SharedStorage, role: str) -> None:
        self.name, self.storage, self.role = name, storage, role
        self.calls: list[tuple] = []
        self.weight_version = 0
        self.paused = False
        self.gate = asyncio.Event()
        self.gate.set()
        self.abort_next = False
        self.saw_folder: list[bool] = []

    async def generate(self, request_id, prompt_ids, sampling_params):
        self.calls.append(("generate", request_id, len(prompt_ids), dict(sampling_params)))
        await self.gate.wait()
        folder = self.storage.folder(prompt_ids)
        if self.abort_next:
            self.abort_next = False
            return TokenOutput(
                [], [], "aborted", self.weight_version, extra={"server_id": self.name}
            )
        if self.role == "prefill":
            os.makedirs(folder, exist_ok=True)
            open(os.path.join(folder, "layer0.safetensors"), "w").close()
            return TokenOutput(
                [7], [-0.1], "length", self.weight_version, extra={"server_id": self.name}
            )
        self.saw_folder.append(folder is not None and os.path.isdir(folder))
        n = sampling_params["max_tokens"]
        return TokenOutput(
            list(range(n)),
            [-1.0] * n,
            "length",
            self.weight_version,
            extra={"server_id": self.name},
        )

    async def generate_group(self, request_id, prompt_ids, sampling_params, n):
        self.calls.append(("generate_group", request_id, n))
        return [
            await self.generate(f"{request_id}-{i}", prompt_ids, sampling_params) for i in range(n)
        ]

    async def abort_all(self):
        self.calls.append(("abort_all",))
        self.paused = True

    async def resume(self):
        self.calls.append(("resume",))
        self.paused = False

    async def release_kv_cache(self):
        self.calls.append(("release_kv_cache",))
        return True

    async def resume_kv_cache(self):
        self.calls.append(("resume_kv_cache",))
        return True

    async def sleep(self, level=1):
        self.calls.append(("sleep", level))

    async def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    async def update_weights(self, spec):
        self.calls.append(("update_weights", spec.rank))
        self.weight_version = spec.version
        return spec.version

    def status(self):
        return {"server_id": self.name, "paused": self.paused}


@pytest.fixture
def storage(tmp_path):
    path = tmp_path / "kv"
    path.mkdir()
    return SharedStorage(str(path))


@pytest.fixture
def replica(storage):
    p = RecordingEngine("p0", storage, "prefill")
    d = RecordingEngine("d0", storage, "decode")
    return PDRolloutServer([p], [d], storage, server_id="pd"), p, d


LONG = list(range(3, 43))  # 40 tokens: a 32-token folder


async def test_prefill_then_decode_with_the_kv_there_then_removed(replica, storage):
    pd, p, d = replica
    out = await pd.generate("r", LONG, {"max_tokens": 5, "temperature": 0.0})
    assert p.calls == [("generate", "r-p", 40, {"max_tokens": 1, "temperature": 0.0})]
    assert d.calls == [("generate", "r", 40, {"max_tokens": 5, "temperature": 0.0})]
    assert d.saw_folder == [True]
    assert out.token_ids == [0, 1, 2, 3, 4] and out.extra == {"server_id": "pd", "engine_id": "d0"}
    await pd.storage_settled()
    assert os.listdir(storage.path) == []


async def test_a_short_prompt_goes_to_the_decode_engine_alone(replica):
    pd, p, d = replica
    await pd.generate("s", [5] * 16, {"max_tokens": 2})  # no whole block before the last token
    assert p.calls == [] and len(d.calls) == 1 and pd.stats["no_transfer"] == 1


async def test_one_prefill_serves_every_request_of_a_prefix(replica, storage):
    pd, p, d = replica
    p.gate.clear()
    tasks = [asyncio.create_task(pd.generate(f"g{i}", LONG, {"max_tokens": 3})) for i in range(4)]
    await asyncio.sleep(0.01)
    assert len(p.calls) == 1  # the others wait on that prefill
    p.gate.set()
    outs = await asyncio.gather(*tasks)
    assert all(o.token_ids == [0, 1, 2] for o in outs) and d.saw_folder == [True] * 4
    assert pd.stats["prefills"] == 1 and pd.stats["prefills_shared"] == 3
    await pd.storage_settled()
    assert os.listdir(storage.path) == []
    await pd.generate("again", LONG, {"max_tokens": 1})  # released: prefills again
    assert len(p.calls) == 2


async def test_an_abort_during_prefill_returns_aborted_without_tokens(replica):
    pd, p, d = replica
    p.abort_next = True
    out = await pd.generate("a", LONG, {"max_tokens": 5})
    assert out.stop_reason == "aborted" and out.token_ids == [] and d.calls == []
    assert pd.stats["aborted_in_prefill"] == 1
    out = await pd.generate("a", LONG, {"max_tokens": 5})  # the resend prefills again
    assert out.stop_reason == "length" and len(p.calls) == 2


async def test_requests_waiting_on_an_aborted_prefill_are_aborted_too(replica):
    pd, p, d = replica
    p.gate.clear()
    p.abort_next = True
    tasks = [asyncio.create_task(pd.generate(f"w{i}", LONG, {"max_tokens": 3})) for i in range(3)]
    await asyncio.sleep(0.01)
    p.gate.set()
    outs = await asyncio.gather(*tasks)
    assert [o.stop_reason for o in outs] == ["aborted"] * 3 and d.calls == []


async def test_group_prefills_once_and_decodes_on_one_engine(replica):
    pd, p, d = replica
    outs = await pd.generate_group("grp", LONG, {"max_tokens": 2}, 3)
    assert len(p.calls) == 1 and d.calls[0] == ("generate_group", "grp", 3)
    assert [o.extra["server_id"] for o in outs] == ["pd"] * 3


async def test_requests_spread_over_decode_engines(storage):
    p = RecordingEngine("p0", storage, "prefill")
    ds = [RecordingEngine(f"d{i}", storage, "decode") for i in range(2)]
    pd = PDRolloutServer([p], ds, storage)
    for d in ds:
        d.gate.clear()
    prompts = [[i + 3] * 40 for i in range(4)]
    tasks = [
        asyncio.create_task(pd.generate(f"x{i}", pr, {"max_tokens": 1}))
        for i, pr in enumerate(prompts)
    ]
    await asyncio.sleep(0.01)
    assert [len(d.calls) for d in ds] == [2, 2]
    for d in ds:
        d.gate.set()
    await asyncio.gather(*tasks)


async def test_control_calls_reach_every_engine(replica):
    pd, p, d = replica
    await pd.abort_all()
    await pd.release_kv_cache()
    await pd.resume_kv_cache()
    await pd.sleep(2)
    await pd.wake_up(["weights"])
    await pd.resume()
    expected = [
        ("abort_all",), ("release_kv_cache",), ("resume_kv_cache",), ("sleep", 2),
        ("wake_up", ["weights"]), ("resume",),
    ]  # fmt: skip
    assert p.calls == expected and d.calls == expected
    status = await pd.status()
    assert [s["server_id"] for s in status["prefill"] + status["decode"]] == ["p0", "d0"]


async def test_weight_update_reaches_every_engine_and_drops_stored_kv(replica, storage):
    pd, p, d = replica
    os.makedirs(os.path.join(storage.path, "stale"))
    specs = [ReceiveSpec("shm", 3, rank=r) for r in (4, 5)]
    assert pd.sync_receivers == 2
    assert await pd.update_weights_ranks(specs) == 3
    assert p.calls == [("update_weights", 4)] and d.calls == [("update_weights", 5)]
    assert pd.weight_version == 3 and os.listdir(storage.path) == []
    with pytest.raises(RuntimeError, match="receivers"):
        await pd.update_weights(ReceiveSpec("shm", 4))


async def test_a_sync_is_incomplete_until_every_engine_holds_the_version(replica):
    pd, _p, d = replica

    async def stale(spec):
        return spec.version - 1

    d.update_weights = stale
    with pytest.raises(RuntimeError, match="engines reported"):
        await pd.update_weights_ranks(
            [ReceiveSpec("shm", 2, rank=0), ReceiveSpec("shm", 2, rank=1)]
        )
    with pytest.raises(RuntimeError, match="not serving"):
        await pd.generate("after", LONG, {"max_tokens": 1})


async def test_the_manager_gives_a_pd_replica_one_rank_per_engine(replica, storage):
    """A real sync (the `naive` backend, in process) to a PD replica beside a plain one:
    three receivers, every engine on the new version."""
    import torch

    pd, p, d = replica
    plain = RecordingEngine("plain", storage, "decode")
    manager = CheckpointEngineManager("naive", phase_timeout_s=10)
    try:
        got = {}

        async def receive(engine, spec):
            from offbeat.ckpt_engine import receive as receive_sync

            loaded: list[str] = []
            await asyncio.to_thread(
                receive_sync, spec, lambda ts: loaded.extend(n for n, _ in ts), 0
            )
            got[engine.name] = (spec.rank, loaded)
            engine.weight_version = spec.version
            return spec.version

        for e in (p, d, plain):
            e.update_weights = lambda spec, e=e: receive(e, spec)
        result = await manager.sync([("w", torch.zeros(4))], 1, {"a": plain, "pd": pd})
    finally:
        manager.close()
    assert result.ok, result.failed
    assert sorted(r for r, _ in got.values()) == [0, 1, 2]
    assert all(loaded == ["w"] for _, loaded in got.values())
    assert pd.weight_version == plain.weight_version == 1


def test_engine_kwargs_by_role():
    p = pd_engine_kwargs({"max_model_len": 512, "dtype": "bfloat16"}, "prefill", "/kv")
    d = pd_engine_kwargs({"max_model_len": 512}, "decode", "/kv")
    assert p["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert d["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert p["enable_chunked_prefill"] is False and p["max_num_batched_tokens"] >= 512
    assert "enable_chunked_prefill" not in d
    assert d["kv_transfer_config"]["kv_connector_extra_config"] == {"shared_storage_path": "/kv"}
    with pytest.raises(ValueError, match=r"rollout\.pd\.connector='nixl'"):
        pd_engine_kwargs({}, "decode", "/kv", connector="nixl")


def test_folder_naming_is_the_connectors(tmp_path):
    """SharedStorage names a prompt's folder as vLLM's example connector does (fails when
    the upstream naming moves)."""
    import torch

    example = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.example_connector")
    conn = object.__new__(example.ExampleConnector)
    conn._storage_path = str(tmp_path)
    storage = SharedStorage(str(tmp_path), block_size=16)
    for n in (17, 33, 49, 200):
        prompt = list(range(100, 100 + n))
        tokens = example.align_to_block_size(n, 16)  # what the connector stores and loads
        theirs = conn._generate_foldername_debug(torch.tensor(prompt)[:tokens], [], False)
        assert storage.folder(prompt) == theirs
    assert storage.folder(list(range(16))) is None


def test_the_connector_subclass_imports():
    from offbeat.rollout_vllm._kv_connector import OffbeatSharedStorageConnector

    assert OffbeatSharedStorageConnector.__mro__[1].__name__ == "ExampleConnector"


PD_ONE_GPU = [
    "resources.device=cuda",
    "resources.devices_per_node=2",
    "resources.trainer_devices=1",
    "resources.rollout_devices=1",
    "runtime.share_trainer_gpu=true",
    "runtime.rollout_num_gpus=1",
    "runtime.rollout_num_cpus=2",
    "runtime.ray_num_cpus=8",
    "runtime.trainer_cpus=[]",
    "runtime.rollout_cpus=[]",
    "rollout.pd.enabled=true",
    "rollout.pd.share_device=true",
    "rollout.engine_kwargs.gpu_memory_utilization=0.15",
]


def pd_job(tmp_path, extra=()):
    from offbeat.core.config import load_config
    from offbeat.core.config.run import RunConfig

    return load_config(
        None,
        [
            "model.path=m",
            *PD_ONE_GPU,
            f"rollout.pd.storage_path={tmp_path}",
            f"trainer.log_dir={tmp_path}",
            *extra,
        ],
        schema=RunConfig,
    )


def test_the_vllm_factory_builds_a_pd_replica_of_one_actor_per_engine(tmp_path, monkeypatch):
    """`rollout.pd.enabled` turns the `vllm` factory's replica into P + D actors sharing
    the replica's device, each with its connector role, behind one PDRolloutServer."""
    import offbeat.rollout_vllm.actor as actor
    from offbeat.core.rollout.replica_spec import ReplicaSpec
    from offbeat.rollout_vllm.replica import vllm_replica

    started = []

    def fake_actor(config, *, cpus=None, **options):
        started.append((config, options))
        return object()

    monkeypatch.setattr(actor, "vllm_server_actor", fake_actor)
    pd = vllm_replica(ReplicaSpec(pd_job(tmp_path), "/models/m", 0))
    assert isinstance(pd, PDRolloutServer) and pd.server_id == "rollout-0"
    assert [c["server_id"] for c, _ in started] == ["rollout-0-p0", "rollout-0-d0"]
    roles = [c["engine_kwargs"]["kv_transfer_config"]["kv_role"] for c, _ in started]
    assert roles == ["kv_producer", "kv_consumer"]
    assert all(o["num_gpus"] == 0.5 for _, o in started)
    assert pd.storage.path == str(tmp_path / "rollout-0")
    path = started[0][0]["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]
    assert path == {"shared_storage_path": str(tmp_path / "rollout-0")}


def test_offbeat_check_validates_rollout_pd_against_the_devices(tmp_path, monkeypatch):
    import torch

    from offbeat.core.config import ConfigError, validate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the config, not this machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)

    validate(pd_job(tmp_path))  # one GPU shared by P and D: fine
    cases = {
        "rollout.pd.share_device=false": "resources.rollout_devices",  # 1 device, 2 engines
        "rollout.engine_kwargs.gpu_memory_utilization=0.6": "gpu_memory_utilization",
        "rollout.pd.connector=nixl": "rollout.pd.connector",
        "rollout.pd.decode_engines=0": "rollout.pd.decode_engines",
        "resources.device=cpu": "resources.device",
    }
    for override, key in cases.items():
        with pytest.raises(ConfigError) as e:
            validate(pd_job(tmp_path, [override]))
        assert key in str(e.value), (override, str(e.value))
    ok = pd_job(
        tmp_path,
        ["rollout.pd.share_device=false", "resources.devices_per_node=3",
         "resources.rollout_devices=2"],
    )  # fmt: skip
    validate(ok)
    from offbeat.core.config.support import replica_devices

    assert replica_devices(ok.rollout) == 2
