"""Where a run's metrics go: console, JSONL, TensorBoard, wandb, MLflow, a progress bar,
a final plot.

Knows nothing about what the metrics mean beyond a few names the progress bar and the
plot show (reward, staleness, tokens/s, log-prob drift, the `timing/*` phases of a step). Metric names are "section/name" strings; values
are floats.

wandb and MLflow live in `experiment_trackers` (optional extras, imported only when named);
they also get the run's config at the start and its files (the plot, the step timeline)
at the end.

The progress bar is for a terminal only: when the stream is not one (a log file, a CI
job, a pipe) there is no bar and no carriage return, just one line per step.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from offbeat.core.config.validation import Problems, check
from offbeat.core.trainer.experiment_trackers import (
    TRACKERS,
    ExperimentTracker,
    install_hint,
    open_tracker,
)

if TYPE_CHECKING:
    from offbeat.core.config.run import RunConfig
    from offbeat.core.config.schema import JobConfig, TrainerConfig
    from offbeat.core.trace import Tracer
    from offbeat.core.trainer.checkpoint import CheckpointManager

logger = logging.getLogger(__name__)

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
# The console line: a readable subset (every other logger gets every metric).
CONSOLE_KEYS = (
    ("weight_version", "version"),
    ("reward/mean", "reward"),
    ("response_length_mean", "len"),
    ("off_policy/trajectory_spans_max", "span_max"),
    ("off_policy/trajectory_staleness_mean", "stale"),
    ("buffer/evicted", "evicted"),
    ("buffer/failed_total", "failed_total"),
    ("timing/generate_wait_s", "wait_s"),
    ("timing/train_s", "train_s"),
    ("timing/sync_s", "sync_s"),
    ("sync/gbps", "sync_GBps"),
    ("perf/tokens_per_s", "tok/s"),
    ("logprob_drift/abs_mean", "lp_drift"),
    ("perf/trainer_idle_frac", "trainer_idle"),
    ("perf/rollout_idle_frac", "rollout_idle"),
    ("memory/trainer_peak_gb", "trainer_GB"),
    ("memory/rollout_peak_rss_gb", "rollout_GB"),
)
# The progress bar's postfix, and the step line when the bar is wanted but not shown.
PROGRESS_KEYS = (
    ("reward/mean", "reward"),
    ("val/reward", "val"),
    ("off_policy/trajectory_staleness_mean", "stale"),
    ("perf/tokens_per_s", "tok/s"),
)
PLOT_KEYS = (
    ("reward/mean", "train reward"),
    ("val/reward", "validation reward"),
    ("off_policy/trajectory_staleness_mean", "staleness (versions)"),
    ("off_policy/trajectory_spans_mean", "span (steps)"),
)
# The log-prob drift panel (drawn when the run has any): the trainer's against the
# rollout's log-probs at the same weights, and over every trajectory (with staleness).
DRIFT_KEYS = (
    ("logprob_drift/abs_mean", "|Δ log p| mean, same weights"),
    ("logprob_drift/abs_max", "|Δ log p| max, same weights"),
    ("logprob_drift_all/abs_mean", "|Δ log p| mean, all (incl. staleness)"),
)
# The step-time bar: the phases of a step, in order; what they leave of timing/step_s
# is drawn as "other".
STEP_PHASES = (
    ("timing/generate_wait_s", "generate wait"),
    ("timing/old_log_prob_s", "old log-prob"),
    ("timing/train_s", "train"),
    ("timing/sync_abort_s", "sync abort"),
    ("timing/sync_release_kv_s", "sync release KV"),
    ("timing/sync_transfer_s", "sync transfer"),
    ("timing/sync_resume_kv_s", "sync resume KV"),
    ("timing/sync_resume_s", "sync resume"),
)


class MetricsTracker:
    """Logs one dict of metrics per global step to every configured sink.

    Console lines and the progress bar go to `stream` (default: stdout). The bar is shown
    only when `progress` is asked for and `stream` is a terminal; otherwise every step
    writes exactly one line (the console line, or a short progress line when "console"
    is not among the loggers).

    wandb and MLflow runs are named `project` / `run_name` (default: the folder's name)
    and get `run_config` (a dataclass or a mapping) as their config; MLflow's local store
    goes in `store_dir` (default: `log_dir`). `close` ends them, failed or not.
    """

    def __init__(
        self,
        log_dir: str | Path,
        loggers: Sequence[str] = ("console", "jsonl"),
        *,
        total_steps: int | None = None,
        progress: bool = True,
        start_step: int = 0,
        stream: TextIO | None = None,
        append: bool = True,
        project: str = "offbeat",
        run_name: str | None = None,
        run_config: Any = None,
        store_dir: str | Path | None = None,
    ) -> None:
        unknown = sorted(set(loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(
                f"trainer.loggers={list(loggers)!r}: unknown {unknown}; valid: {LOGGERS}"
            )
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = tuple(loggers)
        self.history: list[dict[str, float]] = []
        self.jsonl_path = self.log_dir / "metrics.jsonl"
        mode = "a" if append else "w"  # `append=False`: a fresh run replaces the old file
        self._jsonl = open(self.jsonl_path, mode) if "jsonl" in self.loggers else None  # noqa: SIM115
        self._tb = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.log_dir / "tensorboard"))
        self._stream = stream if stream is not None else sys.stdout
        self._total = total_steps
        self._progress_lines = progress and "console" not in self.loggers
        self._bar = None
        if progress and total_steps and _is_terminal(self._stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, desc="offbeat", unit="step",
                file=self._stream, disable=False,  # asked for, on a terminal: TQDM_DISABLE aside
            )  # fmt: skip
        self._runs: list[ExperimentTracker] = []
        self._closed = False
        run_args = {
            "project": project,
            "run_name": run_name or self.log_dir.name,
            "config": run_config,
            "log_dir": self.log_dir,
            "store_dir": store_dir if store_dir is not None else self.log_dir,
        }
        try:
            for name in dict.fromkeys(self.loggers):  # one run per tracker
                if name in TRACKERS:
                    self._runs.append(open_tracker(name, **run_args))
        except BaseException:
            self.close(failed=True)
            raise

    def log(self, step: int, metrics: Mapping[str, Any], *, advance: bool = True) -> None:
        """One row for `step`; `advance=False` for extra rows (validation) that neither
        move the progress bar nor print a step line."""
        row = {"step": float(step)}
        for k, v in metrics.items():
            try:
                row[k] = float(v)
            except (TypeError, ValueError):
                continue
        self.history.append(row)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        for run in self._runs:
            run.log(step, row)
        if not advance:
            return
        post = {short: f"{row[k]:.3g}" for k, short in PROGRESS_KEYS if k in row}
        if self._bar is not None:
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)
        label = f"step {step}/{self._total}" if self._total else f"step {step}"
        if "console" in self.loggers:
            shown = [(short, row[k]) for k, short in CONSOLE_KEYS if k in row]
            text = " ".join(f"{short}={v:.4g}" for short, v in shown)
            self._write(f"[{label}] {text}")
        elif self._progress_lines and self._bar is None:
            self._write(f"[{label}] " + " ".join(f"{k}={v}" for k, v in post.items()))

    def event(self, message: str) -> None:
        """A one-line note (validation results, checkpoints, removed replicas)."""
        if "console" in self.loggers:
            self._write(message)

    def _write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self._stream)
        else:
            print(text, file=self._stream, flush=True)

    def plot(self, path: str | Path | None = None) -> Path | None:
        """A PNG of this run's history: reward and staleness over steps, validation reward
        over weight versions, and each step's time by phase (see `plot_history`)."""
        if not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path) if path is not None else self.log_dir / "reward_staleness.png"
        fig = plot_history(self.history)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    @property
    def shows_bar(self) -> bool:
        """Whether a progress bar is drawn (only on a terminal)."""
        return self._bar is not None

    def finish(self, trace: str | Path | None = None) -> Path | None:
        """The end of a run that trained to the end: its plot (None without matplotlib: the
        results stay, the PNG is skipped), then `close` with the plot and the step
        timeline `trace` as artifacts. Returns the plot's path."""
        try:
            plot = self.plot()
        except ImportError as e:
            logger.warning("no reward plot: %s", e)
            plot = None
        self.close(artifacts=[trace, plot])
        return plot

    def close(self, *, artifacts: Sequence[str | Path | None] = (), failed: bool = False) -> None:
        """Close every sink; wandb and MLflow get the `artifacts` that exist (None and
        missing files are skipped) and end as failed or finished. A second call does
        nothing, so a job can close on failure after a clean close."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        files = [Path(a) for a in artifacts if a is not None and Path(a).is_file()]
        for run in self._runs:
            # A tracker that cannot take the files or end its run is reported; it must not
            # hide the run's own result, nor keep the next tracker open.
            try:
                try:
                    if files:
                        run.log_files(files)
                finally:
                    run.finish(failed=failed)
            except Exception:
                logger.warning("%s did not close cleanly", type(run).__name__, exc_info=True)


def plot_history(history: Sequence[Mapping[str, float]]) -> Any:
    """A matplotlib figure of four panels: train and validation reward over steps, the
    validation reward over weight versions (validation rows are logged at their version),
    staleness and span over steps, and a stacked bar per step of `STEP_PHASES`; a fifth,
    the log-prob drift (`DRIFT_KEYS`, log scale), when the history has it."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    drift = [(key, label) for key, label in DRIFT_KEYS if any(key in r for r in history)]
    panels = 5 if drift else 4
    fig, axes = plt.subplots(panels, 1, figsize=(7, 3 * panels))
    ax1, ax_val, ax2, ax_time = axes[:4]
    for key, label in PLOT_KEYS:
        pts = [(r["step"], r[key]) for r in history if key in r]
        if not pts:
            continue
        ax = ax1 if key.startswith(("reward", "val")) else ax2
        ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    ax1.set_ylabel("reward")
    ax1.set_xlabel("global step")
    ax2.set_ylabel("off-policy")
    ax2.set_xlabel("global step")

    val = [(r["step"], r["val/reward"]) for r in history if "val/reward" in r]
    if val:
        ax_val.plot(*zip(*val, strict=True), marker="o", color="C1", label="validation reward")
    ax_val.set_ylabel("validation reward")
    ax_val.set_xlabel("weight version")

    steps = [r for r in history if "timing/step_s" in r]
    x = [r["step"] for r in steps]
    bottom = [0.0] * len(steps)
    for i, (key, label) in enumerate((*STEP_PHASES, ("", "other"))):
        if key:
            h = [r.get(key, 0.0) for r in steps]
        else:
            h = [max(0.0, r["timing/step_s"] - b) for r, b in zip(steps, bottom, strict=True)]
        if any(v > 1e-4 for v in h):  # a phase this run does not have stays out
            ax_time.bar(x, h, bottom=bottom, color=f"C{i}", label=label, width=0.8)
        bottom = [b + v for b, v in zip(bottom, h, strict=True)]
    ax_time.set_ylabel("step time (s)")
    ax_time.set_xlabel("global step")
    if steps:  # room above the bars for the legend
        ax_time.set_ylim(0, 1.4 * max(max(bottom), 1e-9))
    if drift:
        _plot_drift(axes[4], history, drift)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            stacked = ax is ax_time
            ax.legend(
                loc="upper left" if stacked else "best", fontsize="small", ncol=3 if stacked else 1
            )
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def _plot_drift(ax: Any, history: Sequence[Mapping[str, float]], keys: Sequence) -> None:
    for i, (key, label) in enumerate(keys):
        # a zero drift (identical numerics) sits at the bottom of the log scale
        pts = [(r["step"], max(r[key], 1e-12)) for r in history if key in r]
        ax.plot(*zip(*pts, strict=True), marker="o", color=f"C{i}", label=label)
    ax.set_yscale("log")
    ax.set_ylabel("log-prob drift")
    ax.set_xlabel("global step")


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def make_tracker(
    cfg: RunConfig, run_dir: Path, checkpoints: CheckpointManager | None
) -> MetricsTracker:
    """The run's metrics, `trainer.loggers` into `run_dir`. A run that resumes from a
    checkpoint continues its metrics file; any other run starts it afresh (a rerun must
    not read as one run of twice the steps). wandb / MLflow: the run is
    trainer.project_name / experiment_name, its config the resolved one (local model
    path, the step count prepare left)."""
    t = cfg.trainer
    resuming = t.resume and checkpoints is not None and checkpoints.latest()
    return MetricsTracker(
        run_dir, t.loggers, total_steps=t.total_training_steps,
        progress=cfg.runtime.progress_bar, append=bool(resuming), project=t.project_name,
        run_name=t.experiment_name, run_config=cfg, store_dir=t.log_dir,
    )  # fmt: skip


@check
def _loggers(cfg: JobConfig, p: Problems) -> None:
    """trainer.loggers: names in `LOGGERS`, each one's extra installed (wandb, mlflow)."""
    loggers = list(cfg.trainer.loggers)
    if [x for x in loggers if x not in LOGGERS]:
        p.add("trainer.loggers", loggers, f"each one of {list(LOGGERS)}")
    for name in dict.fromkeys(x for x in loggers if x in LOGGERS):
        if hint := install_hint(name):  # an extra that is not installed
            p.add("trainer.loggers", loggers, hint)


def make_tracer(trainer: TrainerConfig, run_dir: Path) -> Tracer | None:
    """The step timeline <run_dir>/trace.json: every step with `trainer.trace`, else the
    first `trainer.trace_steps` (None when that is 0)."""
    from offbeat.core.trace import Tracer

    if not trainer.trace and trainer.trace_steps <= 0:
        return None
    return Tracer(run_dir / "trace.json", steps=None if trainer.trace else trainer.trace_steps)
