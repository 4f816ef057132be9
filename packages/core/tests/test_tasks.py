"""Synthetic tasks (deterministic, answers checkable by their reward) and the resumable
parquet dataloader."""

from __future__ import annotations

import pytest

from offbeat.core.rewards import RewardRegistry
from offbeat.core.tasks import PromptDataLoader, make_rows, read_parquet, write_task_files


@pytest.mark.parametrize("task", ["reverse", "copy", "add", "mix"])
def test_rows_are_deterministic_and_their_answers_score_one(task):
    rows = make_rows(task, 50, seed=7)
    assert rows == make_rows(task, 50, seed=7)
    assert rows != make_rows(task, 50, seed=8)
    reg = RewardRegistry()
    for r in rows:
        assert r["prompt"][0]["role"] == "user"
        assert reg.score(r["data_source"], r["ground_truth"], r["ground_truth"]) == 1.0


def test_reverse_answer():
    row = make_rows("reverse", 1, seed=0)[0]
    word = row["prompt"][0]["content"].split(": ")[1]
    assert row["ground_truth"] == word[::-1]


def test_bad_task_is_named():
    with pytest.raises(ValueError, match=r"'sort'.*reverse"):
        make_rows("sort", 3)


def test_parquet_round_trip_and_disjoint_val(tmp_path):
    train, val = write_task_files(tmp_path, "reverse", n_train=30, n_val=10, seed=1)
    rows = read_parquet(train)
    assert rows == make_rows("reverse", 30, seed=1)
    assert len(read_parquet(val)) == 10
    assert not list(tmp_path.glob(".*tmp"))


def test_two_writers_of_one_file_in_flight_at_once_never_share_a_temp_file(tmp_path, monkeypatch):
    """Test workers and the background builds write the same cached task file at times:
    a second writer that starts while the first is writing must not write into the first
    one's temp file (a shared one got truncated under the first and renamed into place)."""
    import pyarrow.parquet as pq

    from offbeat.core.tasks import synthetic, write_parquet

    real = pq.write_table
    temps: list[str] = []
    rows_a, rows_b = make_rows("add", 5, seed=1), make_rows("add", 7, seed=2)

    def write_table(table, where, *a, **k):
        temps.append(str(where))
        if len(temps) == 1:  # the second writer runs while the first is in write_table
            write_parquet(rows_b, tmp_path / "task.parquet")
        return real(table, where, *a, **k)

    monkeypatch.setattr(synthetic.pq, "write_table", write_table)
    write_parquet(rows_a, tmp_path / "task.parquet")
    assert len(temps) == 2 and temps[0] != temps[1]
    assert read_parquet(tmp_path / "task.parquet") == rows_a  # the last rename wins, whole
    assert [p.name for p in tmp_path.iterdir()] == ["task.parquet"]  # no temp file left


def test_changed_row_counts_rewrite_the_files_instead_of_reusing_them(tmp_path):
    """`task.n_val=256` after a run that wrote 64 rows into the same directory."""
    train, val = write_task_files(tmp_path, "add", n_train=20, n_val=4, seed=2)
    before = read_parquet(train)
    write_task_files(tmp_path, "add", n_train=20, n_val=9, seed=2)
    assert len(read_parquet(val)) == 9
    assert read_parquet(train) == before  # untouched: same rows asked
    write_task_files(tmp_path, "add", n_train=12, n_val=9, seed=2)
    assert read_parquet(train) == make_rows("add", 12, seed=2)


def test_dataloader_epochs_and_resume(tmp_path):
    train, _ = write_task_files(tmp_path, "copy", n_train=7, n_val=2)
    dl = PromptDataLoader(train, seed=3)
    first_epoch = dl.next(7)
    assert sorted(r["index"] for r in first_epoch) == list(range(7))
    dl.next(3)
    state = dl.state_dict()
    expected = dl.next(9)
    resumed = PromptDataLoader(train, seed=0)
    resumed.load_state_dict(state)
    assert resumed.next(9) == expected


def test_dataloader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PromptDataLoader(tmp_path / "missing.parquet")
    train, _ = write_task_files(tmp_path, "copy", n_train=5, n_val=2)
    dl = PromptDataLoader(train)
    with pytest.raises(ValueError, match="dataset changed"):
        dl.load_state_dict({"epoch": 0, "index": 0, "seed": 0, "size": 6})
