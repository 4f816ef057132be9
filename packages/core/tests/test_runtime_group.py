"""The trainer worker group (`offbeat.core.runtime`): the token-balanced split and the
metric merge (pure), then two gloo FSDP2 ranks on a local Ray: their update on a fixed
batch equals one rank's, their log-probs come back in order, their DCP checkpoint loads
into one rank, and a weight sync from rank 0 delivers exactly the group's weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from trainer_fakes import FakeServer

from offbeat.core.config.run import RunConfig
from offbeat.core.models import build_tiny_model
from offbeat.core.runtime import merge_rank_metrics, split_by_tokens

VOCAB = 260


def test_split_balances_tokens_not_rows():
    tokens = [40, 5, 5, 5, 5, 5, 5, 5, 5, 10]
    parts = split_by_tokens(tokens, 2)
    load = [sum(tokens[i] for i in p) for p in parts]
    assert load == [45, 45]  # five rows each would be 60 against 30 tokens
    assert len(parts[0]) == 2 and 0 in parts[0]  # the long row and one short one
    assert sorted(parts[0] + parts[1]) == list(range(10))
    assert all(p == sorted(p) for p in parts)  # each rank's rows in batch order


def test_split_gives_every_rank_a_row_and_refuses_too_few_rows():
    assert split_by_tokens([100, 1, 1], 3) == [[0], [1], [2]]
    assert all(split_by_tokens([1] * 7, 4))
    with pytest.raises(ValueError, match="3 rows cannot give each of 4 trainer ranks a row"):
        split_by_tokens([1, 2, 3], 4)


def test_rank_metrics_merge_rank_local_ones_and_keep_reduced_ones():
    got = merge_rank_metrics(
        [
            {"actor/loss": 0.5, "actor/max_memory_gb": 1.0, "actor/num_tokens": 40.0},
            {"actor/loss": 0.5, "actor/max_memory_gb": 3.0, "actor/num_tokens": 40.0},
        ]
    )
    assert got == {"actor/loss": 0.5, "actor/max_memory_gb": 3.0, "actor/num_tokens": 40.0}


# ---- two gloo ranks on a local Ray ---------------------------------------------------------
def make_batch(rows: int = 8, prompt: int = 6, response: int = 7, seed: int = 21) -> dict:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (rows, prompt + response), generator=g)
    attention_mask = torch.ones(rows, prompt + response, dtype=torch.long)
    response_mask = torch.zeros(rows, response)
    for i in range(rows):
        p_len = int(torch.randint(1, prompt + 1, (1,), generator=g))
        r_len = int(torch.randint(1, response + 1, (1,), generator=g))
        attention_mask[i, : prompt - p_len] = 0
        attention_mask[i, prompt + r_len :] = 0
        response_mask[i, :r_len] = 1
    return {
        "input_ids": input_ids * attention_mask,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, response) * response_mask,
    }


def job(model_dir: Path, ranks: int) -> RunConfig:
    cfg = RunConfig()
    cfg.model.path = str(model_dir)
    cfg.resources.trainer_devices, cfg.resources.devices_per_node = ranks, ranks + 1
    cfg.actor.ppo_micro_batch_size_per_device = 3  # the ranks run different micro counts
    cfg.actor.lr = 1e-3
    cfg.runtime.trainer_cpus = []
    return cfg


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny"), hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        initializer_range=0.1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def ray_local(ray_session):
    return ray_session.up()


def on_every_rank(group, fn) -> list:
    """fn(rank) run on every rank at once (collectives need them all); the results."""
    import sys

    import ray

    # The ranks cannot import this test module: send `fn` by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[fn.__module__])

    return ray.get([h.__ray_call__.remote(fn) for h in group.handles])


def weights(rank) -> dict:
    return {n: t.clone() for n, t in rank.engine.export_weights()}


def grads(rank) -> dict:
    return {n: p.grad.full_tensor() for n, p in rank.engine.model.named_parameters()}


@pytest.mark.ray
@pytest.mark.slow
def test_two_ranks_update_equals_one_rank_and_sync_from_rank0(ray_local, model_dir, tmp_path):
    import torch.distributed as dist

    from offbeat.core.registry import TRAIN_ENGINES
    from offbeat.core.runtime import GroupCheckpointEngine, start_pools, start_trainer

    existed = dist.is_initialized()
    one = TRAIN_ENGINES.get("fsdp2").from_job_config(job(model_dir, 1))  # in this process
    batch = make_batch()

    async def run():
        cfg = job(model_dir, 2)
        pools = await start_pools(cfg, rollout=False)
        side = await start_trainer(cfg, pools)
        group = side.engine
        try:
            assert side.group is group and group.dp_size == 2
            assert isinstance(side.manager, GroupCheckpointEngine)
            want_lp = one.compute_log_probs(batch)
            got_lp = await group.compute_log_probs(batch)
            data = {**batch, "old_log_probs": want_lp, "rollout_log_probs": want_lp}
            want = one.update(data)
            got = await group.update(data)
            group_weights = on_every_rank(group, weights)[0]
            group_grads = on_every_rank(group, grads)[0]
            await asyncio.to_thread(group.save, str(tmp_path / "ckpt"))
            server = FakeServer("s0")
            result = await side.manager.sync(group.export_weights, 1, targets={"s0": server})
            return got_lp, want_lp, got, want, group_weights, group_grads, server, result
        finally:
            await side.close()
            pools.remove()

    got_lp, want_lp, got, want, group_weights, group_grads, server, result = asyncio.run(run())
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=1e-5)  # rows back in order
    assert got["actor/loss"] == pytest.approx(want["actor/loss"], rel=1e-5)
    assert got["actor/num_tokens"] == want["actor/num_tokens"]
    one_weights = {n: t.clone() for n, t in one.export_weights()}
    assert sorted(group_weights) == sorted(one_weights)
    one_grads = {n: p.grad.full_tensor() for n, p in one.model.named_parameters()}
    for name, w in one_weights.items():
        g = one_grads[name]
        scale = float(g.abs().max()) or 1.0
        torch.testing.assert_close(group_grads[name], g, atol=1e-5 * scale, rtol=1e-4, msg=name)
        # AdamW's first step is lr * sign(grad) where the gradient is not ~0: same weights
        # to rounding; a gradient that is ~0 may round to either sign (at most 2 lr apart).
        close = (group_weights[name] - w).abs() <= 1e-6
        assert bool(((group_weights[name] - w).abs() <= 2e-3 + 1e-6).all()), name
        assert float(close.float().mean()) > 0.99, name
    # the sync: rank 0 sent every parameter, nothing crossed the driver but specs
    assert result.ok and result.version == 1 and server.weight_version == 1
    assert sorted(server.weights) == sorted(group_weights)
    for name, w in group_weights.items():
        assert torch.equal(server.weights[name], w), name
    # the group's DCP checkpoint loads into one rank
    one.load(str(tmp_path / "ckpt"))
    assert one.global_update_count == 1
    for name, t in one.export_weights():
        assert torch.equal(t, group_weights[name]), name
    if not existed and dist.is_initialized():
        dist.destroy_process_group()
