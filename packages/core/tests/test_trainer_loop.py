"""The training loop with fakes (see `trainer_fakes`): versions, staleness bounds,
evictions and their refills, old-policy log-probs, accounting, resume and replica failure.
Failing rollouts: test_trainer_failures.py; the event loop: test_event_loop.py."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from trainer_fakes import FakeTokenizer, Harness, check_accounting

from offbeat.core.rewards import RewardRegistry, register_reward
from offbeat.core.rollout import TokenOutput
from offbeat.core.tasks import PromptDataLoader, make_rows, write_parquet
from offbeat.core.trace import MAIN_TRACK, Tracer, nesting_problems
from offbeat.core.trainer import SingleTurnAgentLoop
from offbeat.core.trainer.watchdog import StallError


async def test_separate_async_three_steps_versions_spans_evictions(tmp_path):
    # g0 and g1 (submitted at step 1) are stragglers: they produce nothing until step 3,
    # so they finish at span 3 > max_off_policy_threshold=2 and must be evicted. Step 3's
    # other groups wait until both are gone, so step 3 cannot take its batch before they
    # finish (and escape eviction by the end of the run).
    stragglers = ("g0", "g1")

    def hold(request_id):
        uid = request_id.split("-")[0]
        if not uid.startswith("g"):
            return False  # validation requests
        if uid in stragglers:
            return h.trainer.step < 3
        gone = h.buffer.core.ledger()
        return h.trainer.step == 3 and any(g not in gone for g in stragglers)

    h = Harness(tmp_path, threshold=2, strategy="drop", warmup=1)
    h.servers["s0"].hold = hold
    summary = await h.run()
    assert summary["steps"] == 3 and summary["version"] == 3
    assert [r.version for r in h.trainer.sync_results] == [1, 2, 3]
    assert all(r.ok for r in h.trainer.sync_results)
    assert h.servers["s0"].weight_version == 3
    assert torch.equal(h.servers["s0"].weights["model.w"], h.engine.w)
    train_rows = [r for r in h.rows() if "reward/mean" in r]
    assert [r["weight_version"] for r in train_rows] == [1.0, 2.0, 3.0]
    # Evictions: both stragglers, at step 3, at span 3; none trained; the rows count them.
    assert h.buffer.evicted_spans == {"g0": 3, "g1": 3}
    assert sorted(h.trainer.evicted_uids) == ["g0", "g1"]
    assert h.buffer.core.counts()["evicted"] == 2
    assert [r["buffer/evicted"] for r in train_rows] == [0.0, 0.0, 2.0]
    # No trained group above the threshold (the buffer's spans and the rows' agree).
    assert set(h.buffer.trained_spans) == set(h.trainer.trained_uids)
    assert max(h.buffer.trained_spans.values()) <= 2, h.buffer.trained_spans
    assert max(r["off_policy/trajectory_spans_max"] for r in train_rows) <= 2
    # Refills: step 1 admits the pipeline (2 batches); each later step admits the slots its
    # predecessor trained plus exactly one per group evicted at that step.
    gps = h.settings.data.train_batch_size
    assert dict(h.buffer.submitted_at) == {1: 2 * gps, 2: gps, 3: gps + 2}
    # Accounting: every submitted uid is trained, evicted or live, exactly once.
    trained, evicted = set(h.trainer.trained_uids), set(h.trainer.evicted_uids)
    live = set(h.buffer.core.live_uids())
    assert not (trained & evicted) and not ((trained | evicted) & live)
    submitted = {f"g{i}" for i in range(h.buffer.core.counts()["submitted"])}
    assert trained | evicted | live == submitted and len(submitted) == 4 + 2 + 4
    # 2 updates (parameter_sync_step) per step, each on ppo_mini_batch_size*n rows
    assert h.engine.updates == 6
    assert all(b["input_ids"].shape[0] == 2 for b in h.engine.batches)
    # bypass: the old policy is the behaviour policy, nothing is recomputed
    assert h.engine.recomputed == []
    assert all(torch.equal(b["old_log_probs"], b["rollout_log_probs"]) for b in h.engine.batches)
    check_accounting(h)
    assert any("val/reward" in r for r in h.rows())
    assert not h.checkpoints.complete()


async def test_wait_threshold_one_is_on_policy(tmp_path):
    h = Harness(tmp_path, threshold=1, strategy="wait", warmup=3)
    await h.run()
    train_rows = [r for r in h.rows() if "reward/mean" in r]
    assert all(r["off_policy/trajectory_spans_max"] == 1 for r in train_rows)
    assert all(r["off_policy/trajectory_staleness_max"] == 0 for r in train_rows)
    check_accounting(h)


async def test_sync_mode_is_on_policy_and_never_interrupts(tmp_path):
    h = Harness(tmp_path, mode="sync", servers=2)
    await h.run()
    train_rows = h.train_rows()
    assert len(train_rows) == 3
    assert all(r["off_policy/trajectory_spans_max"] == 1 for r in train_rows)
    assert all(r["off_policy/trajectory_staleness_max"] == 0 for r in train_rows)
    for server in h.servers.values():
        # every sync paused the replica, and no request was in flight to be interrupted
        assert server.aborted_calls == 3
        assert server.interrupted == 0


async def test_decoupled_ppo_uses_start_of_step_weights(tmp_path):
    h = Harness(tmp_path, old_log_prob_source="trainer")
    await h.run()
    # one proximal forward per step, before that step's 2 updates
    assert h.engine.log_prob_calls == [0, 2, 4]
    # each update trained against the recomputed log-probs of its own rows, not the rollout's
    rows = h.settings.actor.ppo_mini_batch_size * h.settings.rollout.n
    assert len(h.engine.batches) == 6
    for u, mb in enumerate(h.engine.batches):
        step, k = divmod(u, h.settings.async_training.parameter_sync_step)
        recomputed = h.engine.recomputed[step][k * rows : (k + 1) * rows]
        assert torch.equal(mb["old_log_probs"], recomputed)
        assert not torch.equal(mb["old_log_probs"], mb["rollout_log_probs"])


async def test_drop_mode_evictions_are_counted_and_refilled(tmp_path):
    # g0 (submitted at step 1) is a straggler: it produces nothing until step 3, so it
    # finishes at span >= 3 > max_off_policy_threshold=2 and must be evicted, not trained.
    h = Harness(tmp_path, threshold=2, strategy="drop", warmup=1, total_training_steps=5)
    for server in h.servers.values():
        server.hold = lambda request_id: request_id.startswith("g0-") and h.trainer.step < 3
    await h.run()
    assert "g0" in h.trainer.evicted_uids and "g0" not in h.trainer.trained_uids
    assert h.servers["s0"].interrupted >= 2  # the held g0 requests, by the syncs of steps 1, 2
    assert h.buffer.core.ledger()["g0"] == "evicted"
    rows = h.train_rows()
    evicted_at = {int(r["step"]): int(r["buffer/evicted"]) for r in rows}
    assert sum(evicted_at.values()) == len(h.trainer.evicted_uids) >= 1
    assert rows[-1]["buffer/evicted_total"] == h.buffer.core.counts()["evicted"]
    # Refills: step 1 admits the pipeline (2 batches of 2); each later step admits the 2
    # slots its predecessor trained plus exactly one per group evicted at that step.
    gps = h.settings.data.train_batch_size
    expected = {1: 2 * gps} | {s: gps + evicted_at[s] for s in range(2, 6)}
    assert dict(h.buffer.submitted_at) == expected
    assert h.buffer.core.counts()["failed"] == 0
    check_accounting(h)


async def test_reward_errors_fail_the_group_not_the_run(tmp_path):
    register_reward("flaky_source", lambda r, g, **_: 1 / 0 if g == "boom" else 1.0)
    rows = make_rows("reverse", 32, seed=1)
    for i, r in enumerate(rows):
        r["data_source"] = "flaky_source"
        r["ground_truth"] = "boom" if i % 2 == 0 else "ok"
    h = Harness(tmp_path, rows=rows)
    summary = await h.run()
    assert summary["steps"] == 3
    assert h.buffer.core.counts()["failed"] >= 1, h.driver.errors
    assert h.driver.groups_failed == h.buffer.core.counts()["failed"]
    check_accounting(h)


async def test_resume_continues_at_next_step_with_same_version(tmp_path):
    h1 = Harness(tmp_path, total_training_steps=2, save_freq=1)
    await h1.run()
    assert [s for s, _ in h1.checkpoints.complete()] == [1, 2]
    w_after_2 = h1.engine.w.clone()
    h2 = Harness(tmp_path, total_training_steps=3, save_freq=1, resume=True)
    summary = await h2.run()
    assert summary["steps"] == 3 and summary["version"] == 3
    # replicas were brought to version 2 (the restored weights) before step 3
    assert [r.version for r in h2.trainer.sync_results] == [3]
    assert h2.engine.updates == 6 and torch.equal(h2.engine.w, w_after_2 + 2)
    assert h2.trainer.trained_uids[: len(h1.trainer.trained_uids)] == h1.trainer.trained_uids
    check_accounting(h2)


async def test_dead_replica_is_removed_and_training_continues(tmp_path):
    h = Harness(tmp_path, servers=2, total_training_steps=4, tick_s=0.002)

    async def kill_later():
        while h.trainer.step < 2:
            await asyncio.sleep(0.005)
        h.servers["s1"].dead = True

    killer = asyncio.create_task(kill_later())
    summary = await h.run()
    await killer
    assert summary["steps"] == 4
    assert "s1" in h.pool.removed and h.pool.server_ids == ["s0"]
    assert h.servers["s0"].weight_version == 4
    assert h.buffer.core.counts()["failed"] == 0  # interrupted requests finished elsewhere
    check_accounting(h)


async def test_null_per_row_sampling_overrides_are_ignored(tmp_path):
    rows = make_rows("reverse", 16, seed=2)
    for i, r in enumerate(rows):  # parquet turns the missing keys into nulls
        r["sampling"] = {"max_tokens": 3, "ignore_eos": True} if i % 2 else {}
    write_parquet(rows, tmp_path / "rows.parquet")
    stored = PromptDataLoader(tmp_path / "rows.parquet", shuffle=False).next(16)
    assert stored[0]["sampling"] == {"max_tokens": None, "ignore_eos": None}
    seen = []

    class Client:
        async def generate(self, request_id, prompt_ids, params):
            seen.append(dict(params))
            return TokenOutput([65], [-0.1], "stop", 0)

    agent = SingleTurnAgentLoop(Client(), FakeTokenizer(), RewardRegistry(), {"max_tokens": 8})
    await agent.sample("g0", stored[0], 1)
    await agent.sample("g1", stored[1], 1)
    assert seen == [{"max_tokens": 8}, {"max_tokens": 3, "ignore_eos": True}]


async def test_a_hung_rollout_fails_the_run_instead_of_hanging(tmp_path):
    h = Harness(tmp_path, stall_timeout_s=0.3)

    async def never(*args, **kwargs):
        await asyncio.Event().wait()

    h.servers["s0"].generate = never
    with pytest.raises(StallError, match=r"trainer\.stall_timeout_s=0\.3") as e:
        await asyncio.wait_for(h.trainer.run(), 30)
    assert e.value.stage == "generation[s0]"


def test_an_unknown_mode_is_rejected_before_the_trainer_starts():
    """trainer.mode has one check, the config rule: it names the key, the value and the
    modes the loop runs (`MODES`)."""
    from offbeat.core.config import ConfigError, JobConfig, validate
    from offbeat.core.trainer import MODES

    cfg = JobConfig()
    cfg.model.path, cfg.trainer.mode = "m", "fast"
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    mine = [str(x) for x in e.value.problems if x.key == "trainer.mode"]
    assert mine == [f"trainer.mode='fast': must be one of {', '.join(MODES)}"]


async def test_trace_has_steps_buffer_waits_train_syncs_and_lanes_per_replica(tmp_path):
    tracer = Tracer(tmp_path / "trace.json", steps=2)  # the first 2 of 3 steps
    h = Harness(tmp_path, servers=2, test_freq=1, old_log_prob_source="trainer", tracer=tracer)
    await h.run()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert nesting_problems(events) == []
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    tracks = {
        (e["pid"], e["tid"]): f"{procs[e['pid']]}/{e['args']['name']}"
        for e in events
        if e["name"] == "thread_name"
    }
    by_track: dict[str, list[dict]] = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault(tracks[(e["pid"], e["tid"])], []).append(e)
    main = by_track[MAIN_TRACK]
    steps = [e for e in main if e["name"].startswith("step ")]
    assert [e["name"] for e in steps] == ["step 1", "step 2"]  # step 3 is not traced
    phases = ["generate_wait", "old_log_prob", "train", "sync"]
    phases += ["abort", "release_kv", "transfer", "resume_kv", "resume"]
    for step in steps:
        inside = [
            e["name"]
            for e in main
            if e is not step and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]
        ]
        assert [n for n in inside if n in phases] == phases, inside
        assert inside.count("mini-batch") == 2  # parameter_sync_step
    # step 2 waited for the validation started after step 1's sync
    assert [e["name"] for e in main].count("validation_wait") == 1
    for sid in ("s0", "s1"):
        assert [e["name"] for e in by_track[f"{sid}/sync"]] == [
            "sync v1",
            *phases[4:],
            "sync v2",
            *phases[4:],
        ]
        lanes = [t for t in by_track if t.startswith(f"{sid}/lane ")]
        generates = [e for t in lanes for e in by_track[t]]
        assert generates and {e["name"] for e in generates} == {"generate"}
        assert all({"request", "tokens", "stop"} <= set(e["args"]) for e in generates)
