"""Automatic restarts after a dead trainer rank (offbeat.core.trainer.restart), with a
fake job function: no Ray, no engine. The real rank death and resume run in
test_runtime_failure.py."""

from __future__ import annotations

import asyncio
import logging

import pytest
from ray.exceptions import ActorDiedError

from offbeat.core.config import ConfigError, validate
from offbeat.core.config.run import RunConfig
from offbeat.core.runtime import TrainerRankFailed
from offbeat.core.trainer.report import print_report
from offbeat.core.trainer.restart import max_restarts, restart_cause, run_with_restarts
from offbeat.core.trainer.watchdog import StallError


def dead_rank(step: int = 3) -> TrainerRankFailed:
    return TrainerRankFailed(1, "update", step, ActorDiedError())


def cfg(save_freq: int = 5, restarts: int | None = None) -> RunConfig:
    c = RunConfig()
    c.trainer.save_freq = save_freq
    c.trainer.max_restarts = restarts
    return c


class FakeJob:
    """Fails with `failures[i]` on call i (None: succeeds); records each call's resume."""

    def __init__(self, *failures: BaseException | None) -> None:
        self.failures = list(failures)
        self.resumed: list[bool] = []

    async def __call__(self, c: RunConfig) -> dict:
        self.resumed.append(c.trainer.resume)
        await asyncio.sleep(0)
        failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            raise failure
        return {"steps": c.trainer.total_training_steps}


def test_a_dead_rank_restarts_with_resume_on_and_the_summary_counts_it(caplog):
    job = FakeJob(dead_rank(3), dead_rank(7), None)
    c = cfg(restarts=2)
    with caplog.at_level(logging.WARNING, logger="offbeat.core.trainer.restart"):
        summary = asyncio.run(run_with_restarts(job, c))
    assert job.resumed == [False, True, True]
    assert c.trainer.resume is False  # the caller's config is left as it was
    assert summary["restarts"] == 2 and summary["steps"] == c.trainer.total_training_steps
    assert summary["restart_causes"][1].startswith(
        "trainer rank 1 failed in update during global step 7: ActorDiedError"
    )
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("restart 1/2 from the last checkpoint (trainer.max_restarts): "
                              "trainer rank 1 failed in update during global step 3")  # fmt: skip
    assert said[1].startswith("restart 2/2 ")


def test_it_gives_up_after_the_limit_with_the_last_failure():
    last = dead_rank(9)
    job = FakeJob(dead_rank(3), dead_rank(5), last, None)
    with pytest.raises(TrainerRankFailed) as e:
        asyncio.run(run_with_restarts(job, cfg(restarts=2)))
    assert e.value is last and job.resumed == [False, True, True]


def test_a_run_without_failure_reports_no_restart(capsys):
    summary = asyncio.run(run_with_restarts(FakeJob(None), cfg()))
    assert summary["restarts"] == 0 and summary["restart_causes"] == []


@pytest.mark.parametrize(
    "error",
    [
        ValueError("reward function raised"),  # a user's reward: the same on every run
        TrainerRankFailed(0, "update", 4, RuntimeError("CUDA error")),  # the rank raised
        TrainerRankFailed(1, "update", 4, TimeoutError("ranks [1] gave no answer")),
        StallError("the stalled stage is update", "update", None),
        KeyboardInterrupt(),
    ],
    ids=["user-error", "rank-raised", "rank-timeout", "stall", "ctrl-c"],
)
def test_other_failures_never_restart(error):
    job = FakeJob(error, None)
    with pytest.raises(type(error)):
        asyncio.run(run_with_restarts(job, cfg(restarts=2)))
    assert job.resumed == [False]


def test_a_dead_rank_found_through_causes_and_groups():
    inner = dead_rank()
    try:
        try:
            raise inner
        except TrainerRankFailed as e:
            raise RuntimeError("the sync failed") from e
    except RuntimeError as outer:
        wrapped = outer
    assert restart_cause(wrapped) is inner
    assert restart_cause(ExceptionGroup("tasks", [ValueError("x"), wrapped])) is inner
    assert restart_cause(ValueError("no rank")) is None


def test_max_restarts_auto_needs_checkpoints_mid_run():
    assert max_restarts(cfg(save_freq=5).trainer) == 2
    assert max_restarts(cfg(save_freq=0).trainer) == 0
    assert max_restarts(cfg(save_freq=-1).trainer) == 0
    assert max_restarts(cfg(save_freq=0, restarts=0).trainer) == 0
    assert max_restarts(cfg(save_freq=5, restarts=4).trainer) == 4
    job = FakeJob(dead_rank(), None)  # auto without checkpoints: no restart
    with pytest.raises(TrainerRankFailed):
        asyncio.run(run_with_restarts(job, cfg(save_freq=0)))


@pytest.mark.parametrize(
    ("save_freq", "restarts", "says"),
    [
        (0, 2, "trainer.max_restarts=2: needs checkpoints mid-run to restart from: "
               "trainer.save_freq > 0 (it is 0: only at the end)"),
        (-1, 1, "(it is -1: never)"),
        (5, -1, "trainer.max_restarts=-1: must be an int >= 0"),
        (5, "two", "or null (auto: 2 when trainer.save_freq > 0, else 0)"),
    ],
)  # fmt: skip
def test_config_check_refuses_restarts_that_cannot_work(save_freq, restarts, says):
    with pytest.raises(ConfigError) as e:
        validate(cfg(save_freq, restarts))
    assert says in str(e.value)


def test_the_report_says_the_restarts(capsys):
    summary = {
        "steps": 3, "version": 3, "total_wall_s": 61.2, "startup_s": 20.4, "val_history": [],
        "counts": {"submitted": 40, "trained": 24, "evicted": 1, "failed": 2,
                   "pending": 3, "running": 4, "finished": 6},
        "metrics": "m.jsonl", "plot": "p.png", "restarts": 1,
        "restart_causes": ["trainer rank 1 failed in update during global step 3: X"],
    }  # fmt: skip
    print_report(summary, "r")
    assert ("restarts after a dead trainer rank: 1 (trainer rank 1 failed in update during "
            "global step 3: X)") in capsys.readouterr().out  # fmt: skip
