"""The PD replica as the job starts it, on one CUDA GPU with real vLLM and Ray: the `vllm`
factory with `rollout.pd.enabled` (and `share_device`) starts a P actor and a D actor on
the one GPU behind one PDRolloutServer; a greedy request through it loads the P engine's
KV in the D engine and equals an in-process engine's answer. Skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from offbeat.core.models import build_tiny_model

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(400),
]


async def test_pd_replica_through_the_job_factory_on_ray(tmp_path):
    import ray

    from offbeat.core.config import load_config, validate
    from offbeat.core.config.run import RunConfig
    from offbeat.core.rollout.replica_spec import ReplicaSpec
    from offbeat.core.trainer.elastic import shutdown_replicas
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig
    from offbeat.rollout_vllm.pd import PDRolloutServer
    from offbeat.rollout_vllm.replica import engine_kwargs_of, vllm_replica

    model = build_tiny_model(tmp_path / "tiny", "tiny", seed=0, dtype="bfloat16")
    cfg = load_config(
        None,
        [
            "resources.device=cuda", "resources.devices_per_node=2",
            "resources.trainer_devices=1", "resources.rollout_devices=1",
            "runtime.share_trainer_gpu=true", "runtime.rollout_num_gpus=1",
            "runtime.rollout_num_cpus=2", "runtime.ray_num_cpus=8",
            "runtime.trainer_cpus=[]", "runtime.rollout_cpus=[]",
            "rollout.pd.enabled=true", "rollout.pd.share_device=true",
            "rollout.engine_kwargs.gpu_memory_utilization=0.15",
            "rollout.engine_kwargs.enforce_eager=true", "rollout.engine_kwargs.max_model_len=1024",
            f"model.path={model}", "model.dtype=bfloat16", f"trainer.log_dir={tmp_path}",
            f"rollout.pd.storage_path={tmp_path / 'kv'}",
        ],
        schema=RunConfig,
    )  # fmt: skip
    from offbeat.rollout_vllm.replica import register

    register()  # also where the packages are on PYTHONPATH only (no entry points)
    validate(cfg)
    prompt = list(range(3, 103))
    greedy = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    local = VLLMRolloutServer(
        VLLMServerConfig(model=str(model), engine_kwargs=engine_kwargs_of(cfg), server_id="local")
    )
    try:
        ref = await local.generate("ref", prompt, greedy)
    finally:
        local.shutdown()
    ray.init(num_gpus=1, num_cpus=8, include_dashboard=False)
    pd = None
    try:
        pd = vllm_replica(ReplicaSpec(cfg, str(model), 0))
        assert isinstance(pd, PDRolloutServer) and len(pd.engines) == 2
        await pd.refresh()
        out = await pd.generate("r", prompt, greedy)
        print("through Ray:", out.extra, "tokens equal:", out.token_ids == ref.token_ids)
        assert out.extra["num_cached_tokens"] == 96 and out.extra["engine_id"] == "rollout-0-d0"
        assert out.token_ids == ref.token_ids
        await pd.abort_all()
        await pd.resume()
        assert (await pd.generate("r2", prompt, greedy)).token_ids == ref.token_ids
    finally:
        if pd is not None:
            await shutdown_replicas({f"e{i}": e for i, e in enumerate(pd.engines)})
        ray.shutdown()
