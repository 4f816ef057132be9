"""The critic and the reference policy on a trainer worker group, without Ray: fake rank
handles stand in for the `TrainerRank` actors. The group splits a batch across the ranks
by token count and puts the rows back in order; the engine-shaped proxies
(`GroupCriticEngine`, `GroupReferenceEngine`) block a worker thread on the group's event
loop; a failing rank fails the call naming it; `Reference` takes the ranks' fingerprint
instead of the weights; `TrainerRank` refuses roles it does not know or did not build."""

from __future__ import annotations

import asyncio

import pytest
import torch

from offbeat.core.config import AlgorithmConfig
from offbeat.core.runtime import (
    GroupCriticEngine,
    GroupReferenceEngine,
    TrainerGroup,
    TrainerRank,
    TrainerRankFailed,
    gather_rows,
    split_by_tokens,
)
from offbeat.core.trainer import Critic, Reference


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Nothing here may start Ray."""
    import ray

    def refuse(*a, **k):
        raise AssertionError("a unit test started Ray")

    monkeypatch.setattr(ray, "init", refuse)


class _Method:
    """`handle.method.remote(*args)`: a coroutine, as a Ray ref is awaitable."""

    def __init__(self, rank: FakeRank, name: str) -> None:
        self.rank, self.name = rank, name

    def remote(self, *args):
        async def call():
            await asyncio.sleep(0)
            return getattr(self.rank, "do_" + self.name)(*args)

        return call()


class FakeRank:
    """Values = 0.01 × token id, ref log-probs = -0.001 × token id / temperature (on the
    response positions): a row's answer depends on the row alone, so a row put back in
    the wrong place shows. Records every call with the rows it got."""

    def __init__(self, rank: int, fail: str = "") -> None:
        self.rank, self.fail = rank, fail
        self.calls: list[tuple[str, int]] = []
        self.saved: list[tuple[str, str]] = []

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def _check(self, what: str, shard: dict | None = None) -> None:
        self.calls.append((what, 0 if shard is None else int(shard["input_ids"].shape[0])))
        if self.fail == what:
            raise RuntimeError(f"rank {self.rank} broke in {what}")

    @staticmethod
    def _response(shard: dict) -> torch.Tensor:
        width = shard["response_mask"].shape[1]
        return shard["input_ids"][:, -width:].float() * shard["response_mask"]

    def do_compute_values(self, shard):
        self._check("compute_values", shard)
        return 0.01 * self._response(shard)

    def do_ref_log_probs(self, shard, temperature):
        self._check("ref_log_probs", shard)
        return -0.001 * self._response(shard) / temperature

    def do_update_critic(self, shard):
        self._check("update_critic", shard)
        return {
            "critic/vf_loss": 0.25,  # reduced over the ranks by the engine already
            "critic/max_memory_gb": 1.0 + self.rank,  # rank-local
            "critic/num_tokens": float(shard["response_mask"].sum()),
        }

    def do_save(self, path, role):
        self._check("save")
        self.saved.append(("save", f"{role}:{path}"))

    def do_load(self, path, role):
        self._check("load")
        self.saved.append(("load", f"{role}:{path}"))


def make_group(ranks: int, roles=("actor", "critic", "reference"), fail=(-1, "")):
    handles = [FakeRank(r, fail[1] if r == fail[0] else "") for r in range(ranks)]
    group = TrainerGroup(handles, kill_on_failure=False)
    group.roles = tuple(roles)
    group.reference_fingerprint = [3.0, 1.5, 2.25]
    return group, handles


def make_batch(rows: int = 7, prompt: int = 3, response: int = 5) -> dict:
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(1, 90, (rows, prompt + response), generator=g)
    response_mask = torch.zeros(rows, response)
    attention_mask = torch.ones(rows, prompt + response, dtype=torch.long)
    for i in range(rows):
        n = 1 + (i * 3) % response  # uneven lengths: the split is not by row count
        response_mask[i, :n] = 1
        attention_mask[i, prompt + n :] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
    }


async def in_thread(group: TrainerGroup, fn, *args):
    """`fn(*args)` in a worker thread, as the training loop calls the critic/reference,
    with the group's loop the running one."""
    group._loop = asyncio.get_running_loop()
    return await asyncio.to_thread(fn, *args)


# ---- rows back in order ---------------------------------------------------------------------
def test_gather_rows_puts_each_ranks_rows_back_in_batch_order():
    parts = [[0, 3], [1, 2, 4]]
    shards = [torch.tensor([[0.0], [3.0]]), torch.tensor([[1.0], [2.0], [4.0]])]
    assert gather_rows(parts, shards, 5).flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="do not cover a batch of 6 rows"):
        gather_rows(parts, shards, 6)
    with pytest.raises(ValueError, match="answered 1 rows for its 2"):
        gather_rows(parts, [shards[0][:1], shards[1]], 5)


@pytest.mark.parametrize("ranks", [2, 3])
def test_group_values_and_ref_log_probs_come_back_in_batch_order(ranks):
    group, handles = make_group(ranks)
    batch = make_batch()
    critic, reference = GroupCriticEngine(group), GroupReferenceEngine(group)

    async def run():
        values = await in_thread(group, critic.compute_values, batch)
        ref = await in_thread(group, reference.compute_log_probs, batch, 0.5)
        return values, ref

    values, ref = asyncio.run(run())
    whole = FakeRank(-1)
    torch.testing.assert_close(values, whole.do_compute_values(batch), atol=0, rtol=0)
    torch.testing.assert_close(ref, whole.do_ref_log_probs(batch, 0.5), atol=0, rtol=0)
    # every rank scored its token-balanced shard, not the whole batch
    tokens = batch["attention_mask"].sum(dim=1).tolist()
    want = [len(p) for p in split_by_tokens(tokens, ranks)]
    assert [h.calls[0] for h in handles] == [("compute_values", n) for n in want]
    assert sum(want) == 7 and max(want) < 7


def test_critic_update_merges_rank_metrics():
    group, handles = make_group(2)
    batch = make_batch(rows=4)

    async def run():
        return await in_thread(group, GroupCriticEngine(group).update, batch)

    metrics = asyncio.run(run())
    assert metrics["critic/vf_loss"] == 0.25
    assert metrics["critic/max_memory_gb"] == 2.0  # the largest rank's
    assert [c[0] for h in handles for c in h.calls] == ["update_critic"] * 2


def test_critic_save_and_load_go_to_every_ranks_critic():
    group, handles = make_group(2)
    critic = GroupCriticEngine(group)

    async def run():
        await in_thread(group, critic.save, "/ckpt/critic")
        await in_thread(group, critic.load, "/ckpt/critic")

    asyncio.run(run())
    for h in handles:
        assert h.saved == [("save", "critic:/ckpt/critic"), ("load", "critic:/ckpt/critic")]


def test_the_proxies_refuse_to_block_the_event_loop():
    group, _ = make_group(2)
    critic = GroupCriticEngine(group)

    async def run():
        group._loop = asyncio.get_running_loop()
        critic.compute_values(make_batch())

    with pytest.raises(RuntimeError, match="compute_values blocks: call it from a worker thread"):
        asyncio.run(run())


def test_a_rank_that_fails_in_a_critic_call_fails_it_naming_the_rank_and_step():
    group, _ = make_group(2, fail=(1, "compute_values"))
    group.begin_step(4)
    critic = Critic(GroupCriticEngine(group), gamma=1.0, lam=1.0)
    batch = make_batch(rows=4)
    rewards = torch.ones(4)

    async def run():
        await in_thread(
            group, critic.advantages, "gae", batch, rewards,
            rewards[:, None] * batch["response_mask"], ["a", "a", "b", "b"],
        )  # fmt: skip

    with pytest.raises(TrainerRankFailed, match="trainer rank 1 failed in compute_values during "
                       "global step 4: RuntimeError: rank 1 broke"):  # fmt: skip
        asyncio.run(run())
    assert group.failed is not None and group.failed.rank == 1


def test_the_proxies_need_the_roles_on_the_ranks():
    group, _ = make_group(2, roles=("actor",))
    with pytest.raises(ValueError, match="hold \\['actor'\\], no critic"):
        GroupCriticEngine(group)
    with pytest.raises(ValueError, match="no reference"):
        GroupReferenceEngine(group)


# ---- the training loop's objects on the proxies ---------------------------------------------
def test_reference_takes_the_ranks_fingerprint_never_the_weights():
    group, _ = make_group(2)
    engine = GroupReferenceEngine(group)
    reference = Reference(engine, AlgorithmConfig(use_kl_loss=True))
    assert reference.fingerprint == [3.0, 1.5, 2.25]
    with pytest.raises(TypeError, match="weights stay on its ranks"):
        iter(engine.export_weights()).__next__()
    # the checkpointed fingerprint is checked against the ranks' one
    reference.load_state({"fingerprint": [3.0, 1.5, 2.25], "kl_controller": None})
    with pytest.raises(ValueError, match="reference model's weights differ"):
        reference.load_state({"fingerprint": [3.0, 1.5, 9.0], "kl_controller": None})


def test_critic_gae_on_the_group_equals_gae_on_one_engine():
    """`Critic.advantages` on the group proxy gives what it gives on an engine that scores
    the whole batch in one place (the values come back in the right rows)."""

    class OneEngine:
        def compute_values(self, batch):
            return FakeRank(-1).do_compute_values(batch)

    group, _ = make_group(3)
    batch, rewards = make_batch(), torch.linspace(0, 1, 7)
    uids = [str(i // 2) for i in range(7)]
    token_rewards = torch.zeros_like(batch["response_mask"])
    token_rewards[torch.arange(7), batch["response_mask"].sum(1).long() - 1] = rewards
    on_group, on_one = dict(batch), dict(batch)

    async def run():
        critic = Critic(GroupCriticEngine(group), gamma=0.9, lam=0.95)
        return await in_thread(group, critic.advantages, "gae", on_group, rewards,
                               token_rewards, uids)  # fmt: skip

    got = asyncio.run(run())
    want = Critic(OneEngine(), gamma=0.9, lam=0.95).advantages(
        "gae", on_one, rewards, token_rewards, uids
    )
    assert got == pytest.approx(want)
    for key in ("values", "returns", "advantages"):
        torch.testing.assert_close(on_group[key], on_one[key], atol=0, rtol=0)


# ---- the rank ------------------------------------------------------------------------------
def test_a_rank_refuses_unknown_roles_and_calls_to_engines_it_did_not_build():
    rank = TrainerRank(0, 1)
    with pytest.raises(ValueError, match="each one of \\['actor', 'critic', 'reference'\\]"):
        rank.build(None, ("127.0.0.1", 1), 0, 1, roles=("actor", "value"))
    with pytest.raises(RuntimeError, match="has no critic engine"):
        rank.compute_values({})
    with pytest.raises(RuntimeError, match="has no reference engine"):
        rank.ref_log_probs({})
