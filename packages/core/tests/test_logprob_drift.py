"""Log-prob drift, trainer against rollout on the same tokens: the math and its masks, the
sums that combine over micro-batches and ranks, the FSDP2 engine's measurement inside an
update (before its optimizer step), the training loop's choice of tokens (same weight
version only), the warning past `trainer.logprob_drift_warn`, its config check, and the
plot's panel."""

from __future__ import annotations

import logging
import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch
from test_train_fsdp2 import make_batch, make_engine, tiny_model_dir
from trainer_fakes import FakeEngine, Harness

import offbeat.core.trainer.trainer as trainer_module
from offbeat.core.algorithms.logprob_drift import (
    DRIFT_MASK,
    batch_drift_sums,
    drift_metrics,
    drift_sums,
    pop_drift_sums,
    same_version_mask,
)
from offbeat.core.config import ConfigError, JobConfig, validate
from offbeat.core.train._metrics import MetricSums
from offbeat.core.trainer.logprob_drift import DRIFT_WARN_DEFAULT, DriftWarning
from offbeat.core.trainer.tracking import plot_history

P = "logprob_drift"


def measured(trainer, rollout, mask):
    return drift_metrics(drift_sums(trainer, rollout, mask, P), P)


# ---- the math -----------------------------------------------------------------------------
def test_identical_log_probs_have_no_drift():
    lp = -torch.rand(3, 5) * 3
    mask = torch.ones(3, 5)
    m = measured(lp, lp.clone(), mask)
    assert m[f"{P}/abs_mean"] == 0.0 and m[f"{P}/abs_max"] == 0.0
    assert m[f"{P}/prob_abs_mean"] == 0.0 and m[f"{P}/prob_abs_max"] == 0.0
    assert m[f"{P}/ppl_ratio"] == 1.0
    assert m[f"{P}/num_tokens"] == 15.0


def test_a_known_shift_gives_the_known_values():
    rollout = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    shift = torch.tensor([[0.2, 0.2], [0.2, -0.6]])  # trainer = rollout - shift
    m = measured(rollout - shift, rollout, torch.ones(2, 2))
    assert m[f"{P}/abs_mean"] == pytest.approx((0.2 * 3 + 0.6) / 4)
    assert m[f"{P}/abs_max"] == pytest.approx(0.6)
    # the trainer's perplexity over the rollout's: exp(mean(log p_rollout - log p_trainer))
    assert m[f"{P}/ppl_ratio"] == pytest.approx(math.exp((0.2 * 3 - 0.6) / 4))
    probs = [
        abs(math.exp(r - s) - math.exp(r))
        for r, s in zip([-1, -2, -0.5, -3], [0.2, 0.2, 0.2, -0.6], strict=True)
    ]
    assert m[f"{P}/prob_abs_mean"] == pytest.approx(sum(probs) / 4)
    assert m[f"{P}/prob_abs_max"] == pytest.approx(max(probs))


def test_an_all_lower_trainer_has_a_higher_perplexity():
    rollout = -torch.ones(2, 3)
    m = measured(rollout - 0.1, rollout, torch.ones(2, 3))
    assert m[f"{P}/ppl_ratio"] == pytest.approx(math.exp(0.1)) and m[f"{P}/ppl_ratio"] > 1


def test_padding_and_tool_tokens_do_not_count():
    # row 0: 2 policy tokens, then a tool result (attended to, not the policy's), then padding
    response_mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.0, -1.0, 0.0, 0.0, 0.0], [-2.0, 0.0, 0.0, 0.0, 0.0]])
    trainer = torch.tensor([[-1.1, -0.9, -40.0, -7.0, 0.0], [-2.1, -9.0, -9.0, 0.0, 0.0]])
    m = measured(trainer, rollout, response_mask)
    assert m[f"{P}/num_tokens"] == 3.0
    assert m[f"{P}/abs_mean"] == pytest.approx(0.1)
    assert m[f"{P}/abs_max"] == pytest.approx(0.1)


def test_no_token_measured_reports_only_the_count():
    m = measured(-torch.ones(2, 2), torch.zeros(2, 2), torch.zeros(2, 2))
    assert m == {f"{P}/num_tokens": 0.0}


def test_only_trajectories_sampled_wholly_at_the_version_count():
    response_mask = torch.tensor([[1.0, 1.0, 0.0]] * 4)
    lo = torch.tensor([3, 2, 3, 3])
    hi = torch.tensor([3, 3, 3, 2])  # row 1 resumed across a sync; row 3 is nonsense-old
    mask = same_version_mask(response_mask, lo, hi, version=3)
    assert mask.tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]]
    assert same_version_mask(response_mask, lo, hi, version=4).sum() == 0


def test_sums_combine_over_parts_as_over_the_whole():
    # as the engine does: each micro-batch's sums added with weight 1, maxima kept
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(6, 4, generator=g) * 4
    trainer = rollout + torch.randn(6, 4, generator=g) * 0.01
    batch = {
        "rollout_log_probs": rollout,
        "response_mask": (torch.rand(6, 4, generator=g) > 0.3).float(),
        DRIFT_MASK: (torch.rand(6, 4, generator=g) > 0.5).float(),
    }
    sums = MetricSums()
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        part = {k: v[rows] for k, v in batch.items()}
        sums.add(batch_drift_sums(trainer[rows], part), 1.0)
    combined = pop_drift_sums(sums._values)
    whole = pop_drift_sums(batch_drift_sums(trainer, batch))
    assert set(combined) == set(whole)
    assert not any("/_" in k for k in whole)  # the running sums are gone
    for key, value in whole.items():
        assert combined[key] == pytest.approx(value, rel=1e-12), key
    assert whole["logprob_drift_all/num_tokens"] == batch["response_mask"].sum().item()


# ---- the warning and its key ----------------------------------------------------------------
def row(value: float) -> dict[str, float]:
    return {f"{P}/abs_mean": value, f"{P}/num_tokens": 10.0, f"{P}/ppl_ratio": 1.0}


def test_warning_fires_past_the_threshold_and_not_below():
    w = DriftWarning(0.05)
    assert w.check(1, row(0.01)) is None
    assert w.check(2, row(0.05)) is None  # at the threshold: not past it
    assert w.check(3, {}) is None  # a step with no same-version token
    message = w.check(4, row(0.2))
    assert message and "trainer.logprob_drift_warn=0.05" in message and "0.2" in message


def test_warning_is_rate_limited_and_nan_is_past_any_threshold():
    w = DriftWarning(0.05, every=10)
    assert w.check(1, row(1.0)) is not None
    assert [s for s in range(2, 11) if w.check(s, row(1.0))] == []
    assert w.check(11, row(float("nan"))) is not None
    assert DriftWarning(None).check(1, row(100.0)) is None


def drift_key_problem(value):
    cfg = JobConfig()
    cfg.model.path = "some/model"
    cfg.trainer.logprob_drift_warn = value
    try:
        validate(cfg)
    except ConfigError as e:
        return {p.key: str(p) for p in e.problems}.get("trainer.logprob_drift_warn")
    return None


def test_the_threshold_key_is_validated():
    assert JobConfig().trainer.logprob_drift_warn == DRIFT_WARN_DEFAULT
    for bad in (0, -0.1, "high", True, float("nan")):
        assert "must be a number > 0" in (drift_key_problem(bad) or ""), bad
    assert drift_key_problem(None) is None
    assert drift_key_problem(0.5) is None


# ---- the FSDP2 engine measures inside its update -----------------------------------------
@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def test_fsdp2_update_measures_before_its_optimizer_step(engine_dir):
    engine = make_engine(engine_dir, micro_batch_size=3)
    batch = make_batch(8, seed=1)
    rollout = engine.compute_log_probs(batch)  # eval mode, the same weights
    same = torch.zeros(8, 1)
    same[:5] = 1.0  # rows 5..7 "stale": shifted, and outside the same-version mask
    shift = 0.3 * (1 - same) * batch["response_mask"]
    data = {
        **batch,
        "rollout_log_probs": rollout + shift,
        DRIFT_MASK: batch["response_mask"] * same,
    }
    m = engine.update(data)
    tokens = float(batch["response_mask"][:5].sum())
    assert m[f"{P}/num_tokens"] == tokens
    assert m[f"{P}/abs_mean"] < 1e-5 and m[f"{P}/abs_max"] < 1e-4
    assert m[f"{P}/ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
    all_tokens = float(batch["response_mask"].sum())
    assert m["logprob_drift_all/num_tokens"] == all_tokens
    stale_tokens = all_tokens - tokens
    assert m["logprob_drift_all/abs_mean"] == pytest.approx(
        0.3 * stale_tokens / all_tokens, rel=1e-3
    )
    assert m["logprob_drift_all/abs_max"] == pytest.approx(0.3, rel=1e-3)
    # the update moved the weights: the same comparison after it is no longer ~0
    after = engine.update({**data, "rollout_log_probs": rollout})
    assert after[f"{P}/abs_mean"] > 1e-4
    # no mask, no measurement
    assert not any(k.startswith(P) for k in engine.update({**batch, "rollout_log_probs": rollout}))


# ---- the training loop --------------------------------------------------------------------
class DriftEngine(FakeEngine):
    """A fake engine that measures like the real one: its log-probs are the rollout's
    (-0.1) plus 0.01 x the updates so far; it records each update's drift mask."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor | None] = []

    def update(self, mini_batch, temperature=None):
        mask = mini_batch.get(DRIFT_MASK)
        self.masks.append(None if mask is None else mask.clone())
        out = super().update(mini_batch)
        if mask is not None:
            lp = (mini_batch["rollout_log_probs"] + 0.01 * (self.updates - 1)) * mini_batch[
                "response_mask"
            ]
            out.update(pop_drift_sums(batch_drift_sums(lp, mini_batch)))
        return out


async def test_loop_marks_the_first_mini_batch_and_only_same_version_trajectories(
    tmp_path, monkeypatch
):
    batches = []

    def recording(groups, *args):
        batch, data = build(groups, *args)
        batches.append(batch)
        return batch, data

    build = trainer_module.build_train_batch
    monkeypatch.setattr(trainer_module, "build_train_batch", recording)
    engine = DriftEngine()
    h = Harness(tmp_path, engine=engine, threshold=2, strategy="drop", warmup=1,
                total_training_steps=4)  # fmt: skip
    await h.run()
    sync_steps = h.settings.async_training.parameter_sync_step
    rows = h.settings.actor.ppo_mini_batch_size * h.settings.rollout.n
    assert len(engine.masks) == 4 * sync_steps
    same_rows = stale_rows = 0
    for step, batch in enumerate(batches, start=1):
        first, *rest = engine.masks[(step - 1) * sync_steps : step * sync_steps]
        assert first is not None and all(m is None for m in rest)  # later ones moved weights
        version = step - 1  # the trainer's weights during the step's first update
        for i in range(rows):
            lo, hi = int(batch.min_weight_version[i]), int(batch.max_weight_version[i])
            same = lo == hi == version
            same_rows += same
            stale_rows += not same
            want = batch.response_mask[i] * float(same)
            assert torch.equal(first[i], want), (step, i, lo, hi)
    assert same_rows and stale_rows, "the run should train both kinds of trajectory"
    for r in h.train_rows():
        assert r["logprob_drift_all/num_tokens"] >= r[f"{P}/num_tokens"]
        if r[f"{P}/num_tokens"]:
            # the first update of every step: the engine had made 2 (step - 1) updates
            assert r[f"{P}/abs_mean"] == pytest.approx(0.01 * 2 * (r["step"] - 1), abs=1e-6)


async def test_decoupled_ppo_measures_the_old_log_probs_and_warns_once(tmp_path, caplog):
    # FakeEngine's start-of-step log-probs are -(1 + updates): step 1 is 0.9 off the
    # rollout's -0.1 on every token, far past the default threshold; no warning again
    # within the rate limit
    h = Harness(tmp_path, old_log_prob_source="trainer", threshold=1, strategy="wait", warmup=0)
    with caplog.at_level(logging.WARNING, logger="offbeat.core.trainer.trainer"):
        await h.run()
    rows = h.train_rows()
    # threshold 1, no warm-up: every trajectory is sampled at the trainer's weights
    assert all(r[f"{P}/num_tokens"] == r["logprob_drift_all/num_tokens"] > 0 for r in rows)
    expect = [abs(-(1.0 + 2 * (step - 1)) + 0.1) for step in (1, 2, 3)]
    assert [r[f"{P}/abs_mean"] for r in rows] == pytest.approx(expect)
    assert rows[0][f"{P}/ppl_ratio"] == pytest.approx(math.exp(0.9))
    warnings = [r.getMessage() for r in caplog.records if "logprob_drift_warn" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("[step 1]")


async def test_no_warning_below_the_threshold(tmp_path, caplog):
    # the largest drift here is 4.9 (step 3)
    h = Harness(tmp_path, old_log_prob_source="trainer", threshold=1, strategy="wait", warmup=0,
                logprob_drift_warn=5.0)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="offbeat.core.trainer.trainer"):
        await h.run()
    assert max(r[f"{P}/abs_mean"] for r in h.train_rows()) == pytest.approx(4.9)
    assert not [r for r in caplog.records if "logprob_drift_warn" in r.getMessage()]


# ---- the plot -----------------------------------------------------------------------------
def test_plot_draws_the_drift_panel_when_the_run_has_it():
    history = [
        {"step": 1.0, "reward/mean": 0.1, f"{P}/abs_mean": 1e-5, f"{P}/abs_max": 1e-3,
         "logprob_drift_all/abs_mean": 0.2},
        {"step": 2.0, "reward/mean": 0.2, "logprob_drift_all/abs_mean": 0.3},  # no same-version
        {"step": 3.0, "reward/mean": 0.3, f"{P}/abs_mean": 0.0, f"{P}/abs_max": 2e-3,
         "logprob_drift_all/abs_mean": 0.1},
    ]  # fmt: skip
    fig = plot_history(history)
    try:
        assert len(fig.axes) == 5
        ax = next(a for a in fig.axes if a.get_ylabel() == "log-prob drift")
        assert ax.get_yscale() == "log"
        lines = {line.get_label(): line for line in ax.get_lines()}
        same = lines["|Δ log p| mean, same weights"]
        assert list(same.get_xdata()) == [1.0, 3.0]
        assert list(same.get_ydata()) == [1e-5, 1e-12]  # zero drawn at the bottom
        assert list(lines["|Δ log p| mean, all (incl. staleness)"].get_ydata()) == [0.2, 0.3, 0.1]
    finally:
        plt.close(fig)
    without = plot_history([{"step": 1.0, "reward/mean": 0.1}])
    try:
        assert len(without.axes) == 4
    finally:
        plt.close(without)
