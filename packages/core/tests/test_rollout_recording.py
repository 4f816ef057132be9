"""Rollout recordings on disk: the format (safetensors + manifest, atomic per step), the
steps a `Recorder` chooses, the refusal of corrupt and mismatched recordings, the
`ReplayLoader`'s order, and the config rules `offbeat check` applies to `rollout.record`
and `rollout.replay`. No engine, no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from offbeat.core.buffer import PromptGroup
from offbeat.core.cli import load_recipe_config
from offbeat.core.config import ConfigError
from offbeat.core.data import Trajectory, TrajectoryBatch
from offbeat.core.rollout.record import Recorder
from offbeat.core.rollout.recording import (
    MANIFEST,
    CorruptRecording,
    RecordingError,
    RecordingMismatch,
    decode_step,
    read_manifest,
    run_identity,
    step_file,
)
from offbeat.core.rollout.replay import MARKER, Recording, ReplayLoader

IDENTITY = {
    "model": "offbeat-tiny:tiny",
    "model_config_sha256": "c0ffee",
    "tokenizer_sha256": "beef",
    "vocab_size": 260,
    "n": 2,
}


def make_step(seed: int, groups: int = 2, n: int = 2) -> tuple[list[PromptGroup], TrajectoryBatch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(groups):
        uid = f"g{seed}-{j}"
        trajs = []
        for _ in range(n):
            p = int(torch.randint(1, 6, (1,), generator=g))
            r = int(torch.randint(1, 6, (1,), generator=g))
            trajs.append(
                Trajectory(
                    prompt_ids=torch.randint(0, 256, (p,), generator=g).tolist(),
                    response_ids=torch.randint(0, 256, (r,), generator=g).tolist(),
                    rollout_log_probs=(-torch.rand(r, generator=g)).tolist(),
                    reward=float(torch.rand(1, generator=g)),
                    min_weight_version=seed,
                    max_weight_version=seed + 1,
                    group_uid=uid,
                    session_id=uid,
                )
            )
        group = PromptGroup(uid, j, {"data_source": f"src{j}", "prompt": "x"}, seed)
        group.trajectories = trajs
        out.append(group)
    batch = TrajectoryBatch.pad([t for gr in out for t in gr.trajectories], pad_token_id=3)
    return out, batch


async def write(d: Path, run=range(1, 4), identity=IDENTITY, **kw) -> Recorder:
    """Run steps `run` through a `Recorder` of `d` (its `kw`: steps, every, resume)."""
    rec = Recorder(d, identity=identity, config_sha256="cfg", **kw)
    for s in run:
        groups, batch = make_step(s)
        rec.after_step(s, groups, batch, {"weight_version": float(s)})
    await rec.close()
    return rec


async def test_each_step_is_a_safetensors_file_listed_in_the_manifest(tmp_path):
    from safetensors import safe_open

    await write(tmp_path / "rec")
    m = read_manifest(tmp_path / "rec")
    assert [e["step"] for e in m["steps"]] == [1, 2, 3]
    assert m["identity"] == IDENTITY and m["config_sha256"] == "cfg" and m["offbeat_version"]
    assert sorted(p.name for p in (tmp_path / "rec").iterdir()) == [
        MANIFEST,
        *(step_file(s) for s in (1, 2, 3)),
    ]  # no temporary file left behind
    path = tmp_path / "rec" / step_file(2)
    with safe_open(str(path), framework="pt") as f:  # an open format, no pickle
        assert json.loads(f.metadata()["data_sources"]) == ["src0", "src0", "src1", "src1"]
        assert f.get_tensor("rewards").shape == (4,)
    batch, meta = decode_step(path.read_bytes())
    _, want = make_step(2)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
                 "rollout_log_probs", "rewards", "min_weight_version", "max_weight_version"):  # fmt: skip
        assert torch.equal(getattr(batch, name), getattr(want, name)), name
    assert batch.group_uids == want.group_uids and batch.pad_token_id == 3
    assert meta["step"] == 2 and meta["weight_version"] == 2


@pytest.mark.parametrize(
    ("kw", "written"), [({"steps": [2, 4]}, [2, 4]), ({"every": 2}, [2, 4]), ({}, [1, 2, 3, 4])]
)
async def test_steps_or_every_choose_what_is_recorded(tmp_path, kw, written):
    rec = await write(tmp_path / "rec", run=range(1, 5), **kw)
    assert rec.written == written
    assert [e["step"] for e in read_manifest(tmp_path / "rec")["steps"]] == written


async def test_a_directory_holding_a_recording_is_refused_unless_resumed(tmp_path):
    await write(tmp_path / "rec", run=[1])
    with pytest.raises(RecordingError, match="already holds a recording"):
        Recorder(tmp_path / "rec", identity=IDENTITY, config_sha256="cfg")
    await write(tmp_path / "rec", run=[2], resume=True)
    assert [e["step"] for e in read_manifest(tmp_path / "rec")["steps"]] == [1, 2]
    with pytest.raises(RecordingMismatch, match=r"rollout\.n"):
        Recorder(tmp_path / "rec", identity={**IDENTITY, "n": 4}, config_sha256="c", resume=True)


async def test_a_failed_write_is_raised_and_no_step_is_half_listed(tmp_path):
    rec = Recorder(tmp_path / "rec", identity=IDENTITY, config_sha256="cfg")
    groups, batch = make_step(1)
    rec.after_step(1, groups[:1], batch, {})  # data sources for 2 of 4 rows: the write fails
    with pytest.raises(RecordingError, match="writing the rollout recording"):
        await rec.close()
    assert read_manifest(tmp_path / "rec")["steps"] == []  # nothing half-listed


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("flip", "sha256"),
        ("truncate", "truncated"),
        ("delete", "listed but missing"),
        ("manifest", "unreadable manifest"),
        ("no_manifest", "not a rollout recording"),
        ("version", "format version 99"),
    ],
)
async def test_a_corrupt_recording_is_refused_naming_what_is_wrong(tmp_path, damage, match):
    d = tmp_path / "rec"
    await write(d)
    step = d / step_file(2)
    if damage == "flip":
        data = bytearray(step.read_bytes())
        data[-3] ^= 0xFF
        step.write_bytes(bytes(data))
    elif damage == "truncate":
        step.write_bytes(step.read_bytes()[:-10])
    elif damage == "delete":
        step.unlink()
    elif damage == "manifest":
        (d / MANIFEST).write_text("{not json")
    elif damage == "no_manifest":
        (d / MANIFEST).unlink()
    else:
        m = json.loads((d / MANIFEST).read_text())
        (d / MANIFEST).write_text(json.dumps({**m, "format_version": 99}))
    with pytest.raises(RecordingError, match=match) as ei:
        Recording.open(d, IDENTITY)
    assert "rollout.replay.dir=" in str(ei.value)
    if damage in ("flip", "truncate", "delete"):
        assert isinstance(ei.value, CorruptRecording) and step_file(2) in str(ei.value)


@pytest.mark.parametrize(
    ("key", "value", "label"),
    [
        ("model", "other/model", "model.path"),
        ("model_config_sha256", "f00d", "config.json"),
        ("tokenizer_sha256", "cafe", "vocabulary"),
        ("vocab_size", 151936, "vocabulary size"),
        ("n", 8, "rollout.n"),
    ],
)
async def test_a_recording_of_another_model_tokenizer_or_vocabulary_is_refused(
    tmp_path, key, value, label
):
    await write(tmp_path / "rec")
    with pytest.raises(RecordingMismatch, match=label) as ei:
        Recording.open(tmp_path / "rec", {**IDENTITY, key: value})
    assert f"recorded {IDENTITY[key]!r}, this run {value!r}" in str(ei.value)


async def test_replay_loader_cache_then_dataset_rows_repeat_cycles_and_resumes(tmp_path):
    from offbeat.core.tasks import PromptDataLoader, make_rows, write_parquet

    await write(tmp_path / "rec", run=[1, 2])
    recording = Recording.open(tmp_path / "rec", IDENTITY)
    assert [(s, j) for s, j, _ in recording.index] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert recording.load_groups(2)[1][0].group_uid == "g2-1"
    path = write_parquet(make_rows("reverse", 10, seed=0), tmp_path / "t.parquet")
    plain = PromptDataLoader(path, seed=0).next(8)

    cache = ReplayLoader(PromptDataLoader(path, seed=0), recording, "cache")
    rows = cache.next(3) + cache.next(3)
    assert [r[MARKER]["pos"] for r in rows[:4]] == [0, 1, 2, 3]
    assert rows[1] == {"data_source": "src1", MARKER: {"pos": 1, "step": 1, "group": 1}}
    assert rows[4:] == plain[4:6] and cache.live  # the replayed groups used up 4 rows

    repeat = ReplayLoader(PromptDataLoader(path, seed=0), recording, "repeat")
    rows = repeat.next(6)
    assert [(r[MARKER]["step"], r[MARKER]["group"]) for r in rows] == [
        (1, 0), (1, 1), (2, 0), (2, 1), (1, 0), (1, 1)
    ]  # fmt: skip
    assert repeat.loader.index == 0 and not repeat.live
    again = ReplayLoader(PromptDataLoader(path, seed=0), recording, "repeat")
    again.load_state_dict(repeat.state_dict())
    assert again.next(1)[0][MARKER]["pos"] == 6


def test_run_identity_of_the_tiny_model_and_its_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from offbeat.core.models import build_tiny_model
    from offbeat.core.tasks.checks import _load_tokenizer

    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)  # fmt: skip
    ident = run_identity("offbeat-tiny:tiny", model, AutoTokenizer.from_pretrained(model), 8)
    assert ident["vocab_size"] == 260 and len(ident["model_config_sha256"]) == 64
    # `offbeat check` loads the tiny tokenizer on its own: the same vocabulary
    cfg = load_recipe_config("separate_async", [])[1]
    assert (
        run_identity("x", model, _load_tokenizer(cfg), 8)["tokenizer_sha256"]
        == (ident["tokenizer_sha256"])
    )


# ---- offbeat check -------------------------------------------------------------------------
def problems(*overrides: str) -> dict[str, str]:
    try:
        load_recipe_config("separate_async", list(overrides))
    except ConfigError as e:
        return {p.key: str(p) for p in e.problems}
    return {}


def tiny_identity() -> dict:
    from offbeat.core.tasks.checks import _load_tokenizer

    cfg = load_recipe_config("separate_async", [])[1]
    return run_identity("offbeat-tiny:tiny", "/nonexistent", _load_tokenizer(cfg), 8)


async def test_check_accepts_a_matching_recording_and_record_settings(tmp_path):
    await write(tmp_path / "rec", identity=tiny_identity())
    assert problems(f"rollout.replay.dir={tmp_path / 'rec'}", "rollout.replay.mode=repeat") == {}
    assert problems(f"rollout.record.dir={tmp_path / 'new'}", "rollout.record.steps=[1,60]") == {}
    assert problems(f"rollout.record.dir={tmp_path / 'new'}", "rollout.record.every=5") == {}


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["rollout.replay.mode=skip"], "rollout.replay.mode", "must be one of cache, repeat"),
        (["rollout.replay.dir=REC", "rollout.replay.mode=Cache"], "rollout.replay.mode",
         "must be one of cache, repeat"),
        (["rollout.replay.mode=repeat"], "rollout.replay.mode", "only read when rollout.replay.dir"),
        (["rollout.replay.dir=MISSING"], "rollout.replay.dir", "an existing directory"),
        (["rollout.replay.dir=EMPTY"], "rollout.replay.dir", "not a rollout recording"),
        (["rollout.replay.dir=REC", "rollout.n=4"], "rollout.n", "the group size"),
        (["rollout.record.steps=[3]"], "rollout.record.steps", "only read when rollout.record.dir"),
        (["rollout.record.every=2"], "rollout.record.every", "only read when rollout.record.dir"),
        (["rollout.record.dir=NEW", "rollout.record.steps=[0,100001]"], "rollout.record.steps",
         "[0, 100001] are not"),
        (["rollout.record.dir=NEW", "rollout.record.steps=[2,2]"], "rollout.record.steps",
         "some repeat"),
        (["rollout.record.dir=NEW", "rollout.record.steps=[2]", "rollout.record.every=3"],
         "rollout.record.every", "set one of the two"),
        (["rollout.record.dir=NEW", "rollout.record.every=0"], "rollout.record.every",
         "must be an int > 0"),
        (["rollout.record.dir=REC"], "rollout.record.dir", "already holds a recording"),
        (["rollout.record.dir=FILE"], "rollout.record.dir", "this is a file"),
        (["rollout.record.dir=REC", "rollout.replay.dir=REC", "trainer.resume=true"],
         "rollout.record.dir", "other than rollout.replay.dir"),
    ],
)  # fmt: skip
async def test_check_rejects_bad_record_and_replay_settings(tmp_path, overrides, key, says):
    await write(tmp_path / "rec", identity=tiny_identity())
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    names = {"REC": "rec", "MISSING": "missing", "EMPTY": "empty", "NEW": "new", "FILE": "file"}
    for placeholder, name in names.items():
        overrides = [o.replace(placeholder, str(tmp_path / name)) for o in overrides]
    found = problems(*overrides)
    assert key in found, found
    assert says in found[key]


async def test_check_rejects_a_recording_of_another_model_or_vocabulary(tmp_path):
    ident = tiny_identity()
    await write(tmp_path / "a", identity={**ident, "model": "offbeat-tiny:small"})
    await write(tmp_path / "b", identity={**ident, "tokenizer_sha256": "0" * 64})
    await write(tmp_path / "c", identity=ident)
    (tmp_path / "c" / step_file(3)).write_bytes(b"short")
    assert "offbeat-tiny:small" in problems(f"rollout.replay.dir={tmp_path / 'a'}")["model.path"]
    found = problems(f"rollout.replay.dir={tmp_path / 'b'}")
    assert "another vocabulary" in found["rollout.replay.dir"]
    found = problems(f"rollout.replay.dir={tmp_path / 'c'}")
    assert "truncated" in found["rollout.replay.dir"]
