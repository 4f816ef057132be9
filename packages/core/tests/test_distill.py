"""On-policy distillation pieces without Ray or an engine: the k1 advantage, per-teacher
reverse KL, routing, scoring retries, the agent loop's group failure, and the config
rules (routes without a teacher, a teacher with another vocabulary)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from offbeat.core.config.validation import Problems
from offbeat.core.data import Trajectory
from offbeat.core.distill import (
    ADVANTAGES,
    TEACHER_ID,
    TEACHER_LOG_PROBS,
    TEACHER_TOP_IDS,
    TEACHER_TOP_LOG_PROBS,
    DistillationConfig,
    TeacherConfig,
    TeacherPool,
    TeacherRouter,
    TeacherScoringError,
    opd_advantages,
    reverse_kl_by_teacher,
)
from offbeat.core.distill.agent_loop import DistillAgentLoop
from offbeat.core.distill.config import TeacherSFTConfig, _distillation_rules
from offbeat.core.distill.job import OPDConfig
from offbeat.core.tasks.synthetic import SyntheticTaskConfig
from offbeat.core.trainer.agent_loop import GroupFailed

# ---- the advantage ------------------------------------------------------------------------


def test_advantage_is_negative_log_ratio_per_token_without_baseline_or_discount():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    teacher = torch.tensor([[-0.5, -2.5, -0.5], [-2.1, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = opd_advantages(student, teacher, mask)
    # Token by token: teacher - student; nothing centred per group, nothing summed forward.
    assert adv.tolist() == [pytest.approx([0.5, -0.5, 0.0]), pytest.approx([-2.0, 2.0, 0.0])]
    # The padding position is zero even where the log-probs differ.
    padded = opd_advantages(student, teacher + torch.tensor([[0, 0, 0], [0, 0, -5.0]]), mask)
    assert padded[1, 2] == 0.0


def test_advantage_rejects_any_shape_mismatch():
    # A mask one token wider than two equal log-prob tensors (the chained `a != b != c`
    # let this through to a broadcasting error).
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shapes differ"):
        opd_advantages(lp, lp, torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="shapes differ"):
        opd_advantages(lp, torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.long))


def test_centred_advantage_subtracts_the_token_mean_over_the_batch_and_keeps_padding_zero():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    teacher = torch.tensor([[-0.5, -2.5, -0.5], [-2.1, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    teacher[1, 1] -= 0.5
    k1, centred = (opd_advantages(student, teacher, mask, mode=m) for m in ADVANTAGES)
    # k1 on the five response tokens: 0.5, -0.5, 0, -2, 1.5 -> mean -0.1 (the padding's
    # -9 is left out of the mean and stays 0).
    assert float(k1.sum() / mask.sum()) == pytest.approx(-0.1)
    assert centred[mask.bool()].tolist() == pytest.approx((k1[mask.bool()] + 0.1).tolist())
    assert float(centred.sum()) == pytest.approx(0.0, abs=1e-6)
    assert centred[1, 2] == 0.0
    with pytest.raises(ValueError, match="expected one of"):
        opd_advantages(student, teacher, mask, mode="k2")


def test_kl_coef_scales_and_reward_weight_adds_the_grpo_advantage():
    student = torch.zeros(4, 2)
    teacher = torch.full((4, 2), -1.0)
    mask = torch.ones(4, 2, dtype=torch.long)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    uids = ["a", "a", "b", "b"]
    base = opd_advantages(student, teacher, mask, kl_coef=2.0)
    assert torch.all(base == -2.0)
    mixed = opd_advantages(
        student, teacher, mask, kl_coef=2.0, rewards=rewards, group_uids=uids,
        reward_weight=0.5, norm_by_std=False,
    )  # fmt: skip
    # Group a: rewards 1, 0 -> GRPO (unscaled) +0.5 / -0.5; group b: equal rewards -> 0.
    assert mixed[:, 0].tolist() == pytest.approx([-1.75, -2.25, -2.0, -2.0])
    with pytest.raises(ValueError, match="needs rewards"):
        opd_advantages(student, teacher, mask, reward_weight=1.0)


def test_reverse_kl_and_tokens_are_reported_per_teacher():
    student = torch.tensor([[-1.0, -1.0], [-2.0, 0.0], [-1.0, -1.0]])
    teacher = torch.tensor([[-2.0, -3.0], [-2.0, 0.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    ids = torch.tensor([0.0, 1.0, 0.0])
    m = reverse_kl_by_teacher(student, teacher, mask, ids, ["add", "rev", "unused"])
    assert m["distill/add/reverse_kl"] == pytest.approx((1 + 2 + 0 + 0) / 4)
    assert m["distill/add/tokens"] == 4
    assert m["distill/rev/reverse_kl"] == 0.0
    assert m["distill/rev/tokens"] == 1
    assert "distill/unused/tokens" not in m


# ---- routing and scoring ----------------------------------------------------------------


def test_router_routes_by_key_counts_and_falls_back_to_the_default():
    r = TeacherRouter(["math", "char_match"], teacher_key="data_source")
    assert r.route({"data_source": "math"}) == "math"
    assert r.route({"data_source": "char_match"}) == "char_match"
    with pytest.raises(KeyError, match="'other' has no teacher"):
        r.route({"data_source": "other"})
    d = TeacherRouter(["math", "char_match"], default="math")
    assert d.route({"data_source": "other"}) == "math"
    assert d.route({}) == "math"
    assert dict(d.counts) == {"math": 2}
    with pytest.raises(ValueError, match="default teacher"):
        TeacherRouter(["math"], default="nope")


class FakeTeacher:
    """Scores token t as -t/100; fails its first `fail` calls."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.calls: list[tuple[list[int], int]] = []

    async def compute_log_probs(self, request_id, token_ids, start):
        self.calls.append((list(token_ids), start))
        if self.fail > 0:
            self.fail -= 1
            raise RuntimeError("replica died")
        await asyncio.sleep(0)
        return [-t / 100 for t in token_ids[start:]]

    async def compute_top_log_probs(self, request_id, token_ids, start, k):
        lps = await self.compute_log_probs(request_id, token_ids, start)
        # the top-k at each position: the next k ids, most likely first
        return {
            "log_probs": lps,
            "top_ids": [[t + j for j in range(k)] for t in token_ids[start:]],
            "top_log_probs": [[-0.1 * (j + 1) for j in range(k)] for _ in lps],
        }


def test_pool_scores_on_the_named_teacher_and_retries_then_raises():
    a, b = FakeTeacher(), FakeTeacher(fail=1)
    pool = TeacherPool({"a": {"a-0": a}, "b": {"b-0": b}}, max_retries=1, retry_delay_s=0)
    assert asyncio.run(pool.score("a", [5, 6, 7, 8], 2)) == [-0.07, -0.08]
    assert asyncio.run(pool.score("b", [5, 6, 7], 1)) == [-0.06, -0.07]  # second attempt
    assert a.calls == [([5, 6, 7, 8], 2)] and len(b.calls) == 2
    m = pool.drain_metrics()
    assert m["distill/a/scored_tokens"] == 2 and m["distill/b/score_errors"] == 1
    assert m["distill/b/score_calls"] == 1 and "distill/a/latency_mean_s" in m
    assert pool.drain_metrics() == {}
    dead = TeacherPool({"c": {"c-0": FakeTeacher(fail=5)}}, max_retries=2, retry_delay_s=0)
    with pytest.raises(TeacherScoringError, match="after 3 attempts"):
        asyncio.run(dead.score("c", [1, 2], 1))


class FakeAgent:
    async def sample(self, uid, row, n, sampling=None):
        return [
            Trajectory(prompt_ids=[1, 2], response_ids=[3, 4 + i], rollout_log_probs=[-1.0, -1.0])
            for i in range(n)
        ]


def test_agent_loop_stores_teacher_log_probs_beside_the_students():
    teacher = FakeTeacher()
    router = TeacherRouter(["math", "char_match"])
    loop = DistillAgentLoop(
        FakeAgent(),
        router,
        TeacherPool({"math": {"m": FakeTeacher()}, "char_match": {"c": teacher}}),
    )
    trajs = asyncio.run(loop.sample("g", {"data_source": "char_match"}, 2))
    assert [t.extras[TEACHER_LOG_PROBS] for t in trajs] == [[-0.03, -0.04], [-0.03, -0.05]]
    assert all(t.extras[TEACHER_ID] == 1.0 for t in trajs)
    assert teacher.calls == [([1, 2, 3, 4], 2), ([1, 2, 3, 5], 2)]


def test_top_k_mode_stores_the_teachers_top_k_and_pads_them_to_b_r_k():
    from offbeat.core.data import TrajectoryBatch

    teacher = FakeTeacher(fail=1)  # the retry path serves top-k calls too
    pool = TeacherPool({"math": {"m": teacher}}, max_retries=1, retry_delay_s=0)
    loop = DistillAgentLoop(FakeAgent(), TeacherRouter(["math"]), pool, top_k=3)
    trajs = asyncio.run(loop.sample("g", {"data_source": "math"}, 2))
    assert trajs[1].extras[TEACHER_LOG_PROBS] == [-0.03, -0.05]
    assert trajs[1].extras[TEACHER_TOP_IDS] == [[3, 4, 5], [5, 6, 7]]
    assert trajs[0].extras[TEACHER_TOP_LOG_PROBS][0] == pytest.approx([-0.1, -0.2, -0.3])
    longer = Trajectory(
        prompt_ids=[1], response_ids=[3, 4, 5], rollout_log_probs=[-1.0] * 3,
        extras={TEACHER_TOP_IDS: [[1, 2, 3]] * 3, TEACHER_TOP_LOG_PROBS: [[0.0] * 3] * 3,
                TEACHER_LOG_PROBS: [0.0] * 3, TEACHER_ID: 0.0},
    )  # fmt: skip
    batch = TrajectoryBatch.pad([*trajs, longer], pad_token_id=0)
    ids = batch.extras[TEACHER_TOP_IDS]
    assert ids.shape == (3, 3, 3)
    assert ids[1, :2].tolist() == [[3, 4, 5], [5, 6, 7]] and ids[1, 2].tolist() == [0, 0, 0]
    assert batch.extras[TEACHER_LOG_PROBS].shape == (3, 3)


def test_top_k_batch_hook_hands_the_engine_the_top_k_and_no_k1_advantage():
    from types import SimpleNamespace

    from offbeat.core.data import TrajectoryBatch
    from offbeat.core.distill.job import make_batch_hook
    from offbeat.core.train.loss import TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROBS

    pool = TeacherPool({"math": {"m": FakeTeacher()}}, retry_delay_s=0)
    router = TeacherRouter(["math"])
    trajs = asyncio.run(
        DistillAgentLoop(FakeAgent(), router, pool, top_k=2).sample("g", {"data_source": "math"}, 2)
    )
    for t in trajs:
        t.reward = 1.0
    batch = TrajectoryBatch.pad(trajs, pad_token_id=0)
    data = {
        "rollout_log_probs": batch.rollout_log_probs,
        "response_mask": batch.response_mask,
        "advantages": torch.ones(2, 2),
    }
    settings = SimpleNamespace(norm_adv_by_std_in_grpo=True)
    d = DistillationConfig(loss="topk_forward_kl", top_k=2)
    metrics = make_batch_hook(d, router, pool, settings)(batch, data)
    assert data[TEACHER_TOPK_IDS].dtype == torch.long
    assert data[TEACHER_TOPK_IDS][0].tolist() == [[3, 4], [4, 5]]
    assert data[TEACHER_TOPK_LOG_PROBS].shape == (2, 2, 2)
    assert (data["advantages"] == 0).all()  # reward_weight 0: the KL term is the signal
    assert metrics["distill/math/reverse_kl"] == pytest.approx(-1.0 + 0.04, abs=0.02)
    # reverse_kl keeps the k1 advantage and hands no top-k to the engine
    data2 = {k: v for k, v in data.items() if not k.startswith("teacher_topk")}
    make_batch_hook(DistillationConfig(), router, pool, settings)(batch, data2)
    assert TEACHER_TOPK_IDS not in data2 and (data2["advantages"] != 0).any()


def test_a_teacher_that_keeps_failing_fails_the_group_not_the_run():
    pool = TeacherPool({"math": {"m": FakeTeacher(fail=10)}}, max_retries=1, retry_delay_s=0)
    loop = DistillAgentLoop(FakeAgent(), TeacherRouter(["math"]), pool)
    with pytest.raises(GroupFailed, match="could not score"):
        asyncio.run(loop.sample("g", {"data_source": "math"}, 2))
    with pytest.raises(GroupFailed, match="has no teacher"):
        asyncio.run(loop.sample("g", {"data_source": "other"}, 2))


# ---- config rules -----------------------------------------------------------------------


def opd_config(**teachers: TeacherConfig) -> OPDConfig:
    cfg = OPDConfig()
    cfg.model.path = "offbeat-tiny:tiny"
    cfg.distillation = DistillationConfig(
        teachers=dict(teachers),
        tasks=[SyntheticTaskConfig(name="add"), SyntheticTaskConfig(name="reverse")],
    )
    return cfg


def problems(cfg) -> dict[str, str]:
    p = Problems()
    _distillation_rules(cfg, p)
    return {x.key: str(x) for x in p.items}


def test_every_dataset_key_needs_a_teacher_unless_there_is_a_default():
    tiny = TeacherConfig(model="offbeat-tiny:tiny")
    assert problems(opd_config(math=tiny, char_match=tiny)) == {}
    found = problems(opd_config(math=tiny))
    assert "no teacher for ['char_match']" in found["distillation.teachers"]
    cfg = opd_config(math=tiny)
    cfg.distillation.default_teacher = "math"
    assert problems(cfg) == {}
    cfg.distillation.default_teacher = "nope"
    assert "distillation.default_teacher" in problems(cfg)


def test_an_unknown_advantage_mode_is_rejected_naming_the_choices():
    tiny = TeacherConfig(model="offbeat-tiny:tiny")
    cfg = opd_config(math=tiny, char_match=tiny)
    cfg.distillation.advantage = "k1_centred"
    assert problems(cfg) == {}
    cfg.distillation.advantage = "k3"
    found = problems(cfg)["distillation.advantage"]
    assert "'k3'" in found and "k1_centred" in found


def test_top_k_loss_is_checked_and_needs_the_fsdp2_engine():
    tiny = TeacherConfig(model="offbeat-tiny:tiny")
    cfg = opd_config(math=tiny, char_match=tiny)
    cfg.distillation.loss = "topk_forward_kl"
    assert problems(cfg) == {}
    cfg.distillation.top_k = 0
    assert "distillation.top_k" in problems(cfg)
    cfg.distillation.top_k = 20
    cfg.actor.engine = "megatron"
    assert "fsdp2 engine only" in problems(cfg)["distillation.loss"]
    cfg.distillation.loss = "forward"
    assert "reverse_kl" in problems(cfg)["distillation.loss"]


def test_parquet_keys_are_read_for_the_routing_check(tmp_path):
    from offbeat.core.tasks.synthetic import write_parquet

    f = write_parquet([{"prompt": "x", "data_source": "geo"}], tmp_path / "t.parquet")
    cfg = opd_config(math=TeacherConfig(model="offbeat-tiny:tiny"))
    cfg.data.train_files = [str(f)]
    assert "no teacher for ['geo']" in problems(cfg)["distillation.teachers"]


def _model_dir(path, vocab):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": len(vocab)}))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    return str(path)


def test_a_teacher_with_another_vocabulary_is_rejected(tmp_path):
    student = _model_dir(tmp_path / "s", {"a": 0, "b": 1})
    same = _model_dir(tmp_path / "t1", {"a": 0, "b": 1})
    other = _model_dir(tmp_path / "t2", {"a": 0, "c": 1})
    bigger = _model_dir(tmp_path / "t3", {"a": 0, "b": 1, "c": 2})
    cfg = opd_config(math=TeacherConfig(model=same), char_match=TeacherConfig(model=other))
    cfg.model.path = student
    found = problems(cfg)
    assert list(found) == ["distillation.teachers.char_match.model"]
    assert "different tokens" in found["distillation.teachers.char_match.model"]
    cfg.distillation.teachers["char_match"] = TeacherConfig(model=bigger)
    assert (
        "vocab_size 3 vs model.path's 2" in problems(cfg)["distillation.teachers.char_match.model"]
    )
    cfg.distillation.teachers["char_match"] = TeacherConfig(model="offbeat-tiny:tiny")
    assert "vocabulary of model.path" in problems(cfg)["distillation.teachers.char_match.model"]


def test_a_visual_task_routes_to_a_vision_language_teacher_of_its_own():
    """The GSM8K/Geo3K pair: a tiny-VLM student, the text task and the visual task mixed,
    a teacher for each data_source (both the tiny VLM). A text-only tiny teacher has
    another vocabulary; a task that is not a synthetic one is named."""
    vl = TeacherConfig(model="offbeat-tiny-vl")
    cfg = opd_config(math=vl, shapes=vl)
    cfg.model.path = "offbeat-tiny-vl"
    cfg.distillation.tasks = [SyntheticTaskConfig(name="add"), SyntheticTaskConfig(name="shapes")]
    assert problems(cfg) == {}
    cfg.distillation.teachers["shapes"] = TeacherConfig(
        model="offbeat-tiny-vl", sft=TeacherSFTConfig(task="shapes", steps=10)
    )
    assert problems(cfg) == {}
    del cfg.distillation.teachers["shapes"]
    assert "no teacher for ['shapes']" in problems(cfg)["distillation.teachers"]
    cfg.distillation.teachers["shapes"] = TeacherConfig(model="offbeat-tiny:tiny")
    assert "vocabulary of model.path" in problems(cfg)["distillation.teachers.shapes.model"]
    cfg.distillation.teachers["shapes"] = vl
    cfg.distillation.tasks[1] = SyntheticTaskConfig(name="geometry")
    found = problems(cfg)
    assert "must be one of reverse, copy, add, mul, shapes" in found["distillation.tasks[1].name"]


def test_mixed_text_and_image_rows_share_one_parquet_schema(tmp_path):
    from offbeat.core.distill.build import write_mixed_task_files
    from offbeat.core.tasks import read_parquet
    from offbeat.core.tasks.bad_rows import row_problem
    from offbeat.core.tasks.images import row_images

    tasks = [
        SyntheticTaskConfig(name="add", min_len=1, max_len=1, n_train=6, n_val=2),
        SyntheticTaskConfig(name="mul", min_len=1, max_len=2, n_train=6, n_val=2),
        SyntheticTaskConfig(name="shapes", n_train=6, n_val=2),
    ]
    train, val = write_mixed_task_files(tasks, tmp_path)
    rows = read_parquet(train[0])
    assert len(rows) == 18 and len(read_parquet(val[0])) == 6
    by_source: dict[str, list[int]] = {}
    for r in rows:
        assert row_problem(r, "prompt") is None
        by_source.setdefault(r["data_source"], []).append(len(row_images(r)))
    assert sorted(by_source) == ["math", "shapes"]
    assert set(by_source["shapes"]) == {1} and set(by_source["math"]) == {0}


# ---- teacher pools ----------------------------------------------------------------------


def test_each_teacher_gets_a_named_pool_with_a_bundle_per_replica():
    from offbeat.core.distill.job import teacher_pool_specs

    cfg = opd_config(
        math=TeacherConfig(model="offbeat-tiny:tiny", replicas=2),
        char_match=TeacherConfig(model="offbeat-tiny:tiny", tensor_parallel_size=2),
    )
    cfg.distillation.teacher_num_cpus = 0.5
    cpu = {s.name: (s.bundles, dict(s.bundle)) for s in teacher_pool_specs(cfg, cfg.distillation)}
    assert cpu == {"teacher-math": (2, {"CPU": 0.5}), "teacher-char_match": (1, {"CPU": 0.5})}
    cfg.resources.device = "cuda"
    cfg.runtime.rollout_resources = {"big_mem": 1}
    gpu = {s.name: dict(s.bundle) for s in teacher_pool_specs(cfg, cfg.distillation)}
    assert gpu["teacher-math"] == {"CPU": 0.5, "GPU": 1.0, "big_mem": 1.0}
    assert gpu["teacher-char_match"] == {"CPU": 0.5, "GPU": 2.0, "big_mem": 1.0}


def test_teachers_build_side_by_side_from_a_cold_cache_into_the_same_cache(tmp_path, monkeypatch):
    # Two teachers on one (not yet built) base model, built in parallel threads: both
    # come out, and a sequential build_teacher finds each in the cache (same key).
    # The per-teacher build (the real one, called through) is instrumented: each records
    # its thread and torch's thread count there, then waits on a barrier that opens only
    # once the other build has started too, so a serial build_teachers fails (the first
    # build's wait times out) instead of hanging; no wall-clock time is measured.
    import threading

    from offbeat.core.distill import build as build_mod
    from offbeat.core.distill.build import build_teacher, build_teachers
    from offbeat.core.distill.config import TeacherSFTConfig

    sft = dict(min_len=1, max_len=1, steps=3, batch_size=4, n_train=16)
    teachers = {
        "math": TeacherConfig(model="offbeat-tiny:tiny", sft=TeacherSFTConfig(task="add", **sft)),
        "char_match": TeacherConfig(
            model="offbeat-tiny:tiny", sft=TeacherSFTConfig(task="reverse", **sft)
        ),
    }
    both_started = threading.Barrier(len(teachers))
    seen: dict[str, dict] = {}

    def instrumented(t, cache_dir, **kw):
        name = t.sft.task
        seen[name] = {"thread": threading.get_ident(), "torch_threads": torch.get_num_threads()}
        try:
            both_started.wait(timeout=10)
            seen[name]["overlapped"] = True
        except threading.BrokenBarrierError:
            seen[name]["overlapped"] = False
        return build_teacher(t, cache_dir, **kw)

    monkeypatch.setattr(build_mod, "build_teacher", instrumented)
    assert not any(tmp_path.iterdir())  # a cold cache
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(2)  # so a build thread that inherits the caller's count shows it
    try:
        built = build_teachers(teachers, tmp_path)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(caller_threads)

    assert sorted(seen) == ["add", "reverse"], seen
    assert all(s["overlapped"] for s in seen.values()), (
        f"the teachers' builds did not run side by side (one never saw the other start): {seen}"
    )
    main = threading.get_ident()
    assert len({s["thread"] for s in seen.values()} | {main}) == 3, seen
    assert all(s["torch_threads"] == 1 for s in seen.values()), (
        f"a teacher's build ran with more than one torch thread: {seen}"
    )
    assert after == 2, f"the caller's torch thread count changed from 2 to {after}"

    assert list(built) == ["math", "char_match"] and built["math"] != built["char_match"]
    for name, t in teachers.items():
        assert (built[name] / "config.json").is_file()
        assert built[name].parent == tmp_path / "teachers"
        assert build_teacher(t, tmp_path) == built[name]


@pytest.mark.slow
def test_tiny_vlm_teachers_build_on_a_text_task_and_on_the_visual_task(tmp_path):
    """A VLM student's teachers: the tiny VLM fine-tuned on a text task and on `shapes`
    (its rows through the processor), each a loadable model directory of its own."""
    from transformers import AutoModelForImageTextToText

    from offbeat.core.distill.build import build_teachers

    sft = dict(steps=2, batch_size=4, n_train=8)
    out = build_teachers(
        {
            "math": TeacherConfig(
                model="offbeat-tiny-vl", sft=TeacherSFTConfig(task="add", max_len=1, **sft)
            ),
            "shapes": TeacherConfig(
                model="offbeat-tiny-vl", sft=TeacherSFTConfig(task="shapes", **sft)
            ),
        },
        tmp_path,
    )
    assert out["math"] != out["shapes"]
    for d in out.values():
        assert (d / "preprocessor_config.json").is_file() or (d / "processor_config.json").is_file()
        AutoModelForImageTextToText.from_pretrained(d)
