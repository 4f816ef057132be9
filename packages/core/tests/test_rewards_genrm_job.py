"""GenRM wired into the job, with fakes: judge replicas' own job config, the step hook,
groups judged concurrently, validation by the rule, the judge's SFT data and files."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from offbeat.core.config import JobConfig, RewardConfig
from offbeat.core.config.run import RunConfig
from offbeat.core.rewards import RewardError, RewardRegistry, genrm
from offbeat.core.rewards.genrm import GenRMConfig, GenRMJudge, parse_score
from offbeat.core.rewards.genrm_replicas import (
    GenRMStepHook,
    judge_job,
    judge_pools,
    start_judges,
    validation_agent,
)


def genrm_cfg(**genrm_keys):
    reward = RewardConfig(name="genrm", genrm=genrm_keys)
    cfg = dataclasses.replace(RunConfig(), reward=reward)
    rt = dataclasses.replace(cfg.runtime, rollout_cpus=[0], rollout_num_cpus=1.0)
    ro = dataclasses.replace(cfg.rollout, engine_kwargs={"max_model_len": 128, "seed": 0})
    model = dataclasses.replace(cfg.model, path="/policy", override_config={"x": 1})
    return dataclasses.replace(cfg, runtime=rt, rollout=ro, model=model)


def test_judge_job_has_its_own_model_devices_cpus_and_engine_kwargs():
    cfg = genrm_cfg(replicas=2, tensor_parallel_size=1, model_path="/judge", judge_num_cpus=0.5,
                    engine_kwargs={"max_model_len": 256})  # fmt: skip
    job = judge_job(cfg)
    assert job.model.path == "/judge" and job.model.override_config == {}
    assert job.resources.rollout_devices == 2
    assert job.rollout.engine_kwargs == {"max_model_len": 256, "seed": 0}
    assert job.runtime.rollout_cpus == [0] and job.runtime.rollout_num_cpus == 0.5
    assert cfg.model.path == "/policy"  # the policy's config is untouched
    job = judge_job(genrm_cfg(replicas=1, model_path="/judge", judge_cpus=[1]))
    assert job.runtime.rollout_cpus == [1]


def test_start_judges_uses_the_rollout_factory_on_the_judge_job_only_for_genrm(monkeypatch):
    from offbeat.core.registry import ROLLOUT_ENGINES

    started = []
    monkeypatch.setattr(ROLLOUT_ENGINES, "get", lambda name: lambda spec: started.append(
        (spec.job.resources.rollout_devices, spec.model_path, spec.index)) or f"server-{spec.index}")  # fmt: skip
    cfg = genrm_cfg(replicas=2, model_path="/judge")
    assert start_judges(cfg) == {"judge-0": "server-0", "judge-1": "server-1"}
    assert started == [(2, "/judge", 0), (2, "/judge", 1)]
    started.clear()
    assert start_judges(dataclasses.replace(cfg, reward=RewardConfig(genrm={"replicas": 2}))) == {}
    assert start_judges(genrm_cfg(url="http://j")) == {} and started == []


def test_judges_go_into_a_named_pool_of_their_own(monkeypatch):
    """`judge_pools`: "judge", a bundle per replica (judge_num_cpus CPUs each); each judge
    is started with the scheduling strategy of its bundle there."""
    from offbeat.core.registry import ROLLOUT_ENGINES

    cfg = genrm_cfg(replicas=2, model_path="/judge", judge_num_cpus=0.5)
    (pool,) = judge_pools(cfg)
    assert (pool.name, pool.bundles, pool.bundle) == ("judge", 2, {"CPU": 0.5})
    assert judge_pools(genrm_cfg(url="http://j")) == []
    assert judge_pools(dataclasses.replace(cfg, reward=RewardConfig(genrm={"replicas": 2}))) == []

    class Pools:
        def __init__(self) -> None:
            self.groups = {"judge": object()}

        def strategy(self, name, i):
            return (name, i)

    seen = []
    monkeypatch.setattr(ROLLOUT_ENGINES, "get", lambda name: lambda spec: seen.append(
        (spec.index, spec.ray_options)) or spec.index)  # fmt: skip
    assert start_judges(cfg, Pools()) == {"judge-0": 0, "judge-1": 1}
    assert seen == [(0, {"scheduling_strategy": ("judge", 0)}),
                    (1, {"scheduling_strategy": ("judge", 1)})]  # fmt: skip


class FakePost:
    """A judge server: 'right, 1' when the response equals the reference; tracks in-flight."""

    def __init__(self):
        self.calls, self.in_flight, self.max_in_flight = 0, 0, 0

    async def __call__(self, url, payload, timeout):
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        prompt = payload["prompt"]
        answer = prompt.split("Answer: ")[1].split("\n")[0]
        ref = prompt.split("Reference answer: ")[1].split("\n")[0]
        return {"choices": [{"text": "right, 1" if answer == ref else "wrong, 0"}]}


@pytest.fixture
def judge_on_a_loop():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    post = FakePost()
    judge = GenRMJudge(GenRMConfig(url="http://j", score_max=1, max_concurrency=4), post=post)
    genrm.install(judge, loop)
    yield judge, post
    genrm.install(None)
    loop.call_soon_threadsafe(loop.stop)
    t.join()


def test_group_is_judged_concurrently_once_per_distinct_response(judge_on_a_loop):
    judge, post = judge_on_a_loop
    reg = RewardRegistry(name="genrm")
    group = ["7", "8", "7", "9", "7", "10", "11", "12"]
    scores = reg.score_group("math", group, "7", {"question": "add: 3+4"})
    assert scores == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert post.calls == 6 and judge.cache_hits == 2  # "7" judged once
    assert 1 < post.max_in_flight <= 4  # concurrent, bounded by max_concurrency
    m = judge.metrics()
    assert m["genrm/rule_reward_mean"] == 3 / 8 and m["genrm/agreement_with_rule"] == 1.0


def test_score_group_without_a_group_scorer_scores_each_and_checks_the_count():
    reg = RewardRegistry()
    assert reg.score_group("exact_match", ["a", "b"], "a") == [1.0, 0.0]
    from offbeat.core.registry import REWARD_FUNCTIONS

    def short(response, ground_truth, **kw):
        return 0.0

    short.score_group = lambda responses, ground_truth, **kw: [1.0]
    REWARD_FUNCTIONS.register("short_group_test", short, override=True)
    try:
        with pytest.raises(RewardError, match="1 values"):
            RewardRegistry(name="short_group_test").score_group("x", ["a", "b"], "a")
    finally:
        REWARD_FUNCTIONS.unregister("short_group_test")


def test_step_hook_logs_metrics_and_totals_then_starts_a_new_step(judge_on_a_loop):
    judge, post = judge_on_a_loop
    reg = RewardRegistry(name="genrm")
    hook = GenRMStepHook(judge)
    reg.score_group("math", ["7", "7", "8"], "7", {"question": "q"})
    m1: dict = {}
    hook.after_step(1, [], None, m1)
    assert m1["genrm/judgments"] == 2 and m1["genrm/cache_hits"] == 1
    assert m1["genrm/score_mean"] == pytest.approx(2 / 3)
    reg.score_group("math", ["7"], "7", {"question": "q"})  # a new step: judged again
    m2: dict = {}
    hook.after_step(2, [], None, m2)
    assert m2["genrm/judgments"] == 1 and m2["genrm/cache_hits"] == 0
    assert m2["genrm/judgments_total"] == 3 and post.calls == 3
    assert hook.summary()["judgments"] == 3 and hook.summary()["removed_replicas"] == []
    asyncio.run(hook.close())
    with pytest.raises(RewardError, match="no judge installed"):
        reg.score("math", "7", "7")


def test_validation_scores_by_the_rule_only_with_val_reward_task():
    class Agent:
        rewards = RewardRegistry(name="genrm")

    agent = Agent()
    assert validation_agent(genrm_cfg(url="http://j"), agent) is agent
    assert validation_agent(JobConfig(), agent) is agent
    val = validation_agent(genrm_cfg(url="http://j", val_reward="task"), agent)
    assert val is not agent and agent.rewards.name == "genrm"
    assert val.rewards.score("math", "7", "7") == 1.0  # the rule, no judge installed


def test_validation_of_a_router_scores_every_loop_by_the_rule():
    from offbeat.core.agent.loops import AgentLoopRouter

    class Loop:
        def __init__(self, name: str) -> None:
            self.name, self.rewards = name, RewardRegistry(name="genrm")

    agent = AgentLoopRouter(Loop, "single_turn")
    val = validation_agent(genrm_cfg(url="http://j", val_reward="task"), agent)
    assert isinstance(val, AgentLoopRouter) and val is not agent
    for name in ("single_turn", "tool"):
        loop = val.loop(name)
        assert loop.name == name and loop.rewards.score("math", "7", "7") == 1.0
        assert agent.loop(name).rewards.name == "genrm"  # the training loops keep the judge


def test_judge_sft_rows_are_labelled_by_the_rule_and_hold_both_verdicts():
    from offbeat.core.rewards.genrm_sft import JudgeSFTConfig, judge_rows, verdict
    from offbeat.core.rewards.scorers import extract_answer, math_answer

    g = GenRMConfig(score_max=1, template="{question}|{response}|{reference}")
    rows = judge_rows(JudgeSFTConfig(n_train=400), g)
    right = [r for r in rows if r["rule"] == 1.0]
    assert 0.3 < len(right) / len(rows) < 0.7
    for r in rows:
        q, resp, ref = r["prompt"][0]["content"].split("|")
        assert q.startswith("add: ") and len(resp) <= 4
        assert r["rule"] == math_answer(resp, ref)
        assert r["ground_truth"] == verdict(r["rule"] == 1.0, g, extract_answer(resp), ref)
        assert r["ground_truth"].startswith(f"{extract_answer(resp) or '-'} vs {ref}: ")
        assert parse_score(r["ground_truth"], g) == r["rule"]  # the target parses as scored
    assert judge_rows(JudgeSFTConfig(n_train=400), g) == rows  # deterministic


def test_judge_sft_negatives_hold_a_policys_near_misses():
    """A policy's wrong answers are mostly near the answer ("11" for 12, 9 for 8): a judge
    trained on far-off numbers alone passed them. Same-length wrong numbers within 3 of
    the answer, and ones differing from it in one digit, must be common negatives."""
    from offbeat.core.rewards.genrm_sft import JudgeSFTConfig, judge_rows

    g = GenRMConfig(score_max=1)
    rows = judge_rows(JudgeSFTConfig(n_train=2000), g)
    wrong = [r for r in rows if r["rule"] == 0.0 and r["response"].isdigit()]
    near = [r for r in wrong if abs(int(r["response"]) - int(r["reference"])) <= 3]
    one_digit = [
        r for r in wrong
        if len(r["response"]) == len(r["reference"]) > 1
        and sum(a != b for a, b in zip(r["response"], r["reference"], strict=True)) == 1
    ]  # fmt: skip
    assert len(near) / len(wrong) > 0.35, (len(near), len(wrong))
    assert len(one_digit) >= 50, len(one_digit)
    assert any(r["response"] == "11" and r["reference"] == "12" for r in rows)


def test_judged_task_files_carry_the_question(tmp_path):
    from offbeat.core.rewards.genrm_job import write_judged_task_files
    from offbeat.core.tasks import read_parquet
    from offbeat.core.tasks.synthetic import SyntheticTaskConfig

    train, val = write_judged_task_files(
        SyntheticTaskConfig(name="add", n_train=5, n_val=3, min_len=1, max_len=1), tmp_path
    )
    rows = read_parquet(train)
    assert len(rows) == 5 and len(read_parquet(val)) == 3
    assert all(r["extra_info"]["question"] == r["prompt"][0]["content"] for r in rows)


def test_genrm_plot_is_written(tmp_path):
    from offbeat.core.rewards.genrm_job import plot_genrm

    history = [{"step": 1.0, "genrm/score_mean": 0.2, "genrm/rule_reward_mean": 0.25,
                "val/reward": 0.2}, {"step": 2.0, "genrm/score_mean": 0.4}]  # fmt: skip
    out = plot_genrm(history, tmp_path / "genrm.png")
    assert out is not None and out.read_bytes()[:4] == b"\x89PNG"
    assert plot_genrm([{"step": 1.0}], tmp_path / "none.png") is None


def test_new_genrm_keys_are_validated():
    from offbeat.core.config import ConfigError, validate

    bad = dict(val_reward="rule", judge_cpus="0", judge_num_cpus=-1, tensor_parallel_size=0,
               replicas=1, model_path="/no/such/judge")  # fmt: skip
    with pytest.raises(ConfigError) as e:
        validate(dataclasses.replace(JobConfig(), reward=RewardConfig(name="genrm", genrm=bad)))
    keys = {p.key for p in e.value.problems}
    assert {f"reward.genrm.{k}" for k in bad if k != "replicas"} <= keys
    ok = RewardConfig(name="genrm", genrm={"replicas": 1, "model_path": "offbeat-tiny:tiny"})
    with pytest.raises(ConfigError) as e:  # JobConfig() names no policy model
        validate(dataclasses.replace(JobConfig(), reward=ok))
    assert [p.key for p in e.value.problems] == ["model.path"]
