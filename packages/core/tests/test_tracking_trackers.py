"""wandb and MLflow as trainer.loggers, run for real and offline: the run's config, every
metric row at its step and the end-of-run files arrive, read back from what each tool
wrote; a failed job's run ends failed; a missing extra is named, with the command that
installs it, by `offbeat check` before anything starts. The trackers' folders and the
working directory point into tmp_path; nothing lands in the home directory."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from offbeat.core.trainer.tracking import MetricsTracker

needs = {  # the dev group installs both extras; elsewhere these tests skip
    name: pytest.mark.skipif(
        importlib.util.find_spec(name) is None, reason=f"offbeat-core[{name}] not installed"
    )
    for name in ("wandb", "mlflow")
}


@dataclass
class Trainer:
    project_name: str = "offbeat-test"
    experiment_name: str = "exp"
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "mlflow"])


@dataclass
class Config:  # stands in for the job's resolved config: nested dataclasses
    trainer: Trainer = field(default_factory=Trainer)
    model: dict = field(default_factory=lambda: {"path": "/models/tiny", "override_config": {}})


ROWS = [  # (step, metrics, advance): a validation row is logged at its weight version
    (1, {"reward/mean": 0.1, "perf/tokens_per_s": 100.0}, True),
    (2, {"reward/mean": 0.2, "perf/tokens_per_s": 200.0, "timing/step_s": float("nan")}, True),
    (1, {"val/reward": 0.5}, False),
    (3, {"reward/mean": 0.3, "perf/tokens_per_s": 300.0}, True),
]


# What wandb and MLflow would write in the home directory if not pointed elsewhere.
HOME_PATHS = (".netrc", ".config/wandb", ".cache/wandb", ".local/share/wandb", ".mlflow")


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """The trackers' folders and the working directory inside tmp_path; no tracker server
    configured. Afterwards nothing new is in the working directory or the home directory,
    and wandb forgets the settings it read from this environment."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    home = Path.home()
    before = {p for p in HOME_PATHS if (home / p).exists()}
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_ENTITY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for key in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        path = tmp_path / key.lower()
        path.mkdir()
        monkeypatch.setenv(key, str(path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB__DISABLE_STATS", "true")  # no machine probing in a unit test
    monkeypatch.setenv("WANDB__DISABLE_META", "true")
    yield tmp_path
    if (wandb := sys.modules.get("wandb")) is not None:
        wandb.teardown()
    assert {p for p in HOME_PATHS if (home / p).exists()} == before
    assert not any(cwd.iterdir()), list(cwd.rglob("*"))


def run_job(tmp_path: Path, loggers: tuple[str, ...], *, failed: bool = False) -> list[Path]:
    """A job's use of the tracker: rows, then the plot and the step timeline at the end."""
    cfg = Config(trainer=Trainer(loggers=list(loggers)))
    tracker = MetricsTracker(
        tmp_path / "outputs" / "exp", loggers, progress=False,
        project=cfg.trainer.project_name, run_name=cfg.trainer.experiment_name,
        run_config=cfg, store_dir=tmp_path / "outputs",
    )  # fmt: skip
    for step, metrics, advance in ROWS:
        tracker.log(step, metrics, advance=advance)
    trace = tracker.log_dir / "trace.json"
    trace.write_text(json.dumps({"traceEvents": []}))
    plot = None  # a failed job makes no plot (test_tracking_plot tests the real one)
    if not failed:
        plot = tracker.log_dir / "reward_staleness.png"
        plot.write_bytes(b"\x89PNG\r\n\x1a\n")
    tracker.close(artifacts=[trace, plot, tracker.log_dir / "absent.json"], failed=failed)
    tracker.close(failed=True)  # the job's `finally` after a clean close: nothing happens
    return [p for p in (trace, plot) if p is not None]


# ---- MLflow ---------------------------------------------------------------------------
def mlflow_run(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("offbeat-test")
    (run,) = client.search_runs([exp.experiment_id])
    return client, run


@needs["mlflow"]
def test_mlflow_gets_config_metrics_at_their_steps_and_files(sandbox):
    run_job(sandbox, ("jsonl", "mlflow"))
    # The local store a run makes without MLFLOW_TRACKING_URI: in trainer.log_dir.
    client, run = mlflow_run(f"sqlite:///{sandbox / 'outputs' / 'mlflow.db'}")
    assert run.info.run_name == "exp"
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["trainer.experiment_name"] == "exp"
    assert json.loads(params["trainer.loggers"]) == ["jsonl", "mlflow"]
    assert params["model.path"] == "/models/tiny"
    assert json.loads(params["model.override_config"]) == {}

    def history(key):
        return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]

    assert sorted(history("reward/mean")) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert sorted(history("perf/tokens_per_s")) == [(1, 100.0), (2, 200.0), (3, 300.0)]
    assert history("val/reward") == [(1, 0.5)]
    assert history("timing/step_s") == []  # NaN stays out, as in TensorBoard
    names = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert names == {"trace.json", "reward_staleness.png"}
    assert (sandbox / "outputs" / "mlartifacts").is_dir()


@needs["mlflow"]
def test_mlflow_run_of_a_failed_job_ends_failed_in_the_configured_store(sandbox, monkeypatch):
    uri = (sandbox / "mlruns").as_uri()  # MLflow's file store, which it keeps behind a flag
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_job(sandbox, ("mlflow",), failed=True)
    assert not (sandbox / "outputs" / "mlflow.db").exists()
    client, run = mlflow_run(uri)
    assert run.info.status == "FAILED"
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward/mean"))
    assert steps == [1, 2, 3]  # every row written before the run ended
    assert {f.path for f in client.list_artifacts(run.info.run_id)} == {"trace.json"}


# ---- wandb ----------------------------------------------------------------------------
def wandb_records(wandb_dir: Path) -> tuple[Path, list]:
    """The offline run's folder and its records, read from the run's .wandb file: a log of
    protobuf `Record`s in 32 KiB blocks, each chunk with a 7-byte header (CRC, length,
    type: 1 full, 2 first, 3 middle, 4 last), after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    (run_dir,) = (wandb_dir / "wandb").glob("offline-run-*")
    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    block, pos, chunk, records = 32 * 1024, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return run_dir, records


def key_of(item) -> str:  # a name with "/" is stored split, as a nested key
    return item.key or "/".join(item.nested_key)


def of_type(records: list, kind: str) -> list:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


@needs["wandb"]
@pytest.mark.parametrize("failed", [False, True], ids=["finished", "failed"])
def test_wandb_offline_run_gets_config_metrics_at_their_steps_and_files(sandbox, failed):
    files = run_job(sandbox, ("wandb",), failed=failed)
    sys.modules["wandb"].teardown()  # its service may write the file after `finish` returns
    run_dir, records = wandb_records(sandbox / "wandb_dir")
    (run,) = of_type(records, "run")
    assert (run.project, run.display_name) == ("offbeat-test", "exp")
    config = {
        item.key: json.loads(item.value_json)
        for r in [run.config, *of_type(records, "config")]
        for item in r.update
    }
    assert config["trainer"]["loggers"] == ["wandb"]
    assert config["model"] == {"path": "/models/tiny", "override_config": {}}
    rows = [
        {k: json.loads(i.value_json) for i in h.item if not (k := key_of(i)).startswith("_")}
        for h in of_type(records, "history")
    ]
    expected = [{"step": s, **m} for s, m, _ in ROWS]
    assert len(rows) == len(expected)
    for row, want in zip(rows, expected, strict=True):
        assert row.keys() == want.keys()
        for key, value in want.items():
            assert row[key] == value or (math.isnan(value) and math.isnan(float(row[key])))
    saved = {f.path for r in of_type(records, "files") for f in r.files}
    assert {p.name for p in files} <= saved
    assert all((run_dir / "files" / p.name).is_file() for p in files)
    (exit_record,) = of_type(records, "exit")
    assert exit_record.exit_code == (1 if failed else 0)


# ---- a missing extra -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_offbeat_check_says_how_to_install_a_missing_tracker(name, tmp_path, monkeypatch, capsys):
    from offbeat.core import cli

    monkeypatch.setitem(sys.modules, name, None)  # `import <name>` fails, as if not installed
    monkeypatch.setattr(cli, "quiet_progress_bars_off_a_terminal", lambda: None)
    rc = cli.main(["check", "separate_async", f"trainer.loggers=[console,{name}]"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"trainer.loggers=['console', '{name}']:" in err
    assert f"pip install 'offbeat-core[{name}]'" in err
    assert f"uv pip install 'offbeat-core[{name}]'" in err
    with pytest.raises(ImportError, match=rf"pip install 'offbeat-core\[{name}\]'"):
        MetricsTracker(tmp_path, (name,), progress=False)


def test_unknown_logger_names_the_key_the_value_and_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.loggers=\['neptune'\].*'wandb', 'mlflow'"):
        MetricsTracker(tmp_path, ("neptune",), progress=False)
