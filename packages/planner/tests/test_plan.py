"""`offbeat plan`: the sweep, its ranking, the overrides it prints (they must pass
`offbeat check`), `--predict`'s line, and the profile's JSON round trip."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from offbeat.core.cli import load_recipe_config
from offbeat.core.cli import main as cli_main
from offbeat.planner import (
    PlanRequest,
    Profile,
    RolloutProfile,
    SyncProfile,
    TrainerPoint,
    TrainerProfile,
    ValidationProfile,
    plan,
    predict,
)
from offbeat.planner.plan import candidates, replica_devices_of

PREDICT = re.compile(
    r"^predicted: step_s=(\d+\.\d+) trainer_idle=(\d+\.\d+) rollout_idle=(\d+\.\d+) "
    r"tokens_per_s=(\d+\.\d+)$"
)


def a_profile() -> Profile:
    """Shaped like the default CPU job's: a trainer-bound tiny model."""
    return Profile(
        trainer=TrainerProfile(
            points=[
                TrainerPoint(
                    seq_len=16, rows=128, forward_s=0.08, backward_s=0.25, optimizer_s=0.02
                ),
                TrainerPoint(
                    seq_len=128, rows=128, forward_s=0.5, backward_s=1.5, optimizer_s=0.02
                ),
            ]
        ),
        rollout=RolloutProfile(
            concurrency=[1, 8, 64, 128],
            tokens_per_s=[100, 600, 2500, 3000],
            response_lengths=[1, 2, 2, 2, 3, 4],
            max_num_seqs=128,
        ),
        sync=SyncProfile(bytes=5_000_000, transfer_gbps=0.5, abort_s=0.005, fixed_s=0.04),
        validation=ValidationProfile(prompts=64, response_tokens=2.0, seconds=0.3),
        job={"device": "cpu", "prompt_len_mean": 8.0},
    )


@pytest.fixture
def profile_path(tmp_path):
    return a_profile().save(tmp_path / "p.json")


def test_profile_json_round_trip(profile_path):
    p = Profile.load(profile_path)
    assert p == a_profile()
    with pytest.raises(ValueError, match="schema"):
        Profile.from_dict({"schema": "other"})


def test_predict_prints_one_parsable_line(profile_path, capsys):
    assert cli_main(["plan", "separate_async", "--predict", "--profile", str(profile_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and PREDICT.match(out[0]), out
    step_s, trainer_idle, rollout_idle, tps = map(float, PREDICT.match(out[0]).groups())
    assert step_s > 0 and 0 <= trainer_idle <= 1 and 0 <= rollout_idle <= 1 and tps > 0


def test_predict_follows_the_config(profile_path):
    _, cfg = load_recipe_config("separate_async", [])
    _, sync = load_recipe_config("separate_async", ["trainer.mode=sync"])
    a, s = predict(cfg, a_profile()), predict(sync, a_profile())
    assert s.step_s > a.step_s  # sync adds generation to every step
    assert s.staleness.keys() == {0}


@pytest.mark.parametrize(("devices", "nodes"), [(2, 1), (8, 1), (16, 2)])
def test_plan_ranks_and_its_overrides_pass_check(devices, nodes, profile_path, capsys):
    base = ["resources.device=cpu"]
    code = cli_main(
        ["plan", "separate_async", *base, "--devices", str(devices), "--nodes", str(nodes),
         "--profile", str(profile_path), "--steps", "6"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert (
        "scaling assumptions" in out and "replicas on devices of their own are independent" in out
    )
    rows = [line for line in out.splitlines() if re.match(r"^\| \d+ \|", line)]
    steps = [float(line.split("|")[5]) for line in rows]
    assert rows and steps == sorted(steps)  # ranked fastest first
    command = out.strip().splitlines()[-1].strip()
    assert command.startswith("offbeat run separate_async ")
    words = command.split()[3:]
    assert f"resources.num_nodes={nodes}" in words
    # the printed overrides are a valid config, as `offbeat check` sees it
    assert cli_main(["check", "separate_async", *words]) == 0, words


def test_candidates_respect_the_config_rules():
    _, cfg = load_recipe_config("separate_async", [])
    req = PlanRequest(devices=16, nodes=2)
    cands = candidates(cfg, req, a_profile())
    rows = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    assert cands
    for c in cands:
        assert c.trainer_devices + c.rollout_devices == 16
        assert rows % c.trainer_devices == 0
        assert c.tp <= 8 and c.rollout_devices % c.tp == 0
        if c.strategy == "drop" and c.mode == "separate_async":
            assert c.num_warmup_batches + 1 <= c.threshold  # BufferConfig's rule


def test_more_replicas_help_a_rollout_bound_job():
    slow = a_profile()
    slow.rollout.tokens_per_s = [5, 30, 120, 150]  # rollout-bound now
    _, cfg = load_recipe_config("separate_async", [])
    cfg.resources.device = "cuda"  # replicas on GPUs of their own (no GPU needed to plan)
    ranked = plan(cfg, PlanRequest(devices=8, steps=6), slow)
    best = ranked[0]
    assert best.rollout_devices > best.trainer_devices
    assert best.result.step_s < ranked[-1].result.step_s
    assert all(c.replica_devices == () for c in ranked)


def test_replicas_on_the_same_cores_share_a_device():
    _, cfg = load_recipe_config("separate_async", [])  # runtime.rollout_cpus=[0]
    assert replica_devices_of(cfg, 1) == ()
    assert replica_devices_of(cfg, 2) == (0, 0)  # share_of gives both core 0
    cfg.runtime.rollout_cpus = [0, 1, 2, 3]
    assert replica_devices_of(cfg, 2) == (0, 1)  # two cores each
    assert replica_devices_of(cfg, 4) == (0, 1, 2, 3)
    cfg.runtime.rollout_cpus = []
    assert replica_devices_of(cfg, 3) == (0, 0, 0)  # unpinned: the machine's cores
    cfg.resources.device = "cuda"
    assert replica_devices_of(cfg, 4) == ()  # each replica its own GPUs
    # the job's own placement reaches the simulator
    _, two = load_recipe_config(
        "separate_async", ["resources.devices_per_node=3", "resources.rollout_devices=2"]
    )
    assert predict(two, a_profile(), steps=3).config.replica_devices == (0, 0)


def test_missing_profile_says_how_to_make_one(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "offbeat.core.cli", "plan", "separate_async", "--devices", "4",
         "--profile", str(tmp_path / "none.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0
    assert "offbeat profile separate_async" in r.stderr


def test_profile_with_a_bad_override_fails_before_starting_anything(capsys):
    # the config is checked first: no Ray, no engine for a value the config rejects
    assert cli_main(["profile", "separate_async", "rollout.n=0"]) == 2
    assert "rollout.n" in capsys.readouterr().err


def test_the_offbeat_script_lists_profile_and_plan(capsys):
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    out = capsys.readouterr().out
    assert "profile" in out and "plan" in out
