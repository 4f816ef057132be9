"""The end-of-run figure: reward, validation reward over weight versions, off-policy
curves and a stacked bar of each step's time by phase."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from offbeat.core.trainer.tracking import MetricsTracker, plot_history


def step_row(step: int, **timing: float) -> dict[str, float]:
    row = {"step": float(step), "reward/mean": 0.1 * step, "weight_version": float(step)}
    row["off_policy/trajectory_staleness_mean"] = 1.0
    row.update({f"timing/{k}": v for k, v in timing.items()})
    return row


HISTORY = [
    {"step": 0.0, "val/reward": 0.2},  # validation rows are logged at their weight version
    step_row(1, generate_wait_s=1, train_s=2, sync_abort_s=0.5, sync_transfer_s=0.1, step_s=4),
    step_row(
        2, generate_wait_s=0.5, train_s=2.5, sync_abort_s=0.25, sync_transfer_s=0.1, step_s=3.5
    ),
    {"step": 2.0, "val/reward": 0.4},
]


@pytest.fixture
def fig():
    f = plot_history(HISTORY)
    yield f
    plt.close(f)


def test_validation_reward_is_drawn_over_weight_versions(fig):
    ax = next(a for a in fig.axes if a.get_ylabel() == "validation reward")
    assert ax.get_xlabel() == "weight version"
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0.0, 2.0] and list(line.get_ydata()) == [0.2, 0.4]


def test_step_time_bar_stacks_the_phases_up_to_the_step_time(fig):
    ax = next(a for a in fig.axes if a.get_ylabel() == "step time (s)")
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}
    # phases the run does not have (old log-prob, KV release, ...) stay out
    assert list(bars) == ["generate wait", "train", "sync abort", "sync transfer", "other"]
    assert bars["train"] == [2.0, 2.5] and bars["sync abort"] == [0.5, 0.25]
    assert bars["other"] == pytest.approx([0.4, 0.15])  # step_s minus the phases
    tops = [sum(h[i] for h in bars.values()) for i in range(2)]
    assert tops == pytest.approx([4.0, 3.5])


def test_plot_writes_a_png_with_the_four_panels(tmp_path, monkeypatch):
    tracker = MetricsTracker(tmp_path, ("jsonl",), progress=False)
    for row in HISTORY:
        tracker.log(int(row["step"]), {k: v for k, v in row.items() if k != "step"})
    tracker.close()
    drawn = []
    monkeypatch.setattr(
        "offbeat.core.trainer.tracking.plot_history",
        lambda history: drawn.append(plot_history(history)) or drawn[-1],
    )
    path = tracker.plot()
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(drawn[0].axes) == 4
