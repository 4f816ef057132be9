"""The report a recipe prints when its job ends: one place for every recipe that runs
`run_job` (separate_async, separate_async_vlm), so their lines stay the same."""

from __future__ import annotations

from typing import Any

__all__ = ["job_summary", "print_report"]


def job_summary(
    summary: dict[str, Any], loop: Any, rollout: Any, startup_s: float
) -> dict[str, Any]:
    """`summary` (the trainer's) with where the run's files are (`loop`: a
    `TrainingLoop`), its start-up time, the replicas removed and replaced and the hybrid
    replicas' cycles (`rollout`: a `RolloutSide`), and the trainer itself."""
    pool, hybrid = rollout.pool, rollout.hybrid
    summary.update(
        {
            "run_dir": str(loop.run_dir),
            "metrics": str(loop.tracker.jsonl_path),
            "plot": str(loop.plot) if loop.plot else None,
            "trace": str(loop.trace_path) if loop.trace_path is not None else None,
            "startup_s": startup_s,
            "removed_replicas": dict(pool.removed),
            "replaced_replicas": dict(pool.replaced),
            "hybrid_events": list(hybrid.events) if hybrid is not None else [],
            "hybrid_lost": dict(hybrid.lost) if hybrid is not None else {},
            "trainer": loop.trainer,
        }
    )
    return summary


def print_report(summary: dict[str, Any], name: str) -> None:
    """The end-of-run report of a separate_async-style job (`run_job`'s summary) on stdout:
    steps and version, wall time, validation from first to last and best, the prompts'
    fate, and where the metrics, plot, step timeline and engine logs are."""
    counts = summary["counts"]
    val = summary["val_history"]
    print(f"\n=== {name} finished ===")
    print(f"steps: {summary['steps']}  weight version: {summary['version']}")
    print(
        f"wall time: {summary['total_wall_s']:.0f}s (engines ready after {summary['startup_s']:.0f}s)"
    )
    if val:
        first, last = val[0], val[-1]
        best = max(val, key=lambda x: x[1])
        print(
            f"validation reward: {first[1]:.3f} (version {first[0]}) -> {last[1]:.3f} "
            f"(version {last[0]}), best {best[1]:.3f} (version {best[0]})"
        )
    print(
        f"prompts: submitted {counts['submitted']}, trained {counts['trained']}, evicted "
        f"{counts['evicted']}, failed {counts['failed']}, still in flight "
        f"{counts['pending'] + counts['running'] + counts['finished']}"
    )
    if summary.get("restarts"):
        print(f"restarts after a dead trainer rank: {summary['restarts']} "
              f"({'; '.join(summary['restart_causes'])})")  # fmt: skip
    if summary.get("removed_replicas"):
        print(f"replicas removed: {summary['removed_replicas']}")
    print(f"metrics: {summary['metrics']}\nplot: {summary['plot']}")
    if summary.get("trace"):
        print(f"step timeline: {summary['trace']} (open in ui.perfetto.dev)")
    if summary.get("logs"):
        print(f"engine and Ray logs: {summary['logs']}/")
