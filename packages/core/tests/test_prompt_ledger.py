"""The prompt ledger, the replay buffer's state and the sampler's position, each through a
checkpoint round trip: every position of the data order is accounted once (trained,
evicted, failed with a reason, or in flight), a duplicate or a loss raises where it
happens, and a restored buffer and sampler continue exactly where the saved ones were."""

from __future__ import annotations

import pickle

import pytest

from offbeat.core.buffer import (
    BufferConfig,
    GroupStatus,
    PromptDuplicated,
    PromptLedger,
    PromptLost,
    ReplayBuffer,
)
from offbeat.core.data import Trajectory
from offbeat.core.tasks import PromptDataLoader, write_task_files


def traj() -> Trajectory:
    return Trajectory(
        prompt_ids=[1], response_ids=[2], rollout_log_probs=[-0.1], reward=1.0,
        min_weight_version=0, max_weight_version=0, group_uid="g", session_id="g",
    )  # fmt: skip


def round_trip(state: dict) -> dict:
    """What torch.save/torch.load of a checkpoint would give back: a deep copy."""
    return pickle.loads(pickle.dumps(state))


def test_ledger_counts_each_way_out_and_survives_a_round_trip():
    led = PromptLedger(dataset_size=5)
    for p in range(7):  # into the second epoch of 5
        led.draw(p, f"g{p}", step=1 + p // 4)
    led.left("g0", "trained", 2)
    led.left("g1", "trained", 2)
    led.left("g2", "evicted", 3, "span 3 > 2")
    led.left("g3", "failed", 3, "reward_timeout")
    led.left("g4", "failed", 3, "bad_row")
    s = led.summary()
    assert (s["drawn"], s["trained"], s["evicted"], s["failed"], s["in_flight"]) == (7, 2, 1, 2, 2)
    assert s["failed_by_reason"] == {"bad_row": 1, "reward_timeout": 1}
    assert s["unseen"] == 3  # epoch 1 begun at 5, 2 of its 5 drawn
    assert led.metrics()["prompts/failed_reward_timeout"] == 1.0
    led.check({"g5", "g6"})

    again = PromptLedger()
    again.load_state_dict(round_trip(led.state_dict()))
    assert [r.to_tuple() for r in again.records()] == [r.to_tuple() for r in led.records()]
    assert again.summary() == {**s, "resumes": 1}
    again.draw(7, "g7", 4)  # the stream continues where it was
    again.draw(8, "g8", 4)
    with pytest.raises(PromptLost, match=r"skipped positions 9\.\.9"):
        again.draw(10, "g10", 4)


def test_a_prompt_drawn_twice_or_leaving_twice_raises_duplicated():
    led = PromptLedger()
    led.draw(0, "g0", 1)
    with pytest.raises(PromptDuplicated, match="prompt 0 of the data order drawn twice"):
        led.draw(0, "g1", 2)
    led.left("g0", "trained", 1)
    with pytest.raises(PromptDuplicated, match="left twice: trained at step 1, then trained"):
        led.left("g0", "trained", 2)
    with pytest.raises(PromptLost, match="never drawn"):
        led.left("g9", "evicted", 2)


def test_check_names_a_prompt_in_flight_that_the_buffer_no_longer_holds():
    led = PromptLedger()
    for p in range(3):
        led.draw(p, f"g{p}", 1)
    led.left("g0", "trained", 1)
    led.check({"g1", "g2"})
    with pytest.raises(PromptLost, match=r"1 prompts in flight .* \['g2'\]"):
        led.check({"g1"})
    with pytest.raises(PromptDuplicated, match="not in flight"):
        led.check({"g0", "g1", "g2"})


def buffer_mid_run() -> tuple[ReplayBuffer, dict]:
    """A drop buffer (2 groups a step, 1 warm-up batch) at step 3 holding a finished group
    from step 2, one running from step 2 and one pending from step 3, after one of step
    2's groups failed and two of step 1's were evicted; a run resumed mid-stream (its first
    position is 10). Returns it and its saved state."""
    buf = ReplayBuffer(BufferConfig(2, max_off_policy_threshold=2, num_warmup_batches=1))
    buf.submit([{"i": i} for i in range(4)], positions=range(10, 14))  # a run resumed mid-stream
    for g in buf.take_pending():
        buf.finish(g.uid, [traj()])
    assert [g.uid for g in buf.sample(2)] == ["g0", "g1"]
    buf.begin_step(2)
    buf.submit([{"i": 4}, {"i": 5}])  # positions 14, 15 follow
    g4, g5 = buf.take_pending()
    buf.fail(g4.uid, "the reward timed out", "reward_timeout")
    buf.submit([{"i": 6}])
    buf.take_pending()  # g6 running
    buf.finish(g5.uid, [traj()])
    buf.begin_step(3)
    assert [g.uid for g in buf.evict_stale()] == ["g2", "g3"]  # span 3 > 2
    buf.submit([{"i": 7}])
    return buf, buf.state_dict()


def test_buffer_state_round_trip_keeps_groups_steps_and_the_ledger():
    buf, state = buffer_mid_run()
    live = {g.uid: (g.status, g.submission_step) for g in buf._groups.values()}
    assert live == {
        "g5": (GroupStatus.FINISHED, 2),
        "g6": (GroupStatus.RUNNING, 2),
        "g7": (GroupStatus.PENDING, 3),
    }
    again = ReplayBuffer(buf.config)
    again.load_state_dict(round_trip(state))
    # Finished kept with its samples, in flight re-issued once, each at its submission step.
    assert {g.uid: (g.status, g.submission_step) for g in again._groups.values()} == {
        "g5": (GroupStatus.FINISHED, 2),
        "g6": (GroupStatus.PENDING, 2),
        "g7": (GroupStatus.PENDING, 3),
    }
    assert again.counts() == {**buf.counts(), "running": 0, "pending": 2}
    s = again.prompts.summary()
    assert (s["trained"], s["evicted"], s["failed"], s["in_flight"]) == (2, 2, 1, 3)
    assert s["failed_by_reason"] == {"reward_timeout": 1}
    assert (s["first_position"], s["next_position"], s["resumes"], s["reissued"]) == (10, 18, 1, 2)
    assert again.prompts.position_of("g6") == 16
    again.check_accounting()
    # The re-issued groups finish once and are trained once; the stream goes on at 18.
    for g in again.take_pending():
        again.finish(g.uid, [traj()])
    assert [g.uid for g in again.sample(2)] == ["g5", "g6"]
    again.submit([{"i": 8}])
    assert again.prompts.position_of("g8") == 18
    again.check_accounting()
    assert again.prompts.summary()["trained"] == 4


def test_a_buffer_state_saved_before_the_ledger_still_restores_one():
    buf, state = buffer_mid_run()
    del state["prompts"]
    for d in state["reissue"]:
        del d["submission_step"]
    again = ReplayBuffer(buf.config)
    again.load_state_dict(state)
    assert {g.uid: g.submission_step for g in again._groups.values()} == {
        "g5": 2, "g6": 3, "g7": 3,  # the old rule: re-issued at the restored step
    }  # fmt: skip
    again.check_accounting()
    assert again.prompts.position_of("g6") == 6  # positions: submission order


def test_a_restored_buffer_fed_from_a_fresh_sampler_raises_duplicated():
    """The resume that would train prompts twice: the buffer's state restored, the
    sampler's not (it hands out position 10 again)."""
    _, state = buffer_mid_run()
    again = ReplayBuffer(BufferConfig(2, max_off_policy_threshold=2, num_warmup_batches=1))
    again.load_state_dict(state)
    again.begin_step(5)
    with pytest.raises(PromptDuplicated, match="prompt 10 of the data order drawn twice"):
        again.submit([{"i": 0}], positions=[10])
    assert again.counts()["submitted"] == state["next_seq"]  # nothing half-admitted


def test_sampler_position_round_trip_mid_epoch(tmp_path):
    train, _ = write_task_files(tmp_path, "copy", n_train=7, n_val=2)
    dl = PromptDataLoader(train, seed=3)
    dl.next(10)  # 3 rows into epoch 1
    assert dl.stream_position == 10
    state = round_trip(dl.state_dict())
    assert (state["epoch"], state["index"], state["seed"]) == (1, 3, 3)
    expected = dl.next(12)  # across the next epoch boundary too
    resumed = PromptDataLoader(train, seed=0)
    resumed.load_state_dict(state)
    assert resumed.stream_position == 10
    assert resumed.next(12) == expected
    assert resumed.stream_position == 22
    unshuffled = PromptDataLoader(train, shuffle=False)
    with pytest.raises(ValueError, match=r"resume with the data\.shuffle"):
        unshuffled.load_state_dict(state)
