"""A dead OPD teacher replica and a dead GenRM judge replica are replaced, the calls in
flight on them retried on the replacement, and in a training run every prompt is trained
once or counted failed with a reason (fakes: no Ray, no engine)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from trainer_fakes import Harness, check_accounting

from offbeat.core.distill import TeacherPool, TeacherRouter, TeacherScoringError
from offbeat.core.distill.agent_loop import DistillAgentLoop
from offbeat.core.rewards import RewardRegistry, genrm
from offbeat.core.rewards.genrm import GenRMConfig, GenRMJudge
from offbeat.core.rewards.genrm_replicas import BalancedJudgeTransport, GenRMStepHook
from offbeat.core.trainer.replicas import Replacement


class Teacher:
    """Scores token t as -t/100 (`bias` added). `hold`: calls wait until `kill()` (which
    fails them, as a dead actor's calls fail) or forever; `die_after`: the call of that
    number kills it. Dead, its calls and its probe (`refresh`) raise."""

    def __init__(self, *, hold: bool = False, die_after: int | None = None, bias=0.0):
        self.hold, self.die_after, self.bias = hold, die_after, bias
        self.dead = False
        self.calls: list[list[int]] = []
        self._gate = asyncio.Event()

    def kill(self) -> None:
        self.dead = True
        self._gate.set()

    async def refresh(self) -> int:
        if self.dead:
            raise ConnectionError("actor died")
        return 0

    async def compute_log_probs(self, request_id, token_ids, start):
        self.calls.append(list(token_ids))
        if self.die_after is not None and len(self.calls) >= self.die_after:
            self.kill()
        if self.hold and not self.dead:
            await self._gate.wait()
        if self.dead:
            raise ConnectionError("actor died")
        await asyncio.sleep(0)
        return [self.bias - t / 100 for t in token_ids[start:]]


class Starts:
    """A `Replacement.start`: a fresh Teacher (or `make()`) after `delay_s`."""

    def __init__(self, make=None, delay_s: float = 0.02) -> None:
        self.make, self.delay_s = make or (lambda: Teacher(bias=-1.0)), delay_s
        self.calls: list[tuple[str, str]] = []
        self.started: dict[str, object] = {}

    async def __call__(self, dead_id, new_id, dead):
        self.calls.append((dead_id, new_id))
        await asyncio.sleep(self.delay_s)
        self.started[new_id] = out = self.make()
        return out


# ---- the teacher pool ----------------------------------------------------------------------


async def test_in_flight_scoring_on_a_killed_teacher_is_retried_on_its_replacement():
    old, starts = Teacher(hold=True), Starts()
    pool = TeacherPool(
        {"math": {"math-0": old}}, max_retries=1, retry_delay_s=0, timeout_s=5,
        replacements={"math": Replacement(starts, attempts=2, backoff_s=0.0)},
    )  # fmt: skip
    calls = [asyncio.ensure_future(pool.score("math", [1, 2, 3, i], 2)) for i in range(4)]
    while len(old.calls) < 4:  # all four in flight on the one replica
        await asyncio.sleep(0)
    old.kill()
    out = await asyncio.wait_for(asyncio.gather(*calls), 5)
    # scored by the replacement (bias -1), each once
    assert out == [[-1.03, -1.0 - i / 100] for i in range(4)]
    new = starts.started["math-0-r1"]
    assert sorted(c[-1] for c in new.calls) == [0, 1, 2, 3]
    assert starts.calls == [("math-0", "math-0-r1")]  # one replacement for four failures
    s = pool.summary()["math"]
    assert s["replaced"] == {"math-0": "math-0-r1"} and "actor died" in s["removed"]["math-0"]
    assert list(pool.servers["math"]) == ["math-0-r1"] and set(pool.started) == {"math-0-r1"}
    m = pool.drain_metrics()
    assert m["distill/math/score_errors"] == 4 and m["distill/math/score_calls"] == 4


async def test_a_teacher_retry_waits_for_a_replacement_slower_than_its_timeout():
    old, starts = Teacher(hold=True), Starts(delay_s=0.5)
    pool = TeacherPool(
        {"math": {"math-0": old}}, max_retries=1, retry_delay_s=0, timeout_s=0.2,
        replacements={"math": Replacement(starts, attempts=2, backoff_s=0.0)},
    )  # fmt: skip
    call = asyncio.ensure_future(pool.score("math", [1, 2, 3], 2))
    while not old.calls:
        await asyncio.sleep(0)
    old.kill()
    assert await asyncio.wait_for(call, 5) == [-1.03]


async def test_with_no_replacement_a_dead_teacher_fails_fast_naming_it():
    old = Teacher(hold=True)
    pool = TeacherPool({"math": {"math-0": old}}, max_retries=3, retry_delay_s=0, timeout_s=5)
    call = asyncio.ensure_future(pool.score("math", [1, 2, 3], 2))
    while not old.calls:
        await asyncio.sleep(0)
    old.kill()
    with pytest.raises(TeacherScoringError, match=r"after 1 attempts.*no replica left"):
        await asyncio.wait_for(call, 5)  # not 3 more attempts waiting for nobody
    assert len(old.calls) == 1


# ---- the judge's transport -----------------------------------------------------------------


class Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class Judge(Teacher):
    """A judge replica: says `reply`; held, killed and probed as `Teacher`."""

    def __init__(self, reply: str, **kw) -> None:
        super().__init__(**kw)
        self.reply = reply

    async def generate(self, request_id, prompt_ids, params):
        await self.compute_log_probs(request_id, list(prompt_ids), 0)
        return SimpleNamespace(token_ids=[ord(c) for c in self.reply])


async def test_in_flight_judge_calls_on_a_killed_judge_are_retried_on_its_replacement():
    cfg = GenRMConfig(retries=1, timeout_s=5)
    old = Judge("ok 2", hold=True)
    starts = Starts(make=lambda: Judge("ok 9"), delay_s=0.05)
    transport = BalancedJudgeTransport(
        {"judge-0": old}, Tok(), cfg, replacement=Replacement(starts, 2, 0.0)
    )
    judge = GenRMJudge(cfg, post=transport, urls=["balancer"])
    calls = [asyncio.ensure_future(judge.score("q", f"r{i}")) for i in range(5)]
    while len(old.calls) < 5:
        await asyncio.sleep(0)
    old.kill()
    assert await asyncio.wait_for(asyncio.gather(*calls), 5) == [0.9] * 5
    assert len(starts.started["judge-0-r1"].calls) == 5
    assert transport.removed == ["judge-0"] and judge.replaced_replicas == {"judge-0": "judge-0-r1"}
    assert transport.balancer.servers() == ["judge-0-r1"] and judge.errors == 5
    hook = GenRMStepHook(judge)
    metrics: dict = {}
    hook.after_step(1, [], None, metrics)
    assert metrics["genrm/replicas_removed"] == 1 and metrics["genrm/replicas_replaced"] == 1
    assert hook.summary()["replaced_replicas"] == {"judge-0": "judge-0-r1"}
    assert hook.summary()["served_by_replica"] == {"judge-0-r1": 5}  # none answered by judge-0

    # The end of the run: the job shuts the replacement down through the extension seam
    # (`JobExtension.replacements`), as for OPD's teachers, not the hook by itself.
    from offbeat.core.rewards.genrm_extension import GenRMExtension
    from offbeat.core.trainer import elastic
    from offbeat.core.trainer.extension import close_extensions

    await hook.close()
    assert list(hook.replacements()) == ["judge-0-r1"]
    ext = GenRMExtension()
    ext.hook = hook
    shut: list[str] = []

    async def shutdown(servers):
        shut.extend(servers)

    real, elastic.shutdown_replicas = elastic.shutdown_replicas, shutdown
    try:
        await close_extensions([ext])
    finally:
        elastic.shutdown_replicas = real
    assert shut == ["judge-0-r1"]


async def test_a_judge_call_waits_for_the_replacement_beyond_its_own_timeout():
    """The replacement's start takes longer than the judge's per-call timeout: the retry
    waits for it outside that timeout (`settle`) instead of failing its retries on an
    empty balancer."""
    cfg = GenRMConfig(retries=1, timeout_s=0.2)
    old = Judge("ok 2", hold=True)
    starts = Starts(make=lambda: Judge("ok 7"), delay_s=0.5)
    transport = BalancedJudgeTransport(
        {"judge-0": old}, Tok(), cfg, replacement=Replacement(starts, 2, 0.0)
    )
    judge = GenRMJudge(cfg, post=transport, urls=["balancer"])
    call = asyncio.ensure_future(judge.score("q", "r"))
    while not old.calls:
        await asyncio.sleep(0)
    old.kill()
    assert await asyncio.wait_for(call, 5) == 0.7


async def test_with_no_replacement_a_dead_only_judge_fails_the_call_at_once():
    cfg = GenRMConfig(retries=4, timeout_s=5)
    transport = BalancedJudgeTransport({"judge-0": Judge("ok 2", die_after=1)}, Tok(), cfg)
    judge = GenRMJudge(cfg, post=transport, urls=["balancer"])
    with pytest.raises(genrm.RewardError, match="failed 1 times"):
        await asyncio.wait_for(judge.score("q", "r"), 5)


# ---- accounting in a training run ----------------------------------------------------------


def test_a_run_whose_only_teacher_dies_trains_every_group_once(tmp_path):
    old, starts = Teacher(die_after=12), Starts()
    pools: list[TeacherPool] = []

    def wrap(agent):
        pool = TeacherPool(
            {"t": {"t-0": old}}, max_retries=2, retry_delay_s=0, timeout_s=10,
            replacements={"t": Replacement(starts, attempts=2, backoff_s=0.0)},
        )  # fmt: skip
        pools.append(pool)
        return DistillAgentLoop(agent, TeacherRouter(["t"], default="t"), pool)

    h = Harness(tmp_path, total_training_steps=4, wrap_agent=wrap, max_failures=1)
    summary = asyncio.run(h.run())
    assert summary["steps"] == 4
    assert old.dead and starts.calls == [("t-0", "t-0-r1")]
    assert len(starts.started["t-0-r1"].calls) > 0  # the rest were scored by the replacement
    c = h.buffer.core.counts()
    assert c["failed"] == 0, h.driver.errors
    check_accounting(h)  # no group trained twice, every submitted one accounted for
    assert pools[0].summary()["t"]["replaced"] == {"t-0": "t-0-r1"}


def test_a_run_whose_only_judge_dies_trains_every_group_once(tmp_path):
    cfg = GenRMConfig(retries=2, timeout_s=10)
    old = Judge("ok 6", die_after=10)
    starts = Starts(make=lambda: Judge("ok 6"))
    transport = BalancedJudgeTransport(
        {"judge-0": old}, Tok(), cfg, replacement=Replacement(starts, 2, 0.0)
    )
    judge = GenRMJudge(cfg, post=transport, urls=["balancer"])

    def wrap(agent):
        agent.rewards = RewardRegistry(name="genrm")  # every row scored by the judge
        return agent

    h = Harness(tmp_path, total_training_steps=4, wrap_agent=wrap, max_failures=1)

    async def main():
        genrm.install(judge)
        try:
            return await h.run()
        finally:
            genrm.install(None)

    assert asyncio.run(main())["steps"] == 4
    assert old.dead and transport.replaced == {"judge-0": "judge-0-r1"}
    assert len(starts.started["judge-0-r1"].calls) > 0
    assert h.buffer.core.counts()["failed"] == 0, h.driver.errors
    check_accounting(h)
