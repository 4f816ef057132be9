"""MetricsTracker's console output: a progress bar on a terminal only; anywhere else (a
log file, CI) no carriage return and exactly one line per step."""

from __future__ import annotations

import io
import json
import os

import pytest

from offbeat.core.trainer.tracking import MetricsTracker

STEPS = 6


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_steps(tmp_path, stream, loggers=("console", "jsonl"), progress=True) -> MetricsTracker:
    tracker = MetricsTracker(tmp_path, loggers, total_steps=STEPS, progress=progress, stream=stream)
    tracker.event("offbeat: starting")
    for step in range(1, STEPS + 1):
        tracker.log(step, {"reward/mean": step / 10, "perf/tokens_per_s": 100.0 * step})
        if step % 3 == 0:  # validation rows and notes are not steps
            tracker.log(step, {"val/reward": 0.5}, advance=False)
            tracker.event(f"[step {step}] validation: reward=0.5")
    tracker.close()
    return tracker


def step_lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.startswith("[step ") and "/" in line[:12]]


@pytest.mark.parametrize("loggers", [("console", "jsonl"), ("jsonl",)])
def test_non_terminal_gets_one_line_per_step_and_no_carriage_return(tmp_path, loggers):
    out = io.StringIO()
    tracker = run_steps(tmp_path, out, loggers)
    text = out.getvalue()
    assert not tracker.shows_bar
    assert "\r" not in text
    lines = step_lines(text)
    assert [line.split("]")[0] for line in lines] == [
        f"[step {s}/{STEPS}" for s in range(1, STEPS + 1)
    ]
    assert "reward=0.6" in lines[-1]
    if "console" in loggers:  # the notes are lines of their own
        assert text.count("validation: reward=0.5\n") == 2
        assert text.startswith("offbeat: starting\n")
    else:
        assert "validation" not in text
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS + 2  # JSONL still gets every row


def test_no_progress_and_no_console_writes_nothing(tmp_path):
    out = io.StringIO()
    run_steps(tmp_path, out, ("jsonl",), progress=False)
    assert out.getvalue() == ""


def test_terminal_gets_the_progress_bar(tmp_path):
    out = Terminal()
    tracker = run_steps(tmp_path, out)
    assert tracker.shows_bar
    text = out.getvalue()
    assert "\r" in text and f"{STEPS}/{STEPS}" in text  # the bar redraws in place
    # the console lines are still printed, above the bar
    assert all(f"[step {s}/{STEPS}] " in text for s in range(1, STEPS + 1))


def test_cli_turns_library_progress_bars_off_when_stdout_is_not_a_terminal(monkeypatch):
    """tqdm reads TQDM_DISABLE on import, so the CLI sets it before any recipe import."""
    import sys

    from offbeat.core import cli

    for key in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    cli.main(["recipes"])
    assert os.environ["TQDM_DISABLE"] == "1"
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


def test_cli_keeps_progress_bars_on_a_terminal(monkeypatch):
    import sys

    from offbeat.core import cli

    class Tty(io.StringIO):
        def isatty(self):
            return True

    for key in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(sys, "stdout", Tty())
    cli.main(["recipes"])
    assert "TQDM_DISABLE" not in os.environ


def _steps_in(path) -> list[float]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


def test_a_fresh_run_replaces_the_metrics_file_and_a_resumed_one_continues_it(tmp_path):
    first = MetricsTracker(tmp_path, ("jsonl",), progress=False)
    for step in (1, 2, 3):
        first.log(step, {"reward/mean": 0.1})
    first.close()
    resumed = MetricsTracker(tmp_path, ("jsonl",), progress=False, append=True)
    resumed.log(4, {"reward/mean": 0.2})
    resumed.close()
    assert _steps_in(resumed.jsonl_path) == [1.0, 2.0, 3.0, 4.0]
    fresh = MetricsTracker(tmp_path, ("jsonl",), progress=False, append=False)
    fresh.log(1, {"reward/mean": 0.3})
    fresh.close()
    assert _steps_in(fresh.jsonl_path) == [1.0]
