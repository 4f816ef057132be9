"""The critic and the reference policy on trainer worker groups, on a local Ray with gloo
FSDP2 ranks: on the actor's two ranks (`placement=actor`) and in a group of their own
(`placement=separate`), their values, ref log-probs and critic update equal those of a
one-process engine on the same weights, and the critic's DCP checkpoint, written across
the ranks, loads into one process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_runtime_group import job, make_batch

from offbeat.core.models import build_tiny_model

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


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


def ppo_job(model_dir: Path, ranks: int, *separate: str):
    cfg = job(model_dir, ranks)
    cfg.algorithm.adv_estimator = "gae"
    cfg.algorithm.use_kl_loss = True
    cfg.critic.ppo_micro_batch_size_per_device = 3  # the ranks run different micro counts
    cfg.critic.lr = 1e-3
    cfg.runtime.ray_num_cpus = 4
    for role in separate:
        (cfg.critic if role == "critic" else cfg.ref).placement = "separate"
        cfg.resources.devices_per_node += 1
    return cfg


async def drive(cfg, batch: dict, ckpt: Path) -> dict:
    """Start the trainer side of `cfg` on its pools and call its critic and reference as
    the training loop does (blocking calls in worker threads)."""
    from offbeat.core.runtime import start_pools, start_trainer

    pools = await start_pools(cfg, rollout=False)
    side = await start_trainer(cfg, pools)
    try:
        critic, reference = side.critic_engine, side.reference_engine
        out = {
            "roles": side.group.roles,
            "separate": {r: (g.roles, g.dp_size, g.pids) for r, g in side.separate.items()},
            "actor_pids": side.group.pids,
            "fingerprint": reference.weights_fingerprint(),
            "ref": await asyncio.to_thread(reference.compute_log_probs, batch, 1.0),
            "values0": await asyncio.to_thread(critic.compute_values, batch),
        }
        await asyncio.to_thread(critic.save, str(ckpt / "before"))
        mask = batch["response_mask"]
        data = {**batch, "values": out["values0"], "returns": out["values0"] + 0.5 * mask}
        out["data"] = data
        out["update"] = await asyncio.to_thread(critic.update, data)
        out["values1"] = await asyncio.to_thread(critic.compute_values, batch)
        await asyncio.to_thread(critic.save, str(ckpt / "after"))
        return out
    finally:
        await side.close()
        pools.remove()


def check_against_one_process(model_dir: Path, got: dict, batch: dict, ckpt: Path) -> None:
    from offbeat.core.train import build_critic_engine, build_reference_engine
    from offbeat.core.trainer.reference import weights_fingerprint

    one = ppo_job(model_dir, 1)
    # the reference: the same (frozen) weights, so the same log-probs, rows in batch order
    ref = build_reference_engine(one)
    torch.testing.assert_close(got["ref"], ref.compute_log_probs(batch, 1.0), atol=1e-5, rtol=1e-5)
    assert got["fingerprint"] == pytest.approx(weights_fingerprint(ref.export_weights()))
    # the critic: its value head is drawn at random; on the group's start weights (its
    # checkpoint) one process gives the group's values, and the same update
    torch.manual_seed(12345)  # this process's own draw, whatever ran before it here
    critic = build_critic_engine(one)
    assert not torch.allclose(critic.compute_values(batch), got["values0"])  # another head
    critic.load(str(ckpt / "before"))
    torch.testing.assert_close(critic.compute_values(batch), got["values0"], atol=1e-5, rtol=1e-5)
    want = critic.update(got["data"])
    assert got["update"]["critic/vf_loss"] == pytest.approx(want["critic/vf_loss"], rel=1e-5)
    assert got["update"]["critic/grad_norm"] == pytest.approx(want["critic/grad_norm"], rel=1e-4)
    assert got["update"]["critic/num_tokens"] == want["critic/num_tokens"]
    # the group's checkpoint after its update holds the updated critic
    after = build_critic_engine(one)
    after.load(str(ckpt / "after"))
    assert after.global_update_count == 1
    torch.testing.assert_close(after.compute_values(batch), got["values1"], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got["values1"], got["values0"])  # the update moved the values


def test_critic_and_reference_on_the_actors_two_ranks_equal_one_process(
    ray_local, model_dir, tmp_path
):
    import torch.distributed as dist

    existed = dist.is_initialized()
    batch = make_batch()
    got = asyncio.run(drive(ppo_job(model_dir, 2), batch, tmp_path))
    assert got["roles"] == ("actor", "critic", "reference") and got["separate"] == {}
    check_against_one_process(model_dir, got, batch, tmp_path)
    if not existed and dist.is_initialized():
        dist.destroy_process_group()


def test_critic_and_reference_in_groups_of_their_own(ray_local, model_dir, tmp_path):
    import torch.distributed as dist

    existed = dist.is_initialized()
    batch = make_batch()
    got = asyncio.run(drive(ppo_job(model_dir, 1, "critic", "reference"), batch, tmp_path))
    assert got["roles"] == ("actor",)  # the actor's rank holds neither
    assert {r: v[:2] for r, v in got["separate"].items()} == {
        "critic": (("critic",), 1),
        "reference": (("reference",), 1),
    }
    pids = [*got["actor_pids"], *(p for v in got["separate"].values() for p in v[2])]
    assert len(set(pids)) == 3  # three processes: the actor's, the critic's, the reference's
    check_against_one_process(model_dir, got, batch, tmp_path)
    if not existed and dist.is_initialized():
        dist.destroy_process_group()
