"""What `offbeat profile` reads out of a run: the rollout curve from the trace's request
lanes, the run's step figures from its metrics rows. No engine: a tracer fed by hand."""

from __future__ import annotations

import asyncio

import pytest

from offbeat.core.trace import Tracer
from offbeat.planner.measure import rollout_curve_from_trace, run_figures


def events_of(spans):
    """A trace with `spans` = [(track, name, start_s, end_s, args)]."""
    t = Tracer(None, clock=lambda: 0.0)
    for track, name, a, b, args in spans:
        t.add(name, track, a, b, **args)
    asyncio.run(t.flush())
    return t.events()


def test_rollout_curve_bins_time_by_sequences_in_flight():
    ev = events_of([
        # alone for 1 s: 8 sequences, 100 tokens -> 100 tok/s at 8
        ("rollout-0/lane 0", "generate", 0.0, 1.0, {"n": 8, "tokens": 100}),
        # two groups together for 2 s: 16 sequences, 2 x 300 tokens -> 300 tok/s at 16
        ("rollout-0/lane 0", "generate", 2.0, 4.0, {"n": 8, "tokens": 300}),
        ("rollout-0/lane 1", "generate", 2.0, 4.0, {"n": 8, "tokens": 300}),
    ])  # fmt: skip
    xs, ys = rollout_curve_from_trace(ev)
    assert xs == [8.0, 16.0]
    assert ys == pytest.approx([100.0, 300.0])


def test_rollout_curve_leaves_out_the_sync_windows():
    ev = events_of([
        ("rollout-0/lane 0", "generate", 0.0, 2.0, {"n": 4, "tokens": 100}),
        ("rollout-0/sync", "sync v1", 1.0, 2.0, {}),  # paused half the span
    ])  # fmt: skip
    xs, ys = rollout_curve_from_trace(ev)
    assert xs == [4.0]
    # the span's tokens spread evenly; only the unpaused second counts
    assert ys == pytest.approx([50.0])


def test_run_figures_skip_the_first_step():
    rows = [
        {"step": 1, "timing/step_s": 9.0, "perf/trainer_idle_frac": 0.9},
        {"step": 2, "timing/step_s": 1.0, "perf/trainer_idle_frac": 0.1},
        {"step": 3, "timing/step_s": 3.0, "perf/trainer_idle_frac": 0.3},
        {"step": 3, "val/reward": 0.5},  # a validation row is no step
    ]
    f = run_figures(rows)
    assert f["steps"] == 3
    assert f["step_s"] == pytest.approx(2.0)
    assert f["trainer_idle"] == pytest.approx(0.2)
