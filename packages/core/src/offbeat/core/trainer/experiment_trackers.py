"""The experiment trackers `trainer.loggers` may name beside the built-in sinks: Weights &
Biases ("wandb") and MLflow ("mlflow"). Each comes from an extra of offbeat-core
(`offbeat-core[wandb]`, `offbeat-core[mlflow]`) and is imported only when a run names it.

Knows nothing about the training loop or what a metric means: a tracker gets the run's
config once, one row of floats per logged row (its "step" is the x axis), a few files at
the end, and whether the run failed.

Where their files go without a server: wandb follows WANDB_MODE (offline: the run's
`wandb/offline-run-*` folder, uploaded later with `wandb sync`; WANDB_DIR moves it).
MLflow writes to MLFLOW_TRACKING_URI, else to a SQLite store `mlflow.db` with the
artifacts in `mlartifacts/`, both in `store_dir` (the job passes trainer.log_dir, so one
store holds every experiment's runs).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "TRACKERS",
    "ExperimentTracker",
    "MlflowRun",
    "WandbRun",
    "install_hint",
    "missing_modules",
    "open_tracker",
    "plain_config",
]

# MLflow stores that go through SQLAlchemy (its local default is one of them).
_SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
# The shortest parameter value an MLflow server has accepted (6000 since 2.x, 500 before).
_MLFLOW_PARAM_CHARS = 500


def missing_modules(name: str) -> list[str]:
    """The modules logger `name` imports that this environment does not have ([] for the
    built-in loggers). Found without importing them."""
    return [m for m in _required_modules(name) if not _importable(m)]


def install_hint(name: str) -> str | None:
    """What to install for logger `name`, or None when nothing is missing."""
    gone = missing_modules(name)
    if not gone:
        return None
    return (
        f"{name!r} needs the offbeat-core[{name}] extra (not importable: {', '.join(gone)}); "
        f"install it with: pip install 'offbeat-core[{name}]' "
        f"(or: uv pip install 'offbeat-core[{name}]')"
    )


def _required_modules(name: str) -> tuple[str, ...]:
    if name == "wandb":
        return ("wandb",)
    if name == "mlflow":
        scheme = os.environ.get("MLFLOW_TRACKING_URI", "").split(":", 1)[0].split("+")[0]
        local_or_sql = not os.environ.get("MLFLOW_TRACKING_URI") or scheme in _SQL_SCHEMES
        return ("mlflow", "sqlalchemy", "alembic") if local_or_sql else ("mlflow",)
    return ()


def _importable(module: str) -> bool:
    try:  # a module set to None in sys.modules is None here too (import blocked)
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def plain_config(config: Any) -> dict[str, Any]:
    """A config (a dataclass or a mapping) as nested dicts of JSON values; anything JSON has
    no type for (a Path, an enum) becomes its string."""
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    return json.loads(json.dumps(dict(config), default=str))


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in tree.items():
        if isinstance(v, Mapping) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


class ExperimentTracker:
    """One run in an external tracker."""

    def log(self, step: int, row: Mapping[str, float]) -> None:
        raise NotImplementedError

    def log_files(self, paths: Sequence[Path]) -> None:
        raise NotImplementedError

    def finish(self, *, failed: bool) -> None:
        raise NotImplementedError


class WandbRun(ExperimentTracker):
    """A wandb run: the config as the run's config, each row as one `log` call, the files
    saved into the run."""

    def __init__(
        self, *, project: str, name: str, config: Mapping[str, Any], log_dir: Path, store_dir: Path
    ) -> None:
        import wandb

        # WANDB_DIR read now: wandb reads its environment once per process.
        where = os.environ.get("WANDB_DIR") or str(log_dir)
        self.run = wandb.init(project=project, name=name, config=dict(config), dir=where)
        # Rows arrive in step order except validation rows (logged at their weight version):
        # the row's "step" is the x axis, not wandb's own counter, which only goes up.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, row: Mapping[str, float]) -> None:
        self.run.log(dict(row))

    def log_files(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self.run.save(str(path), base_path=str(path.parent), policy="now")

    def finish(self, *, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowRun(ExperimentTracker):
    """An MLflow run in the experiment `project`: the config flattened to parameters
    ("trainer.loggers"), each row as metrics at its step, the files as artifacts. Talks to
    the store through an `MlflowClient`, so no process-wide active run is set. Rows go
    out in order on a thread of their own (a tracking server's round trip stays off the
    training loop's event loop; MLflow's own `synchronous=False` writes a file store's
    rows concurrently and loses some); `finish` waits for them."""

    def __init__(
        self, *, project: str, name: str, config: Mapping[str, Any], log_dir: Path, store_dir: Path
    ) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:  # no server: a local store beside the runs (not MLflow's ./mlruns)
            store = Path(store_dir).resolve()
            store.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{store / 'mlflow.db'}"
            artifacts = (store / "mlartifacts").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(project)
        exp_id = (
            exp.experiment_id
            if exp is not None
            else self.client.create_experiment(project, artifact_location=artifacts)
        )
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mlflow-rows")
        params = {_mlflow_key(k): _param_value(v) for k, v in _leaves(config)}
        try:
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])
        except BaseException:
            self.finish(failed=True)
            raise

    def log(self, step: int, row: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [
            Metric(_mlflow_key(k), v, ms, int(step))
            for k, v in row.items()
            if k != "step" and math.isfinite(v)  # as TensorBoard: NaN/inf stay out
        ]
        if metrics:
            sent = self._writer.submit(self.client.log_batch, self.run_id, metrics=metrics)
            sent.add_done_callback(_warn_if_failed)

    def log_files(self, paths: Sequence[Path]) -> None:
        # The rows first: a file store read while a row is half written reads it as
        # malformed (log_artifact reads the run back).
        self._writer.shutdown(wait=True)
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def finish(self, *, failed: bool) -> None:
        try:
            self._writer.shutdown(wait=True)  # every row written before the run ends
        finally:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def _warn_if_failed(sent: Future) -> None:
    # A row the store refused is reported; the training goes on.
    if (error := sent.exception()) is not None:
        logger.warning("MLflow did not take a row of metrics: %r", error)


def _mlflow_key(key: str) -> str:
    # MLflow names take letters, digits, "_", "-", ".", " " and "/" only.
    return re.sub(r"[^\w./ -]", "_", key)


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= _MLFLOW_PARAM_CHARS else text[: _MLFLOW_PARAM_CHARS - 3] + "..."


TRACKERS: dict[str, type[ExperimentTracker]] = {"wandb": WandbRun, "mlflow": MlflowRun}


def open_tracker(
    name: str,
    *,
    project: str,
    run_name: str,
    config: Any,
    log_dir: str | Path,
    store_dir: str | Path,
) -> ExperimentTracker:
    """Start a run of tracker `name`; an ImportError says what to install when its extra
    is missing (`offbeat check` says so before anything starts)."""
    if hint := install_hint(name):
        raise ImportError(f"trainer.loggers: {hint}")
    return TRACKERS[name](
        project=project,
        name=run_name,
        config=plain_config(config),
        log_dir=Path(log_dir),
        store_dir=Path(store_dir),
    )
