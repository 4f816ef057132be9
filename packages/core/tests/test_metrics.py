"""MetricsAggregator: each naming rule, weighted means, and input errors."""

from __future__ import annotations

import pytest
import torch

from offbeat.core.metrics import MetricsAggregator, reduction_for


@pytest.mark.parametrize(
    ("name", "how"),
    [
        ("actor/lr", "last"),
        ("critic/critic_lr", "last"),
        ("global_step", "last"),
        ("trainer/epoch", "last"),
        ("perf/tokens_per_s", "mean"),
        ("rollout_is/max_ratio", "max"),
        ("response_length/max", "max"),
        ("actor/grad_norm_max", "max"),
        ("actor/max_num_tokens", "max"),
        ("response_length/min", "min"),
        ("timing/update_actor", "sum"),
        ("actor/backward_s", "sum"),
        ("actor/step_time", "sum"),
        ("actor/num_tokens", "sum"),
        ("buffer/dropped_count", "sum"),
        ("actor/n_seqs", "sum"),
        ("actor/pg_loss", "mean"),
        ("actor/pg_clipfrac", "mean"),
        ("critic/vpred_mean", "mean"),
    ],
)
def test_naming_rules(name, how):
    assert reduction_for(name) == how


def test_merge_of_three_updates():
    agg = MetricsAggregator()
    agg.add({"actor/lr": 1e-6, "actor/pg_loss": 1.0, "actor/num_tokens": 10,
             "timing/update": 0.5, "x/max_ratio": 2.0, "x/min_ratio": 0.5}, weight=1)  # fmt: skip
    agg.add({"actor/lr": 2e-6, "actor/pg_loss": torch.tensor(4.0), "actor/num_tokens": 30,
             "timing/update": 0.25, "x/max_ratio": 1.5, "x/min_ratio": 0.2}, weight=3)  # fmt: skip
    agg.add({"actor/lr": 3e-6, "only_here": 7.0}, weight=2)
    out = agg.result()
    assert out["actor/lr"] == 3e-6  # last
    assert out["actor/pg_loss"] == pytest.approx((1.0 * 1 + 4.0 * 3) / 4)  # weighted mean
    assert out["actor/num_tokens"] == 40 and out["timing/update"] == 0.75  # sums
    assert out["x/max_ratio"] == 2.0 and out["x/min_ratio"] == 0.2
    assert out["only_here"] == 7.0  # mean over the updates that reported it
    assert list(out) == ["actor/lr", "actor/pg_loss", "actor/num_tokens", "timing/update",
                         "x/max_ratio", "x/min_ratio", "only_here"]  # fmt: skip
    agg.reset()
    assert len(agg) == 0 and agg.result() == {}


def test_bad_inputs():
    agg = MetricsAggregator()
    with pytest.raises(ValueError, match="weight=0"):
        agg.add({"a": 1.0}, weight=0)
    with pytest.raises(TypeError, match="metric 'a'"):
        agg.add({"a": "high"})
    with pytest.raises(TypeError, match="metric 'b'"):
        agg.add({"b": True})
