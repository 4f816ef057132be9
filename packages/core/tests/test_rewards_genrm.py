"""GenRM judge reward against a fake judge transport: parsing, policy, cache, retries."""

from __future__ import annotations

import asyncio

import pytest

from offbeat.core.config.validation import Problems
from offbeat.core.rewards.genrm import (
    GenRMConfig,
    GenRMJudge,
    parse_score,
    render_prompt,
    validate_genrm,
)
from offbeat.core.rewards.registry import RewardError


class FakeJudge:
    """Answers each call with `reply(prompt)`; records calls; can fail the first n."""

    def __init__(self, reply, fail_first: int = 0, dead: set[str] | None = None):
        self.reply, self.fail_first, self.dead = reply, fail_first, dead or set()
        self.calls: list[tuple[str, str]] = []

    async def __call__(self, url, payload, timeout):
        self.calls.append((url, payload["prompt"]))
        await asyncio.sleep(0)
        if url in self.dead:
            raise ConnectionError(f"{url} refused")
        if self.fail_first > 0:
            self.fail_first -= 1
            raise TimeoutError("slow")
        return {"choices": [{"text": self.reply(payload["prompt"])}]}


def run(coro):
    return asyncio.run(coro)


def test_parse_last_integer_in_range_in_final_paragraph():
    cfg = GenRMConfig(score_min=0, score_max=10)
    assert parse_score("step 3 of 99 says 7.\n\nVerdict: right. Score: 8", cfg) == 0.8
    assert parse_score("Score 9\n\nI think 42 is wrong", cfg) is None  # 42 out of range
    assert parse_score("no digits at all", cfg) is None


def test_regex_overrides_default_rule():
    cfg = GenRMConfig(score_regex=r"\[\[(\d+)\]\]")
    assert parse_score("[[4]] then later 9", cfg) == 0.4


def test_prompt_goes_through_chat_template_with_reference():
    class Tok:
        def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "<u>" + msgs[0]["content"] + "</u><a>"

    out = render_prompt(GenRMConfig(), "2+2?", "4", "4", Tok())
    assert out.startswith("<u>") and "Reference answer: 4" in out and "Answer: 4" in out
    assert "Reference" not in render_prompt(GenRMConfig(), "q", "r", None)


def test_parse_failure_scores_zero_and_counts():
    judge = GenRMJudge(GenRMConfig(url="http://j"), post=FakeJudge(lambda p: "no idea"))
    assert run(judge.score("q", "r")) == 0.0
    assert judge.metrics()["genrm/parse_failures"] == 1


def test_parse_failure_can_fail_the_group():
    cfg = GenRMConfig(url="http://j", on_parse_failure="fail")
    judge = GenRMJudge(cfg, post=FakeJudge(lambda p: "no idea"))
    with pytest.raises(RewardError, match="no score"):
        run(judge.score("q", "r"))


def test_identical_pairs_judged_once_per_step():
    fake = FakeJudge(lambda p: "ok. 10")
    judge = GenRMJudge(GenRMConfig(url="http://j"), post=fake)

    async def go():
        return await asyncio.gather(*(judge.score("q", "same") for _ in range(5)))

    assert run(go()) == [1.0] * 5
    assert len(fake.calls) == 1 and judge.metrics()["genrm/cache_hits"] == 4


def test_retry_moves_to_the_other_replica_when_one_is_dead():
    fake = FakeJudge(lambda p: "fine 6", dead={"http://a"})
    judge = GenRMJudge(GenRMConfig(retries=1), post=fake, urls=["http://a", "http://b"])
    assert run(judge.score("q", "r")) == 0.6
    assert [u for u, _ in fake.calls] == ["http://a", "http://b"]
    assert judge.metrics()["genrm/errors"] == 1


def test_retries_exhausted_raise_reward_error():
    judge = GenRMJudge(GenRMConfig(url="http://j", retries=1), post=FakeJudge(lambda p: "5", 9))
    with pytest.raises(RewardError, match="failed 2 times"):
        run(judge.score("q", "r"))


def test_timeout_per_call_is_enforced():
    async def hang(url, payload, timeout):
        await asyncio.sleep(3600)

    judge = GenRMJudge(GenRMConfig(url="http://j", retries=0, timeout_s=0.01), post=hang)
    with pytest.raises(RewardError):
        run(judge.score("q", "r"))


def test_concurrency_is_bounded():
    live, peak = 0, 0

    async def post(url, payload, timeout):
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.001)
        live -= 1
        return {"choices": [{"text": "3"}]}

    judge = GenRMJudge(GenRMConfig(url="http://j", max_concurrency=2), post=post)

    async def go():
        await asyncio.gather(*(judge.score("q", str(i)) for i in range(10)))

    run(go())
    assert peak == 2 and judge.judgments == 10


def test_weights_mix_with_rule_reward_and_agreement_is_measured():
    cfg = GenRMConfig(url="http://j", weights={"mixed": 0.5})
    judge = GenRMJudge(cfg, post=FakeJudge(lambda p: "10"))
    assert run(judge.score("q", "a", data_source="mixed", rule_reward=0.0)) == 0.5
    assert run(judge.score("q", "b", data_source="other", rule_reward=1.0)) == 1.0
    assert judge.metrics()["genrm/agreement_with_rule"] == 0.5
    assert judge.metrics()["genrm/agreement_on_right"] == 1.0  # the one right answer: "10"


def test_a_judge_saying_wrong_to_all_agrees_with_the_rule_on_no_right_answer():
    judge = GenRMJudge(GenRMConfig(url="http://j"), post=FakeJudge(lambda p: "0"))
    for i, rule in enumerate([0.0, 0.0, 0.0, 1.0]):
        run(judge.score("q", str(i), data_source="d", rule_reward=rule))
    m = judge.metrics()
    assert m["genrm/agreement_with_rule"] == 0.75 and m["genrm/agreement_on_right"] == 0.0


def test_validation_names_key_value_expected():
    p = Problems()
    validate_genrm({"score_min": 5, "score_max": 5, "on_parse_failure": "skip", "bogus": 1,
                    "score_regex": "(a)(b)", "timeout_s": 0, "template": "{question}",
                    "weights": {"x": 2}}, p)  # fmt: skip
    keys = {i.key for i in p.items}
    assert keys == {"reward.genrm.score_max", "reward.genrm.on_parse_failure",
                    "reward.genrm.bogus", "reward.genrm.score_regex", "reward.genrm.timeout_s",
                    "reward.genrm.template", "reward.genrm.weights.x"}  # fmt: skip
    ok = Problems()
    validate_genrm({}, ok)
    assert ok.items == []


def test_registered_genrm_scores_from_a_worker_thread_with_rule_agreement():
    import threading

    from offbeat.core.rewards import RewardRegistry, genrm

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    fake = FakeJudge(lambda p: "Correct.\n\nScore: 10" if "Answer: 4" in p else "Wrong. 0")
    judge = GenRMJudge(GenRMConfig(url="http://j"), post=fake)
    genrm.install(judge, loop)
    try:
        reg = RewardRegistry(name="genrm")
        assert reg.score("exact_match", "4", "4", {"question": "2+2?"}) == 1.0
        assert reg.score("exact_match", "5", "4", {"question": "2+2?"}) == 0.0
        assert "Question: 2+2?" in fake.calls[0][1]
        assert judge.metrics()["genrm/agreement_with_rule"] == 1.0
    finally:
        genrm.install(None)
        loop.call_soon_threadsafe(loop.stop)
        t.join()
    with pytest.raises(RewardError, match="no judge installed"):
        RewardRegistry(name="genrm").score("x", "4", "4")


def test_aiohttp_transport_against_a_fake_judge_server():
    from aiohttp import web

    from offbeat.core.rewards.genrm import aiohttp_post

    async def completions(request):
        body = await request.json()
        return web.json_response({"choices": [{"text": f"seen {len(body['prompt'])}. 7"}]})

    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            judge = GenRMJudge(GenRMConfig(url=f"http://127.0.0.1:{port}"), post=aiohttp_post)
            return await judge.score("q", "r"), judge.metrics()
        finally:
            await runner.cleanup()

    score, m = run(go())
    assert score == 0.7 and m["genrm/judgments"] == 1 and m["genrm/errors"] == 0


def test_reward_genrm_keys_are_checked_by_validate():
    import dataclasses

    from offbeat.core.config import ConfigError, JobConfig, RewardConfig, validate

    def keys(reward):
        try:
            validate(dataclasses.replace(JobConfig(), reward=reward))
        except ConfigError as e:
            return {p.key: p for p in e.problems}
        return {}

    bad = keys(RewardConfig(name="genrm", genrm={"retries": -1, "replicas": 2}))
    assert bad["reward.genrm.retries"].value == -1
    assert "judge model" in bad["reward.genrm.model_path"].expected
    assert "reward.genrm.url" not in bad  # replicas will be started
    assert "reward.genrm.url" in keys(RewardConfig(name="genrm"))
    assert not [k for k in keys(RewardConfig()) if k.startswith("reward.genrm")]
