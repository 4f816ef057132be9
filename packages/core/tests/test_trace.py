"""The step-timeline tracer: Chrome trace JSON that stays valid after every flush, tracks
named by metadata, spans that nest on every track (lanes for concurrent requests), the
context that carries the tracer into tasks and threads, and the no-op when off."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from offbeat.core import trace
from offbeat.core.trace import Tracer, nesting_problems


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def spans(events, name=None):
    return [e for e in events if e["ph"] == "X" and (name is None or e["name"] == name)]


def track_names(events) -> dict[tuple[int, int], str]:
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    return {
        (e["pid"], e["tid"]): f"{procs[e['pid']]}/{e['args']['name']}"
        for e in events
        if e["name"] == "thread_name"
    }


def on_track(events, track: str) -> list[str]:
    names = track_names(events)
    return [e["name"] for e in spans(events) if names[(e["pid"], e["tid"])] == track]


async def test_file_is_valid_trace_json_after_every_flush(tmp_path):
    clock = Clock()
    t = Tracer(tmp_path / "trace.json", clock=clock)
    token = trace.activate(t)
    try:
        with trace.span("step 1", trace.MAIN_TRACK, step=1) as args:
            clock.t += 0.5
            with trace.span("train"):  # no track: the enclosing span's
                clock.t += 1.0
            args["extra"] = "x"
        await t.end_step()
        first = json.loads((tmp_path / "trace.json").read_text())
        trace.add("abort", "rollout-0/sync", clock.t, clock.t + 0.25)
        await t.end_step()
    finally:
        trace.deactivate(token)
    doc = json.loads((tmp_path / "trace.json").read_text())
    assert spans(first["traceEvents"]) and not spans(first["traceEvents"], "abort")
    events = doc["traceEvents"]
    step, train = spans(events, "step 1")[0], spans(events, "train")[0]
    assert (step["ts"], step["dur"], step["args"]) == (0, 1_500_000, {"step": 1, "extra": "x"})
    assert (train["ts"], train["dur"]) == (500_000, 1_000_000)
    assert (step["pid"], step["tid"]) == (train["pid"], train["tid"])
    assert on_track(events, "trainer/steps") == ["step 1", "train"]
    assert on_track(events, "rollout-0/sync") == ["abort"]
    assert spans(events, "abort")[0]["dur"] == 250_000
    assert {e["ph"] for e in events} <= {"X", "M", "C"}


async def test_off_after_the_first_steps_and_a_no_op_without_a_tracer(tmp_path):
    assert trace.span("x") is trace.span("y")  # no tracer: one shared no-op
    with trace.span("x") as args:
        args["k"] = 1  # writes to a span nobody records are dropped
    assert dict(args) == {}
    t = Tracer(tmp_path / "trace.json", steps=2)
    token = trace.activate(t)
    try:
        for step in (1, 2, 3):
            with trace.span(f"step {step}", trace.MAIN_TRACK):
                pass
            await t.end_step()
        assert not t.enabled and trace.span("late") is trace.span("later")
    finally:
        trace.deactivate(token)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert [e["name"] for e in spans(events)] == ["step 1", "step 2"]
    assert Tracer(None, steps=0).span("x") is trace.span("x")


async def test_concurrent_requests_take_lanes_and_never_overlap_on_one(tmp_path):
    t = Tracer(None)
    token = trace.activate(t)

    async def request(i: int, server: str) -> None:
        with trace.lane_span("generate", server, request=f"r{i}") as args:
            await asyncio.sleep(0.001 * (i % 5))
            args["tokens"] = i

    try:
        await asyncio.gather(*(request(i, f"s{i % 2}") for i in range(40)))
        await asyncio.gather(*(request(i, "s0") for i in range(3)))
    finally:
        trace.deactivate(token)
    events = t.events()
    assert nesting_problems(events) == []
    assert len(spans(events, "generate")) == 43
    names = track_names(events)
    lanes = {names[(e["pid"], e["tid"])] for e in spans(events, "generate")}
    assert {x.split("/")[0] for x in lanes} == {"s0", "s1"}
    assert all(x.split("/")[1].startswith("lane ") for x in lanes)
    # the in-flight counter rises and falls back to zero on each server
    counts: dict[int, list[int]] = {}
    for e in events:
        if e["ph"] == "C":
            counts.setdefault(e["pid"], []).append(e["args"]["requests"])
    assert all(c[-1] == 0 and max(c) > 1 for c in counts.values())


async def test_threads_of_to_thread_record_on_the_callers_track():
    t = Tracer(None)
    token = trace.activate(t)

    def work() -> None:  # e.g. the train engine's micro-batches
        for i in range(3):
            with trace.span("micro-batch", index=i):
                pass

    try:
        with trace.span("train", "driver/loop"):
            await asyncio.to_thread(work)
        with trace.span("other", "elsewhere/x"):
            pass
    finally:
        trace.deactivate(token)
    events = t.events()
    assert on_track(events, "driver/loop") == ["micro-batch"] * 3 + ["train"]
    assert nesting_problems(events) == []


def test_nesting_problems_finds_a_partial_overlap():
    def x(name, ts, dur, tid=1):
        return {"ph": "X", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    good = [x("a", 0, 10), x("b", 2, 3), x("c", 5, 5), x("d", 10, 1), x("e", 3, 30, tid=2)]
    assert nesting_problems(good) == []
    bad = [x("a", 0, 10), x("b", 2, 3), x("c", 4, 7)]
    (problem,) = nesting_problems(bad)
    assert "'c'" in problem and "'b'" in problem


def test_add_sync_puts_each_replica_on_its_own_sync_track():
    result = SimpleNamespace(
        version=4,
        phase_spans={"abort": (1.0, 2.0), "transfer": (2.0, 3.0)},
        replica_spans={
            "r0": [("abort", 1.0, 1.5), ("transfer", 2.0, 3.0)],
            "r1": [("abort", 1.0, 2.0)],
        },
        failed={"r1": "release_kv: boom"},
    )
    t = Tracer(None, clock=Clock())
    token = trace.activate(t)
    try:
        trace.add_sync(result, "trainer/steps")
    finally:
        trace.deactivate(token)
    events = t.events()
    assert on_track(events, "trainer/steps") == ["abort", "transfer"]
    assert on_track(events, "r0/sync") == ["sync v4", "abort", "transfer"]
    assert on_track(events, "r1/sync") == ["sync v4", "abort"]
    assert spans(events, "sync v4")[1]["args"] == {"failed": "release_kv: boom"}
    assert nesting_problems(events) == []


@pytest.mark.parametrize("exc", [ValueError, asyncio.CancelledError])
async def test_a_span_that_raises_is_recorded_with_the_error(exc):
    t = Tracer(None)
    with pytest.raises(exc), t.span("boom", "trainer/steps"):
        raise exc()
    (e,) = spans(t.events())
    assert e["args"] == {"error": exc.__name__}


@pytest.mark.parametrize(
    ("trace_on", "trace_steps", "steps"), [(False, 3, 3), (False, 1, 1), (True, 3, None)]
)
def test_job_traces_every_step_with_trace_else_the_first_trace_steps(
    tmp_path, trace_on, trace_steps, steps
):
    from offbeat.core.trainer.tracking import make_tracer

    cfg = SimpleNamespace(trace=trace_on, trace_steps=trace_steps)
    tracer = make_tracer(cfg, tmp_path)
    assert tracer.path == tmp_path / "trace.json" and tracer.steps == steps and tracer.enabled
    assert make_tracer(SimpleNamespace(trace=False, trace_steps=0), tmp_path) is None
