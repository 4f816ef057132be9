"""Rollout record and replay in the training loop, with fakes (see `trainer_fakes`): a
recorded run replayed in `cache` mode trains the same updates bit for bit (a real FSDP2
engine), `repeat` cycles through the recording without generating, a mixed run (cached
steps, then live ones) keeps the buffer's accounting and syncs weights every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from trainer_fakes import FakeEngine, FakeTokenizer, Harness, check_accounting

from offbeat.core.config import JobConfig
from offbeat.core.models import build_tiny_model
from offbeat.core.rollout.recording import read_manifest
from offbeat.core.rollout.replay import RecordReplay, attach
from offbeat.core.tasks import make_rows
from offbeat.core.train import FSDP2Config, FSDP2TrainEngine, OptimConfig, PPOLoss


class VocabTokenizer(FakeTokenizer):
    """The fake byte tokenizer, with the vocabulary a recording's identity needs."""

    eos_token_id = 256
    pad_token_id = 0

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(257)}

    def __len__(self) -> int:
        return 257


class Seen:
    """A step hook that keeps what each step trained on."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def after_step(self, step, groups, batch, metrics) -> None:
        self.steps.append(
            {
                "uids": [g.uid for g in groups],
                "traj_uids": [[t.group_uid for t in g.trajectories] for g in groups],
                "versions": [t.min_weight_version for g in groups for t in g.trajectories],
                "input_ids": torch.cat([batch.prompt_ids, batch.response_ids], 1).clone(),
                "replayed": [g.prompt.get("replay") for g in groups],
            }
        )

    async def close(self) -> None:
        return None


class Capturing:
    """A train engine that keeps every mini-batch it was given and its weights after
    every update."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.inputs: list[dict[str, torch.Tensor]] = []
        self.params: list[dict[str, torch.Tensor]] = []

    def update(self, mini_batch, temperature=None):
        self.inputs.append({k: v.clone() for k, v in mini_batch.items()})
        out = self.engine.update(mini_batch, temperature)
        self.params.append({n: t.clone() for n, t in self.engine.export_weights()})
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def job(h: Harness, **rollout) -> JobConfig:
    cfg = JobConfig()
    cfg.model.path = "fake-model"
    cfg.rollout.n = h.settings.rollout.n
    for key, value in rollout.items():
        section, name = key.split("__")
        setattr(getattr(cfg.rollout, section), name, value)
    return cfg


def wire(h: Harness, cfg: JobConfig) -> tuple[RecordReplay, Seen]:
    """What the job does: the driver gets the wrapped loader and agent, the trainer the
    hooks. Validation is off, so every generate call a server sees is the rollout's."""
    rr = attach(
        cfg, model=cfg.model.path, model_dir=h.tmp, tokenizer=VocabTokenizer(), loader=h.loader,
        agent=h.agent,
        version=lambda: h.pool.last_sync.version if h.pool.last_sync else 0,
    )  # fmt: skip
    seen = Seen()
    h.driver.loader, h.driver.agent = rr.loader, rr.agent
    h.trainer.step_hooks = [*rr.hooks, seen]
    h.trainer.validator = None
    return rr, seen


def tensor_names(h: Harness) -> list[str]:
    return list(h.engine.params[0])


def harness(tmp: Path, name: str, **kw) -> Harness:
    (tmp / name).mkdir(parents=True, exist_ok=True)
    return Harness(tmp / name, **kw)


async def record(tmp: Path, steps: int, **record) -> tuple[Path, Harness, Seen]:
    h = harness(tmp, "record", total_training_steps=steps)
    _, seen = wire(h, job(h, record__dir=str(tmp / "rec"), **record))
    await h.run()
    return tmp / "rec", h, seen


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # The fake tokenizer's ids (bytes, EOS 256) fit the character vocabulary (260).
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
    )  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _own_process_group():
    """The FSDP2 engine starts a private 1-process group when none exists; leave none."""
    existed = dist.is_initialized()
    yield
    if not existed and dist.is_initialized():
        dist.destroy_process_group()


def fsdp2(model_dir: Path) -> Capturing:
    config = FSDP2Config(
        model_path=str(model_dir), device="cpu", micro_batch_size=2, optim=OptimConfig(lr=1e-2)
    )
    return Capturing(FSDP2TrainEngine(config, loss_fn=PPOLoss()))


async def test_cache_replay_of_a_recording_trains_the_same_updates_bit_for_bit(tmp_path, model_dir):
    rec_dir = tmp_path / "rec"
    a = harness(tmp_path, "a", engine=fsdp2(model_dir))
    wire(a, job(a, record__dir=str(rec_dir)))
    await a.run()
    assert [e["step"] for e in read_manifest(rec_dir)["steps"]] == [1, 2, 3]
    # The replay run has other prompts: only the recording can make its batches equal.
    b = harness(tmp_path, "b", engine=fsdp2(model_dir), rows=make_rows("reverse", 64, seed=7))
    assert a.loader.rows != b.loader.rows
    _, seen = wire(b, job(b, replay__dir=str(rec_dir), replay__mode="cache"))
    await b.run()
    first_a, first_b = a.engine.inputs[0], b.engine.inputs[0]
    assert sorted(first_a) == sorted(first_b)
    for key in first_a:
        assert torch.equal(first_a[key], first_b[key]), key
    for name, tensor in a.engine.params[0].items():
        assert torch.equal(tensor, b.engine.params[0][name]), name
    # it trains: the weights move
    assert any(
        not torch.equal(a.engine.params[0][n], a.engine.params[-1][n]) for n in tensor_names(a)
    )
    # and so on for every recorded step (3 steps × parameter_sync_step=2 updates)
    assert len(a.engine.params) == len(b.engine.params) == 6
    for pa, pb in zip(a.engine.params, b.engine.params, strict=True):
        assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert [r["replay/cache_frac"] for r in b.train_rows()] == [1.0, 1.0, 1.0]
    assert all(all(m is not None for m in s["replayed"]) for s in seen.steps)


async def test_repeat_cycles_through_the_recording_and_never_generates(tmp_path):
    rec_dir, _, recorded = await record(tmp_path, 3, record__steps=[1, 2])
    assert [e["step"] for e in read_manifest(rec_dir)["steps"]] == [1, 2]
    b = harness(tmp_path, "b", total_training_steps=5, engine=FakeEngine())
    _, seen = wire(b, job(b, replay__dir=str(rec_dir), replay__mode="repeat"))
    await b.run()
    # steps 1..5 train recorded steps 1, 2, 1, 2, 1
    for k, step in enumerate(seen.steps):
        assert torch.equal(step["input_ids"], recorded.steps[k % 2]["input_ids"]), k
    assert [r["replay/repeat_frac"] for r in b.train_rows()] == [1.0] * 5
    # Re-tagged: new prompt ids (a cycle's groups are not the recorded ones) whose
    # trajectories carry the group's uid, and the version the replicas held.
    uids = [u for s in seen.steps for u in s["uids"]]
    assert len(set(uids)) == len(uids) == 10
    assert all(
        t == [u] * 2 for s in seen.steps for u, t in zip(s["uids"], s["traj_uids"], strict=True)
    )
    for k, step in enumerate(seen.steps, start=1):
        assert all(v in (k - 2, k - 1) and v >= 0 for v in step["versions"]), step["versions"]
    assert b.servers["s0"].calls == 0  # nothing generated
    # the weights still reached the replica every step
    assert [r.version for r in b.trainer.sync_results] == [1, 2, 3, 4, 5]
    assert b.servers["s0"].weight_version == 5
    assert torch.equal(b.servers["s0"].weights["model.w"], b.engine.w)
    check_accounting(b)


async def test_cache_then_live_keeps_accounting_and_syncs_every_step(tmp_path):
    rec_dir, _, recorded = await record(tmp_path, 2)
    b = harness(tmp_path, "b", total_training_steps=5)
    rr, seen = wire(b, job(b, replay__dir=str(rec_dir)))
    await b.run()
    rows = b.train_rows()
    assert [r["replay/cache_frac"] for r in rows] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert [r["replay/groups_total"] for r in rows][-1] == 4.0
    for k in (0, 1):
        assert torch.equal(seen.steps[k]["input_ids"], recorded.steps[k]["input_ids"])
    assert b.servers["s0"].calls > 0  # the live steps generated
    assert [r.version for r in b.trainer.sync_results] == [1, 2, 3, 4, 5]
    assert b.servers["s0"].weight_version == 5
    # Every prompt group, replayed or live, trained once, evicted or still in flight.
    check_accounting(b)
    c = b.buffer.core.counts()
    assert c["trained"] == 10 and rr.agent.replayed_groups == 4
    # The 4 replayed groups used up as many dataset rows: the live steps go on from there.
    assert rr.loader.live and rr.loader.position == 4
    live_submitted = c["submitted"] - rr.loader.position
    assert b.loader.index + b.loader.epoch * len(b.loader) == 4 + live_submitted
    assert all(r["off_policy/trajectory_staleness_max"] <= 1 for r in rows)
