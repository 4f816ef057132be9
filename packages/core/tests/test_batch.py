"""TrajectoryBatch: padding round trips, selection, splitting and concatenation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offbeat.core.data import Trajectory, TrajectoryBatch


def traj(i: int, p: int, r: int, *, extras: bool = False) -> Trajectory:
    return Trajectory(
        prompt_ids=[100 + i * 10 + k for k in range(p)],
        response_ids=[500 + i * 10 + k for k in range(r)],
        rollout_log_probs=[-0.1 * (k + 1) for k in range(r)],
        reward=float(i),
        min_weight_version=i,
        max_weight_version=i + 1,
        group_uid=f"g{i // 2}",
        session_id=f"s{i}",
        extras={"adv": [float(i)] * r, "score": 0.5 * i} if extras else {},
    )


rows = st.lists(st.tuples(st.integers(1, 6), st.integers(0, 7)), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None)
@given(rows)
def test_pad_unpad_round_trip(shape):
    trajs = [traj(i, p, r, extras=True) for i, (p, r) in enumerate(shape)]
    batch = TrajectoryBatch.pad(trajs, pad_token_id=0)
    assert batch.prompt_width == max(p for p, _ in shape)
    assert batch.response_width == max(r for _, r in shape)
    assert batch.num_response_tokens() == sum(r for _, r in shape)
    back = batch.unpad()
    for a, b in zip(trajs, back, strict=True):
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
        assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs)
        assert a.extras["adv"] == b.extras["adv"] and a.extras["score"] == b.extras["score"]
        assert (a.reward, a.min_weight_version, a.max_weight_version) == (
            b.reward,
            b.min_weight_version,
            b.max_weight_version,
        )
        assert (a.group_uid, a.session_id) == (b.group_uid, b.session_id)


def test_layout_left_padded_prompts_right_padded_responses():
    batch = TrajectoryBatch.pad([traj(0, 2, 3), traj(1, 4, 1)], pad_token_id=-1)
    assert batch.prompt_ids[0].tolist() == [-1, -1, 100, 101]
    assert batch.prompt_mask[0].tolist() == [0, 0, 1, 1]
    assert batch.response_ids[1].tolist() == [510, -1, -1]
    assert batch.response_mask[1].tolist() == [1, 0, 0]
    assert batch.rollout_log_probs[1, 1:].abs().sum() == 0
    assert batch.input_ids.shape == (2, 7)
    # responses are the last R columns; positions count from the first real token
    assert batch.position_ids[0].tolist() == [0, 0, 0, 1, 2, 3, 4]
    assert batch.position_ids[1].tolist() == [0, 1, 2, 3, 4, 4, 4]
    inputs = batch.model_inputs()
    assert set(inputs) >= {"input_ids", "attention_mask", "position_ids", "response_mask"}


def test_pad_to_fixed_widths_and_too_narrow_is_an_error():
    batch = TrajectoryBatch.pad([traj(0, 2, 3)], prompt_width=5, response_width=6)
    assert batch.prompt_ids.shape == (1, 5) and batch.response_ids.shape == (1, 6)
    assert batch.trim().prompt_ids.shape == (1, 2) and batch.trim().response_width == 3
    with pytest.raises(ValueError, match="response_width=2 < longest row"):
        TrajectoryBatch.pad([traj(0, 2, 3)], response_width=2)


def test_select_split_chunk_concat():
    batch = TrajectoryBatch.pad([traj(i, 1 + i % 3, i % 4) for i in range(7)])
    sel = batch.select([6, 0, 6])
    assert sel.session_ids == ["s6", "s0", "s6"] and sel.rewards.tolist() == [6.0, 0.0, 6.0]

    parts = batch.split(3)
    assert [len(b) for b in parts] == [3, 3, 1]
    assert [len(b) for b in batch.chunk(3)] == [3, 2, 2]

    # re-pad each part to its own width, then concat widens them again
    again = TrajectoryBatch.concat([b.trim() for b in parts])
    assert again.session_ids == batch.session_ids
    assert torch.equal(again.input_ids, batch.input_ids)
    assert torch.equal(again.response_mask, batch.response_mask)
    assert torch.equal(again.min_weight_version, batch.min_weight_version)


@settings(max_examples=30, deadline=None)
@given(rows, st.integers(1, 5))
def test_split_then_concat_is_identity(shape, size):
    batch = TrajectoryBatch.pad([traj(i, p, r, extras=True) for i, (p, r) in enumerate(shape)])
    parts = batch.split(size)
    assert sum(len(b) for b in parts) == len(batch)
    assert all(len(b) == size for b in parts[:-1])
    back = TrajectoryBatch.concat(parts)
    assert torch.equal(back.input_ids, batch.input_ids)
    assert torch.equal(back.extras["adv"], batch.extras["adv"])
    assert back.group_uids == batch.group_uids


def test_shape_and_argument_errors_name_the_field():
    batch = TrajectoryBatch.pad([traj(0, 2, 3), traj(1, 2, 2)])
    with pytest.raises(ValueError, match="rewards: shape"):
        TrajectoryBatch(**{**batch.__dict__, "rewards": torch.zeros(3)})
    with pytest.raises(ValueError, match="group_uids: 1 entries for 2 rows"):
        TrajectoryBatch(**{**batch.__dict__, "group_uids": ["a"]})
    with pytest.raises(ValueError, match=r"extras\['x'\]"):
        TrajectoryBatch(**{**batch.__dict__, "extras": {"x": torch.zeros(5)}})
    with pytest.raises(ValueError, match="size=0"):
        batch.split(0)
    with pytest.raises(ValueError, match="parts=3"):
        batch.chunk(3)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        Trajectory(prompt_ids=[1], response_ids=[2, 3], rollout_log_probs=[0.0])
    with pytest.raises(ValueError, match="disagree"):
        TrajectoryBatch.concat([batch, TrajectoryBatch.pad([traj(0, 1, 1)], pad_token_id=9)])


def test_to_device_keeps_everything():
    batch = TrajectoryBatch.pad([traj(0, 2, 3, extras=True)])
    moved = batch.to("cpu")
    assert (
        torch.equal(moved.input_ids, batch.input_ids) and moved.extras.keys() == batch.extras.keys()
    )
