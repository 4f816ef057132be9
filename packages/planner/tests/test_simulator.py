"""The simulator on cases with closed forms, and the staleness rules it takes from the
real ReplayBuffer."""

from __future__ import annotations

import json

import pytest

from offbeat.planner import (
    Profile,
    RolloutProfile,
    SimConfig,
    SyncProfile,
    TrainerPoint,
    TrainerProfile,
    ValidationProfile,
    simulate,
)

INF_RATE = 1e12


def profile(
    *, rate: float = 1000.0, lengths=(4,), update_s: float = 0.5, opt_s: float = 0.0,
    sync_s: float = 0.0, max_num_seqs: int = 10**6,
) -> Profile:  # fmt: skip
    """A flat tokens/s replica, a trainer whose update of 128 rows takes `update_s` at any
    length (+ `opt_s`), a sync of `sync_s`."""
    return Profile(
        trainer=TrainerProfile(
            points=[
                TrainerPoint(
                    seq_len=1, rows=128, forward_s=0.0, backward_s=update_s, optimizer_s=opt_s
                ),
                TrainerPoint(
                    seq_len=10**6, rows=128, forward_s=0.0, backward_s=update_s, optimizer_s=opt_s
                ),
            ],
        ),
        rollout=RolloutProfile(
            concurrency=[1.0, 1e9],
            tokens_per_s=[rate, rate],
            response_lengths=list(lengths),
            max_num_seqs=max_num_seqs,
        ),
        sync=SyncProfile(bytes=0, abort_s=sync_s),
        validation=ValidationProfile(prompts=0),
    )


def config(**kw) -> SimConfig:
    base = dict(
        steps=8, train_batch_size=32, n=8, ppo_mini_batch_size=16, parameter_sync_step=2,
        max_tokens=10**6, max_concurrent_groups=10**6, prompt_len=0,
    )  # fmt: skip
    base.update(kw)
    return SimConfig(**base)


def test_sync_equal_lengths_no_sync_cost_known_throughput():
    # sync: generate the whole batch (32 x 8 x L tokens at R tok/s), then train (2 updates).
    L, R, U = 5, 2000.0, 0.25
    r = simulate(config(mode="sync"), profile(rate=R, lengths=[L], update_s=U))
    gen = 32 * 8 * L / R
    assert r.step_s == pytest.approx(gen + 2 * U, rel=1e-6)
    assert r.tokens_per_s == pytest.approx(32 * 8 * L / (gen + 2 * U), rel=1e-6)
    assert r.trainer_idle == pytest.approx(gen / (gen + 2 * U), rel=1e-6)
    assert r.rollout_idle == pytest.approx(2 * U / (gen + 2 * U), rel=1e-6)
    assert set(r.staleness) == {0}  # on-policy


def test_async_trainer_bound_step_is_train_plus_sync():
    # rollout much faster than training: step = train + sync, the trainer never waits
    r = simulate(config(), profile(rate=1e6, lengths=[5], update_s=0.3, sync_s=0.1))
    assert r.step_s == pytest.approx(2 * 0.3 + 0.1, rel=1e-6)
    assert r.trainer_idle == pytest.approx(0.0, abs=1e-9)
    # one batch ahead: trained one version behind, but for step 1's (made at version 0)
    assert r.staleness == {0: 32 * 8, 1: 7 * 32 * 8}


def test_infinitely_fast_trainer_gives_rollout_bound_steps():
    L, R = 7, 1000.0
    for mode in ("sync", "separate_async"):
        # async: the two batches in flight share the replica and end together, so steps
        # come in pairs (one waits for both, the next for none): average 8 steps after the first
        r = simulate(config(mode=mode, steps=9), profile(rate=R, lengths=[L], update_s=0.0))
        assert r.step_s == pytest.approx(32 * 8 * L / R, rel=1e-6), mode
        assert r.tokens_per_s == pytest.approx(R, rel=1e-6), mode
        assert r.rollout_idle == pytest.approx(0.0, abs=1e-6), mode
        waited = sum(s.wait_s for s in r.steps[1:]) / sum(s.step_s for s in r.steps[1:])
        assert waited == pytest.approx(1.0, abs=1e-6), mode  # the trainer only waits


def test_infinitely_fast_rollout_gives_trainer_bound_steps():
    for mode in ("sync", "separate_async"):
        r = simulate(config(mode=mode), profile(rate=INF_RATE, update_s=0.4, opt_s=0.05))
        assert r.step_s == pytest.approx(2 * (0.4 + 0.05), rel=1e-6), mode
        assert r.trainer_idle == pytest.approx(0.0, abs=1e-6), mode


def test_sync_pauses_rollout_and_resumes_partial_requests():
    # A sync longer than the train phase: in-flight requests are paused (partial rollout)
    # and finish after it, on the new version; nothing is lost.
    r = simulate(
        config(max_concurrent_groups=4), profile(rate=50.0, lengths=[20], update_s=0.01, sync_s=2)
    )
    assert r.counts["trained"] == 8 * 32
    assert all(s.sync_s == pytest.approx(2.0) for s in r.steps)
    # every step pays the sync; generation cannot run during it
    gen = 32 * 8 * 20 / 50.0
    assert r.step_s == pytest.approx(gen + 2.0, rel=0.02)


def test_drop_evicts_only_beyond_the_span_bound():
    # within the bound: fast rollout, equal lengths, depth 2 <= threshold 2: no eviction
    calm = simulate(config(), profile(rate=1e6, lengths=[5], update_s=0.3))
    assert calm.evictions == 0
    assert max(calm.spans) <= 2
    # a long tail with many groups in flight: some finish only after their span passed 2
    tail = simulate(
        config(steps=10, max_concurrent_groups=96, seed=1),
        profile(rate=2000.0, lengths=[1] * 30 + [400], update_s=0.2, max_num_seqs=64),
    )
    assert tail.evictions > 0
    assert min(tail.evicted_spans) > 2  # every evicted group had exceeded the bound
    assert max(tail.spans) <= 2  # nothing beyond it was trained


def test_wait_never_trains_beyond_the_bound():
    for th in (1, 2, 3):
        r = simulate(
            config(
                steps=10, max_off_policy_strategy="wait", max_off_policy_threshold=th,
                num_warmup_batches=3, max_concurrent_groups=96, seed=2,
            ),
            profile(rate=2000.0, lengths=[1] * 30 + [400], update_s=0.2, max_num_seqs=64),
        )  # fmt: skip
        assert r.evictions == 0
        assert max(r.spans) <= th, (th, r.spans)


def test_hybrid_validation_holds_the_trainer_background_does_not():
    p = profile(rate=1e6, lengths=[5], update_s=0.3)
    p.validation = ValidationProfile(prompts=64, response_tokens=1000, hybrid_overhead_s=0.5)
    bg = simulate(config(test_freq=2), p)
    hy = simulate(config(test_freq=2, hybrid=True), p)
    assert all(s.val_s == 0 for s in bg.steps)
    val_steps = [s for s in hy.steps if s.step % 2 == 0]
    assert all(s.val_s >= 0.5 for s in val_steps)
    assert hy.step_s > bg.step_s


def test_deterministic_for_a_seed():
    p = profile(rate=3000.0, lengths=[1, 2, 3, 50], update_s=0.1)
    a, b = simulate(config(seed=3), p), simulate(config(seed=3), p)
    assert a.summary() == b.summary()


def test_padded_batches_pay_for_the_longest_response_packed_ones_for_the_mean():
    # per-row cost linear in length: 1 ms per token; responses 1 or 99 tokens
    p = profile(rate=INF_RATE, lengths=[1, 99])
    p.trainer.points = [
        TrainerPoint(seq_len=10, rows=1, forward_s=0.0, backward_s=0.010, optimizer_s=0.0),
        TrainerPoint(seq_len=100, rows=1, forward_s=0.0, backward_s=0.100, optimizer_s=0.0),
    ]
    rows = 16 * 8
    pad = simulate(config(), p)
    packed = simulate(config(layout="packed"), p)
    assert all(s.train_s == pytest.approx(2 * rows * 0.099) for s in pad.steps)
    mean = [s.train_s / (2 * rows * 0.001) for s in packed.steps]  # mean response length
    assert all(30 < m < 70 for m in mean), mean


def test_replicas_sharing_a_device_take_as_long_as_one_replica_with_all_the_work():
    # A flat curve, equal lengths, an instant trainer: the rollout alone sets the step.
    # Two replicas on one device that a lone replica saturates (device_busy 1) time-slice
    # it: each decodes half as fast while both have requests, so together they make
    # R tok/s, as one replica with all the work; on two devices they make 2R.
    L, R = 7, 1000.0
    p = profile(rate=R, lengths=[L], update_s=0.0)
    work = 32 * 8 * L
    one = simulate(config(mode="sync", steps=4), p)
    shared = simulate(config(mode="sync", steps=4, replicas=2, replica_devices=(0, 0)), p)
    own = simulate(config(mode="sync", steps=4, replicas=2, replica_devices=(0, 1)), p)
    assert one.step_s == pytest.approx(work / R, rel=1e-6)
    assert shared.step_s == pytest.approx(work / R, rel=1e-6)
    assert own.step_s == pytest.approx(work / (2 * R), rel=1e-6)
    assert simulate(config(mode="sync", steps=4, replicas=2), p).step_s == pytest.approx(
        own.step_s, rel=1e-9
    )  # no replica_devices: each its own
    # A replica that keeps its device half busy leaves room for a second: no slowdown;
    # 0.75 busy: each of the two is 1.5x slower than alone.
    p.rollout.device_busy = 0.5
    half = simulate(config(mode="sync", steps=4, replicas=2, replica_devices=(0, 0)), p)
    assert half.step_s == pytest.approx(own.step_s, rel=1e-6)
    p.rollout.device_busy = 0.75
    most = simulate(config(mode="sync", steps=4, replicas=2, replica_devices=(0, 0)), p)
    assert most.step_s == pytest.approx(1.5 * own.step_s, rel=1e-6)


def test_a_curve_measured_on_shared_cores_has_the_sharing_in_it():
    # Measured with two replicas on the device (shared_by 2, device_busy 1): replayed on
    # the same placement the curve is used as measured; a replica alone there is twice
    # as fast as the curve says.
    L, R = 7, 1000.0
    p = profile(rate=R, lengths=[L], update_s=0.0)
    p.rollout.shared_by = 2
    shared = simulate(config(mode="sync", steps=4, replicas=2, replica_devices=(0, 0)), p)
    alone = simulate(config(mode="sync", steps=4), p)
    assert shared.step_s == pytest.approx(32 * 8 * L / (2 * R), rel=1e-6)
    assert alone.step_s == pytest.approx(32 * 8 * L / (2 * R), rel=1e-6)


def test_replica_devices_names_one_device_per_replica():
    with pytest.raises(ValueError, match="replica_devices"):
        config(replicas=2, replica_devices=(0,))


def test_a_contended_trainer_runs_at_its_alone_speed_while_no_replica_decodes():
    # The profile's trainer level (2) was measured with the rollout decoding beside it.
    # sync: the rollout is idle while it trains, so the phase takes 2 x 0.25 / 2; without
    # `contended` (separate hardware) the level holds throughout: 2 x 0.25.
    L, R, U = 5, 2000.0, 0.25
    gen = 32 * 8 * L / R
    for contended, train in ((True, 2 * U / 2), (False, 2 * U)):
        p = profile(rate=R, lengths=[L], update_s=U / 2)
        p.trainer.run_level, p.trainer.contended = 2.0, contended
        r = simulate(config(mode="sync"), p)
        assert r.step_s == pytest.approx(gen + train, rel=1e-6), contended
        assert r.steps[-1].train_s == pytest.approx(train, rel=1e-6), contended


def test_a_contended_trainer_beside_a_decoding_rollout_runs_at_the_run_level():
    # async with the rollout always decoding (a slow replica, long responses): the
    # trainer is at the run's level all through its phase.
    p = profile(rate=50.0, lengths=[1000], update_s=0.1)
    p.trainer.run_level, p.trainer.contended = 3.0, True
    r = simulate(config(steps=3), p)
    # Step 1 takes the warm-up batch, the second one ended with it and the bound admits no
    # third before the first sync: nothing decodes, the trainer is alone. From step 2 on,
    # the next batch decodes (5120 s of it) all through the train phase.
    assert [s.train_s for s in r.steps] == pytest.approx([0.2, 0.6, 0.6], rel=1e-6)


def test_a_profile_without_the_contended_field_takes_it_from_its_job():
    for job, expected in (
        ({"device": "cpu"}, True),
        ({"device": "cuda", "overrides": ["runtime.share_trainer_gpu=true"]}, True),
        ({"device": "cuda", "overrides": []}, False),
    ):
        raw = json.loads(Profile(job=job).to_json())
        del raw["trainer"]["contended"]
        assert Profile.from_dict(raw).trainer.contended is expected, job
