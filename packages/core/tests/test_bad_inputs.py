"""Bad inputs get a clear answer and nothing is lost (issue 31, items 2 and 6): files that
cannot be read name the file and why; rows that cannot be prompts, rewards that return no
number or run past `reward.timeout_s`, and tools that return megabytes each end as a
counted failure with a reason, never a crash, and never block the event loop."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from trainer_fakes import FakeTokenizer

from offbeat.core.agent.metrics import agent_metrics
from offbeat.core.agent.parsers import ToolCall
from offbeat.core.agent.tools import Tool, ToolRunner
from offbeat.core.buffer import AsyncReplayBuffer, BufferConfig
from offbeat.core.rewards import RewardRegistry, register_reward
from offbeat.core.rollout import TokenOutput
from offbeat.core.tasks import BAD_ROW, DatasetFileError, PromptDataLoader
from offbeat.core.tasks.bad_rows import read_rows, row_problem
from offbeat.core.tasks.dataloader import count_rows
from offbeat.core.trainer import GroupFailed, SingleTurnAgentLoop
from offbeat.core.trainer.rollout import RolloutDriver
from offbeat.core.user_code import abandoned_threads, call_user_code

GOOD = {"prompt": "q", "data_source": "bad_inputs_ok", "ground_truth": "7"}


@pytest.fixture(autouse=True)
def _rewards():
    register_reward("bad_inputs_ok", lambda response, ground_truth, **_: 1.0)


def write(path, columns: dict) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


def utf8_file(path, raw: bytes) -> str:
    """A parquet file whose row 1 holds `raw` as its prompt, bytes that are not UTF-8."""
    prompts = pa.array([b"fine", raw, b"fine"], pa.binary()).view(pa.string())
    return write(path, {"prompt": prompts, "data_source": ["bad_inputs_ok"] * 3,
                        "ground_truth": ["7"] * 3})  # fmt: skip


class Client:
    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, request_id, prompt_ids, params):
        self.calls += 1
        return TokenOutput([ord("7")], [-0.1], "stop", 0)


def agent(rewards=None, client=None):
    rewards = rewards or RewardRegistry()
    return SingleTurnAgentLoop(client or Client(), FakeTokenizer(), rewards, {"max_tokens": 4})


# ---- files -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, why",
    [
        (lambda p: p.write_bytes(b"id,prompt\n1,hello\n"), "not parquet, or truncated"),
        (lambda p: p.write_bytes(b""), "empty (0 bytes)"),
    ],
    ids=["not_parquet", "zero_bytes"],
)
def test_a_file_that_cannot_be_read_is_named_at_load(tmp_path, make, why):
    path = tmp_path / "train.parquet"
    make(path)
    for load in (lambda: PromptDataLoader([path]), lambda: count_rows([path])):
        with pytest.raises(DatasetFileError) as info:
            load()
        assert str(path) in str(info.value) and why in str(info.value)


def test_a_truncated_file_is_named_at_load(tmp_path):
    whole = write(tmp_path / "whole.parquet", {"prompt": ["q"] * 100})
    data = Path(whole).read_bytes()
    path = tmp_path / "train.parquet"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetFileError, match="not parquet, or truncated") as info:
        PromptDataLoader([path])
    assert str(path) in str(info.value)


def test_a_parquet_file_of_zero_rows_is_refused_by_the_loader(tmp_path):
    path = write(tmp_path / "train.parquet", {"prompt": pa.array([], pa.string())})
    with pytest.raises(ValueError, match="hold no rows"):
        PromptDataLoader([path])


# ---- rows --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "row, problem",
    [
        ({**GOOD, "prompt": None}, "'prompt' is null"),
        ({**GOOD, "prompt": [{"role": "user", "content": None}]}, "message 0 (role 'user') has no 'content'"),
        ({**GOOD, "prompt": [{"role": "user"}]}, "has no 'content'"),
        ({**GOOD, "ground_truth": None}, "the ground truth is null"),
        ({**GOOD, "prompt": "a\ud800b"}, "not valid UTF-8 (a lone surrogate '\\ud800' at character 1)"),
        ({**GOOD, "prompt": 3}, "'prompt' is a int"),
    ],
    ids=["null_prompt", "null_content", "no_content", "null_ground_truth", "lone_surrogate", "int"],
)  # fmt: skip
async def test_a_bad_row_fails_its_group_with_reason_bad_row(row, problem):
    client = Client()
    with pytest.raises(GroupFailed) as info:
        await agent(client=client).sample("g0", row, 2)
    assert info.value.reason == "bad_row"
    assert problem in str(info.value)
    assert client.calls == 0  # nothing was generated for it
    assert row_problem(GOOD) is None


def test_null_ground_truth_is_fine_without_a_ground_truth_column_or_for_an_optional_one():
    row = {"prompt": "q", "data_source": "x"}
    assert row_problem(row) is None
    assert row_problem({**row, "ground_truth": None}, needs_ground_truth=False) is None


@pytest.mark.parametrize(
    "raw, detail",
    [(b"bad\xff\xfe", "invalid start byte at byte 3"), (b"\xed\xa0\x80x", "at byte 0")],
    ids=["invalid_utf8", "cesu8_surrogate"],
)
def test_bytes_that_are_not_utf8_mark_their_row_with_file_and_index(tmp_path, raw, detail):
    path = utf8_file(tmp_path / "train.parquet", raw)
    rows = read_rows(path)
    assert [BAD_ROW in r for r in rows] == [False, True, False]
    mark = rows[1][BAD_ROW]
    assert mark.startswith(f"{path} row 1: column 'prompt' is not valid UTF-8")
    assert detail in mark
    assert rows[1]["data_source"] == "bad_inputs_ok"  # the columns that decode are kept


async def test_a_run_counts_bad_rows_failed_and_trains_the_rest(tmp_path):
    """The loader keeps bad rows in the stream, marked; the rollout driver fails each one
    drawn (reason bad_row, named by file and row) and finishes the good ones: every
    submitted prompt is accounted for."""
    prompts = pa.array([b"good", b"\xff", b"good", b"good"], pa.binary()).view(pa.string())
    bad_utf8 = write(tmp_path / "a.parquet", {"prompt": prompts, "data_source": ["bad_inputs_ok"] * 4,
                                              "ground_truth": ["7"] * 4})  # fmt: skip
    msgs = [[{"role": "user", "content": "q"}], [{"role": "user", "content": None}], None]
    bad_prompt = write(tmp_path / "b.parquet", {"prompt": msgs, "data_source": ["bad_inputs_ok"] * 3,
                                                "ground_truth": ["7"] * 3})  # fmt: skip
    loader = PromptDataLoader([bad_utf8, bad_prompt], shuffle=False)
    buffer = AsyncReplayBuffer(BufferConfig(groups_per_step=7, num_warmup_batches=0))
    driver = RolloutDriver(buffer, loader, agent(), n=2, max_concurrent_groups=2,
                           max_consecutive_failures=10)  # fmt: skip
    first_pass = {f"g{i}" for i in range(7)}  # the 7 rows in order; failed ones are refilled
    driver.start()
    try:
        for _ in range(500):
            finished = {g.uid for g in buffer.core._groups.values() if g.status == "finished"}
            failed = {u for u, how in buffer.core.ledger().items() if how == "failed"}
            if first_pass <= finished | failed:
                break
            await asyncio.sleep(0.01)
        driver.check()
    finally:
        await driver.stop()
    assert failed & first_pass == {"g1", "g5", "g6"}
    assert finished & first_pass == {"g0", "g2", "g3", "g4"}
    c = buffer.core.counts()
    assert driver.failure_metrics() == {"failed/bad_row_total": float(c["failed"])}
    errors = "\n".join(driver.errors)
    assert f"{bad_utf8} row 1: column 'prompt' is not valid UTF-8" in errors
    assert f"{bad_prompt} row 1: 'prompt' message 0 (role 'user') has no 'content'" in errors
    assert f"{bad_prompt} row 2: 'prompt' is null" in errors
    buffer.core.check_accounting()


# ---- rewards -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, said",
    [(None, "returned None (NoneType), not a number"), (math.nan, "returned NaN"),
     ("0.5", "returned '0.5' (str), not a number"), (math.inf, "returned inf"),
     ({"acc": 1.0}, "a dict without 'score'")],
    ids=["none", "nan", "string", "inf", "dict_without_score"],
)  # fmt: skip
async def test_a_reward_that_returns_no_number_fails_its_group(value, said):
    register_reward("bad_inputs_value", lambda response, ground_truth, **_: value)
    row = {**GOOD, "data_source": "bad_inputs_value"}
    with pytest.raises(GroupFailed) as info:
        await agent().sample("g0", row, 2)
    assert info.value.reason == "reward_invalid"
    assert said in str(info.value)


class Heartbeat:
    def __init__(self, period_s: float = 0.01) -> None:
        self.period_s = period_s
        self.ticks = 0

    async def run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(self.period_s)


TIMEOUT_S = 0.3
HANG_S = 3.0  # how long the sync reward blocks its thread (far past the deadline)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_reward_past_its_timeout_fails_in_time_and_never_blocks_the_loop(kind):
    if kind == "sync":

        def hang(response, ground_truth, **_):
            time.sleep(HANG_S)
            return 1.0
    else:

        async def hang(response, ground_truth, **_):
            await asyncio.sleep(HANG_S)
            return 1.0

    register_reward("bad_inputs_hang", hang)
    rewards = RewardRegistry(timeout_s=TIMEOUT_S)
    row = {**GOOD, "data_source": "bad_inputs_hang"}
    beat = Heartbeat()
    task = asyncio.create_task(beat.run())
    t0 = time.perf_counter()
    try:
        with pytest.raises(GroupFailed) as info:
            await agent(rewards).sample("g0", row, 4)
        took = time.perf_counter() - t0
        ticks = beat.ticks
    finally:
        task.cancel()
    assert info.value.reason == "reward_timeout"
    assert f"ran past reward.timeout_s={TIMEOUT_S:g} s" in str(info.value)
    assert took < TIMEOUT_S + 1.0, took  # at the deadline, not when the reward returns
    # The loop ran free meanwhile: ~took / 10 ms ticks (a blocked loop: at most one or two).
    assert ticks >= 10, ticks
    if kind == "sync":
        assert abandoned_threads() >= 1  # its four threads still sleep, abandoned


async def test_a_driver_counts_reward_timeouts_and_keeps_generating():
    """Hung rewards never hold a pool: with more hung calls than reward threads, later
    groups still reach their deadline and are counted, then good ones finish."""
    register_reward("bad_inputs_hang2", lambda response, ground_truth, **_: time.sleep(HANG_S))
    rows = [{**GOOD, "data_source": "bad_inputs_hang2"}] * 3 + [GOOD] * 3

    class Rows:
        i = 0

        def next(self, n):
            out = [rows[(self.i + k) % len(rows)] for k in range(n)]
            self.i += n
            return out

    rewards = RewardRegistry(timeout_s=TIMEOUT_S, threads=2)
    buffer = AsyncReplayBuffer(BufferConfig(groups_per_step=6, num_warmup_batches=0))
    driver = RolloutDriver(buffer, Rows(), agent(rewards), n=2, max_concurrent_groups=3,
                           max_consecutive_failures=10)  # fmt: skip
    driver.start()
    try:
        for _ in range(300):
            c = buffer.core.counts()
            if c["finished"] + c["failed"] == 6:
                break
            await asyncio.sleep(0.02)
        driver.check()
    finally:
        await driver.stop()
    c = buffer.core.counts()
    assert (c["finished"], c["failed"]) == (3, 3), c
    assert driver.failure_metrics() == {"failed/reward_timeout_total": 3.0}


async def test_a_reward_that_raises_timeout_itself_is_an_error_not_a_timeout():
    def raises(response, ground_truth, **_):
        raise TimeoutError("my HTTP call timed out")

    register_reward("bad_inputs_raises", raises)
    with pytest.raises(GroupFailed) as info:
        await agent(RewardRegistry(timeout_s=5)).sample(
            "g0", {**GOOD, "data_source": "bad_inputs_raises"}, 1
        )
    assert info.value.reason == "reward_error" and "my HTTP call timed out" in str(info.value)


async def test_user_code_gives_the_result_of_a_fast_sync_call_and_passes_any_keywords():
    def f(x, limit=None, timeout_s=None):
        return (x, limit, timeout_s)

    assert await call_user_code(f, (1,), {"limit": 2, "timeout_s": 3}, timeout_s=1) == (1, 2, 3)


# ---- tools -------------------------------------------------------------------------------
async def test_a_tool_that_returns_megabytes_is_cut_to_the_cap_and_counted():
    big = Tool("big", lambda: "x" * 5_000_000)
    runner = ToolRunner([big], max_chars=1000)
    (r,) = await runner.run([ToolCall("big", {})])
    assert len(r.content) <= 1000 and not r.error and r.truncated
    assert r.content.endswith("... [5000000 characters, cut to 1000]")

    # a trajectory of the tool loop, as far as the metrics look
    t = SimpleNamespace(info={"tool_truncated": 1.0, "turns": 1.0}, response_mask=None)
    assert agent_metrics([t])["agent/tool_truncated"] == 1.0


async def test_a_hung_sync_tool_times_out_and_does_not_starve_later_calls():
    def hang():
        time.sleep(HANG_S)
        return "late"

    runner = ToolRunner([Tool("hang", hang), Tool("ok", lambda: "fine")], timeout_s=TIMEOUT_S,
                        threads=1)  # fmt: skip
    first = await runner.run([ToolCall("hang", {})])
    t0 = time.perf_counter()
    (ok,) = await runner.run([ToolCall("ok", {})])
    assert first[0].timed_out and first[0].error
    assert ok.content == "fine" and time.perf_counter() - t0 < TIMEOUT_S
