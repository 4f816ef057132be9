"""What `offbeat profile` reads out of a run: the rollout curve from the trace's request
lanes, the run's step figures from its metrics rows. No engine: a tracer fed by hand."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from offbeat.core.trace import Tracer
from offbeat.planner._cores import CoreSampler, busy_fraction
from offbeat.planner.measure import (
    busy_intervals_from_trace,
    rollout_curve_from_trace,
    run_figures,
)


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


def test_busy_intervals_are_the_first_replicas_lanes_less_its_syncs():
    ev = events_of([
        ("rollout-0/lane 0", "generate", 0.0, 2.0, {"n": 4}),
        ("rollout-0/lane 1", "generate", 1.0, 3.0, {"n": 4}),
        ("rollout-0/sync", "sync v1", 2.5, 2.75, {}),
        ("rollout-0/lane 0", "generate", 5.0, 6.0, {"n": 4}),
        ("rollout-1/lane 0", "generate", 3.0, 5.0, {"n": 4}),  # another replica's
    ])  # fmt: skip
    got = [x for span in busy_intervals_from_trace(ev) for x in span]
    assert got == pytest.approx([0.0, 2.5, 2.75, 3.0, 5.0, 6.0])


def test_busy_fraction_counts_cpu_inside_the_busy_time():
    # CPU seconds on a clock: 1 s of CPU in [0, 2] (busy [0, 1]), none after
    samples = [(0.0, 0.0), (2.0, 1.0), (4.0, 1.0)]
    # half of the first interval's CPU falls in the 1 busy second: 0.5 / (1 s x 1 core)
    assert busy_fraction(samples, [(0.0, 1.0)], 1) == pytest.approx(0.5)
    # two cores, busy the whole time: 1 CPU s over 4 s x 2 cores
    assert busy_fraction(samples, [(0.0, 4.0)], 2) == pytest.approx(1 / 8)
    assert busy_fraction(samples, [], 1) is None


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_core_sampler_sees_a_child_pinned_to_the_cores():
    core = min(os.sched_getaffinity(0))
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import os, sys\n"
         f"os.sched_setaffinity(0, {{{core}}})\n"
         "x = sum(i * i for i in range(3_000_000))\n"
         "print('done', flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        sampler = CoreSampler([core])
        assert child.stdout.readline().strip() == "done"  # its work is done, it still lives
        sampler.sample()
        other = CoreSampler([core + 1000])  # no process is pinned there
        other.sample()
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert sampler.samples[-1][1] > 0  # its CPU seconds were counted
    assert other.samples[-1][1] == 0
