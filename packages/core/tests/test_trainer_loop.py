"""The training loop with fakes: a fake rollout server (RolloutServer + SyncTarget that
really receives weights through the ckpt engine's `naive` backend), a fake train engine,
the real buffer, agent loop, PartialRolloutClient, AsyncLoadBalancer and
CheckpointEngineManager. Checks versions, staleness bounds, eviction counts, accounting,
resume and replica failure."""

from __future__ import annotations

import asyncio
import json
import zlib
from pathlib import Path

import pytest
import torch

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.ckpt_engine import CheckpointEngineManager, ReceiveSpec, receive
from offbeat.core.buffer import AsyncReplayBuffer, BufferConfig
from offbeat.core.rewards import RewardRegistry, register_reward
from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig, TokenOutput
from offbeat.core.tasks import PromptDataLoader, make_rows, write_parquet
from offbeat.core.trace import MAIN_TRACK, Tracer, nesting_problems
from offbeat.core.trainer import (
    CheckpointManager,
    MetricsTracker,
    ReplicaPool,
    RolloutDriver,
    SingleTurnAgentLoop,
    Trainer,
    TrainerSettings,
    Validator,
)

EOS = 256


class FakeTokenizer:
    """Bytes are tokens; a fixed chat format; ids >= 256 are special."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


class FakeServer:
    """Answers with the reversed word of the prompt ("reverse: abc") plus filler, one
    token per tick; aborts return what was produced; weights arrive through `receive`."""

    def __init__(self, server_id: str, tick_s: float = 0.0005) -> None:
        self.server_id = server_id
        self._version = 0
        self.tick_s = tick_s
        self._running = asyncio.Event()
        self._running.set()
        self._abort = 0
        self.dead = False
        self.weights: dict[str, torch.Tensor] = {}
        self.calls = 0
        self.aborted_calls = 0

    @property
    def weight_version(self) -> int:
        if self.dead:
            raise ConnectionError(f"{self.server_id} is dead")
        return self._version

    async def generate(self, request_id, prompt_ids, sampling_params):
        if self.dead:
            raise ConnectionError(f"{self.server_id} is dead")
        await self._running.wait()
        self.calls += 1
        epoch = self._abort
        budget = sampling_params["max_tokens"]
        text = bytes(t for t in prompt_ids if t < 256).decode()
        word = text.split(": ")[-1].split("\n")[0] if ": " in text else "x"
        # long-tailed lengths, deterministic per request
        extra = zlib.crc32(request_id.encode()) % 7
        answer = list(word[::-1].encode()) + [ord(".")] * extra + [EOS]
        done = sum(1 for t in prompt_ids if t >= 300)  # tokens already produced (marked)
        out, lps = [], []
        version = self._version
        for tok in answer[done:]:
            if len(out) >= budget:
                return TokenOutput(out, lps, "length", version)
            await asyncio.sleep(self.tick_s)
            if self.dead:
                raise ConnectionError(f"{self.server_id} died mid-request")
            if self._abort != epoch:
                return TokenOutput(out, lps, "aborted", version)
            out.append(tok)
            lps.append(-0.1)
        return TokenOutput(out, lps, "stop", version)

    async def abort_all(self):
        self._running.clear()
        self._abort += 1
        self.aborted_calls += 1

    async def resume(self):
        self._running.set()

    async def release_kv_cache(self):
        return None  # nothing to release or restore in a fake

    async def resume_kv_cache(self):
        return None  # nothing to release or restore in a fake

    async def sleep(self, level=1):
        return None  # nothing to release or restore in a fake

    async def wake_up(self, tags=None):
        return None  # nothing to release or restore in a fake

    async def update_weights(self, spec: ReceiveSpec) -> int:
        if self.dead:
            raise ConnectionError(f"{self.server_id} is dead")

        def load(pairs):
            for name, t in pairs:
                self.weights[name] = t.clone()

        self._version = await asyncio.to_thread(receive, spec, load, self._version)
        return self._version


class FakeEngine:
    """A TrainEngine with one parameter that moves by the mean advantage each update."""

    def __init__(self) -> None:
        self.w = torch.zeros(4)
        self.updates = 0
        self.log_prob_calls: list[int] = []  # update count at each compute_log_probs
        self.batches: list[dict] = []

    lr = 1e-3
    dp_rank = 0
    dp_size = 1

    @property
    def global_update_count(self) -> int:
        return self.updates

    def compute_log_probs(self, batch, temperature=1.0):
        self.log_prob_calls.append(self.updates)
        return torch.zeros_like(batch["response_mask"], dtype=torch.float32)

    def update(self, mini_batch):
        self.updates += 1
        self.batches.append(mini_batch)
        self.w += 1.0
        return {"actor/loss": float(mini_batch["advantages"].mean()), "actor/lr": self.lr}

    def export_weights(self):
        yield "model.w", self.w.clone()

    def save(self, path):
        Path(path).mkdir(parents=True)
        torch.save({"w": self.w, "updates": self.updates}, Path(path) / "engine.pt")

    def load(self, path):
        state = torch.load(Path(path) / "engine.pt")
        self.w, self.updates = state["w"], state["updates"]


def make_settings(**kw) -> TrainerSettings:
    base = dict(
        mode="separate_async", total_training_steps=3, train_batch_size=2,
        ppo_mini_batch_size=1, parameter_sync_step=2, n=2, save_freq=-1,
    )  # fmt: skip
    base.update(kw)
    return TrainerSettings(**base)


class Harness:
    def __init__(self, tmp: Path, *, servers=1, threshold=2, strategy="drop", warmup=1,
                 max_tokens=16, engine=None, rows=None, tick_s=0.0005, tracer=None,
                 **settings):  # fmt: skip
        self.tmp = tmp
        self.settings = make_settings(**settings)
        path = tmp / "train.parquet"
        if not path.exists():
            write_parquet(rows or make_rows("reverse", 64, seed=0), path)
        self.loader = PromptDataLoader(path, seed=0)
        self.servers = {f"s{i}": FakeServer(f"s{i}", tick_s) for i in range(servers)}
        self.balancer = AsyncLoadBalancer(dict(self.servers))
        self.client = PartialRolloutClient(
            self.balancer, PartialRolloutConfig(max_tokens=max_tokens)
        )
        self.manager = CheckpointEngineManager("naive", phase_timeout_s=10)
        depth_warmup = 0 if self.settings.mode == "sync" else warmup
        self.buffer = AsyncReplayBuffer(
            BufferConfig(self.settings.train_batch_size, threshold, strategy, depth_warmup)
        )
        self.pool = ReplicaPool(self.servers, self.balancer, self.manager, health_timeout_s=2)
        self.agent = SingleTurnAgentLoop(
            self.client, FakeTokenizer(), RewardRegistry(), {"max_tokens": max_tokens},
            on_engine_error=self.pool.on_engine_error,
        )  # fmt: skip
        self.driver = RolloutDriver(
            self.buffer, self.loader, self.agent, n=self.settings.n, max_concurrent_groups=4
        )
        self.pool.on_pause = self.driver.clock.pause
        self.engine = engine or FakeEngine()
        self.tracker = MetricsTracker(tmp / "logs", ("jsonl",), progress=False)
        self.checkpoints = CheckpointManager(tmp / "ckpt")
        self.trainer = Trainer(
            self.settings, engine=self.engine, buffer=self.buffer, driver=self.driver,
            pool=self.pool, tracker=self.tracker, checkpoints=self.checkpoints,
            validator=Validator(self.agent, make_rows("reverse", 4, seed=99)), tracer=tracer,
        )  # fmt: skip

    async def run(self):
        try:
            return await asyncio.wait_for(self.trainer.run(), 60)
        finally:
            self.tracker.close()

    def rows(self):
        lines = (self.tmp / "logs" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines]


def check_accounting(h: Harness):
    c = h.buffer.core.counts()
    trained, evicted = h.trainer.trained_uids, h.trainer.evicted_uids
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert c["trained"] == len(trained) and c["evicted"] == len(evicted)
    live = set(h.buffer.core.live_uids())
    ledger = h.buffer.core.ledger()
    assert set(ledger) | live == {f"g{i}" for i in range(c["submitted"])}
    h.buffer.core.check_accounting()


async def test_separate_async_three_steps_versions_spans_evictions(tmp_path):
    h = Harness(tmp_path, threshold=2, strategy="drop", warmup=1)
    summary = await h.run()
    assert summary["steps"] == 3 and summary["version"] == 3
    assert [r.version for r in h.trainer.sync_results] == [1, 2, 3]
    assert all(r.ok for r in h.trainer.sync_results)
    assert h.servers["s0"].weight_version == 3
    assert torch.equal(h.servers["s0"].weights["model.w"], h.engine.w)
    train_rows = [r for r in h.rows() if "reward/mean" in r]
    assert [r["weight_version"] for r in train_rows] == [1.0, 2.0, 3.0]
    assert all(r["off_policy/trajectory_spans_max"] <= 2 for r in train_rows)
    assert sum(r["buffer/evicted"] for r in train_rows) == h.buffer.core.counts()["evicted"]
    # 2 updates (parameter_sync_step) per step, each on ppo_mini_batch_size*n rows
    assert h.engine.updates == 6
    assert all(b["input_ids"].shape[0] == 2 for b in h.engine.batches)
    check_accounting(h)
    assert any("val/reward" in r for r in h.rows())
    assert not h.checkpoints.complete()


async def test_wait_threshold_one_is_on_policy(tmp_path):
    h = Harness(tmp_path, threshold=1, strategy="wait", warmup=3)
    await h.run()
    train_rows = [r for r in h.rows() if "reward/mean" in r]
    assert all(r["off_policy/trajectory_spans_max"] == 1 for r in train_rows)
    assert all(r["off_policy/trajectory_staleness_max"] == 0 for r in train_rows)
    check_accounting(h)


async def test_sync_mode_is_on_policy_and_never_interrupts(tmp_path):
    h = Harness(tmp_path, mode="sync")
    await h.run()
    train_rows = [r for r in h.rows() if "reward/mean" in r]
    assert all(r["off_policy/trajectory_spans_max"] == 1 for r in train_rows)
    assert all(r["off_policy/trajectory_staleness_max"] == 0 for r in train_rows)


async def test_decoupled_ppo_uses_start_of_step_weights(tmp_path):
    h = Harness(tmp_path, old_log_prob_source="trainer")
    await h.run()
    # one proximal forward per step, before that step's 2 updates
    assert h.engine.log_prob_calls == [0, 2, 4]


def test_drop_mode_evictions_are_counted_and_refilled(tmp_path):
    # a very slow straggler pattern: long answers with a small budget still finish; use
    # threshold 1 with no warm-up so stale groups are only possible via slow finishing.
    async def main():
        h = Harness(tmp_path, threshold=2, strategy="drop", warmup=1, total_training_steps=5)
        await h.run()
        rows = [r for r in h.rows() if "reward/mean" in r]
        assert rows[-1]["buffer/evicted_total"] == h.buffer.core.counts()["evicted"]
        check_accounting(h)

    asyncio.run(main())


async def test_reward_errors_fail_the_group_not_the_run(tmp_path):
    register_reward("flaky_source", lambda r, g, **_: 1 / 0 if g == "boom" else 1.0)
    rows = make_rows("reverse", 32, seed=1)
    for i, r in enumerate(rows):
        r["data_source"] = "flaky_source"
        r["ground_truth"] = "boom" if i % 2 == 0 else "ok"
    h = Harness(tmp_path, rows=rows)
    summary = await h.run()
    assert summary["steps"] == 3
    assert h.buffer.core.counts()["failed"] >= 1, h.driver.errors
    assert h.driver.groups_failed == h.buffer.core.counts()["failed"]
    check_accounting(h)


async def test_resume_continues_at_next_step_with_same_version(tmp_path):
    h1 = Harness(tmp_path, total_training_steps=2, save_freq=1)
    await h1.run()
    assert [s for s, _ in h1.checkpoints.complete()] == [1, 2]
    w_after_2 = h1.engine.w.clone()
    h2 = Harness(tmp_path, total_training_steps=3, save_freq=1, resume=True)
    summary = await h2.run()
    assert summary["steps"] == 3 and summary["version"] == 3
    # replicas were brought to version 2 (the restored weights) before step 3
    assert [r.version for r in h2.trainer.sync_results] == [3]
    assert h2.engine.updates == 6 and torch.equal(h2.engine.w, w_after_2 + 2)
    assert h2.trainer.trained_uids[: len(h1.trainer.trained_uids)] == h1.trainer.trained_uids
    check_accounting(h2)


async def test_dead_replica_is_removed_and_training_continues(tmp_path):
    h = Harness(tmp_path, servers=2, total_training_steps=4, tick_s=0.002)

    async def kill_later():
        while h.trainer.step < 2:
            await asyncio.sleep(0.005)
        h.servers["s1"].dead = True

    killer = asyncio.create_task(kill_later())
    summary = await h.run()
    await killer
    assert summary["steps"] == 4
    assert "s1" in h.pool.removed and h.pool.server_ids == ["s0"]
    assert h.servers["s0"].weight_version == 4
    assert h.buffer.core.counts()["failed"] == 0  # interrupted requests finished elsewhere
    check_accounting(h)


async def test_null_per_row_sampling_overrides_are_ignored(tmp_path):
    rows = make_rows("reverse", 16, seed=2)
    for i, r in enumerate(rows):  # parquet turns the missing keys into nulls
        r["sampling"] = {"max_tokens": 3, "ignore_eos": True} if i % 2 else {}
    write_parquet(rows, tmp_path / "rows.parquet")
    stored = PromptDataLoader(tmp_path / "rows.parquet", shuffle=False).next(16)
    assert stored[0]["sampling"] == {"max_tokens": None, "ignore_eos": None}
    seen = []

    class Client:
        async def generate(self, request_id, prompt_ids, params):
            seen.append(dict(params))
            return TokenOutput([65], [-0.1], "stop", 0)

    agent = SingleTurnAgentLoop(Client(), FakeTokenizer(), RewardRegistry(), {"max_tokens": 8})
    await agent.sample("g0", stored[0], 1)
    await agent.sample("g1", stored[1], 1)
    assert seen == [{"max_tokens": 8}, {"max_tokens": 3, "ignore_eos": True}]


async def test_a_hung_rollout_fails_the_run_instead_of_hanging(tmp_path):
    h = Harness(tmp_path, stall_timeout_s=0.3)

    async def never(*args, **kwargs):
        await asyncio.Event().wait()

    h.servers["s0"].generate = never
    with pytest.raises(RuntimeError, match=r"finished nothing .*stall_timeout_s"):
        await asyncio.wait_for(h.trainer.run(), 30)


async def test_trace_has_steps_buffer_waits_train_syncs_and_lanes_per_replica(tmp_path):
    tracer = Tracer(tmp_path / "trace.json", steps=2)  # the first 2 of 3 steps
    h = Harness(tmp_path, servers=2, test_freq=1, old_log_prob_source="trainer", tracer=tracer)
    await h.run()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert nesting_problems(events) == []
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    tracks = {
        (e["pid"], e["tid"]): f"{procs[e['pid']]}/{e['args']['name']}"
        for e in events
        if e["name"] == "thread_name"
    }
    by_track: dict[str, list[dict]] = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault(tracks[(e["pid"], e["tid"])], []).append(e)
    main = by_track[MAIN_TRACK]
    steps = [e for e in main if e["name"].startswith("step ")]
    assert [e["name"] for e in steps] == ["step 1", "step 2"]  # step 3 is not traced
    phases = ["generate_wait", "old_log_prob", "train", "sync"]
    phases += ["abort", "release_kv", "transfer", "resume_kv", "resume"]
    for step in steps:
        inside = [
            e["name"]
            for e in main
            if e is not step and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]
        ]
        assert [n for n in inside if n in phases] == phases, inside
        assert inside.count("mini-batch") == 2  # parameter_sync_step
    # step 2 waited for the validation started after step 1's sync
    assert [e["name"] for e in main].count("validation_wait") == 1
    for sid in ("s0", "s1"):
        assert [e["name"] for e in by_track[f"{sid}/sync"]] == [
            "sync v1",
            *phases[4:],
            "sync v2",
            *phases[4:],
        ]
        lanes = [t for t in by_track if t.startswith(f"{sid}/lane ")]
        generates = [e for t in lanes for e in by_track[t]]
        assert generates and {e["name"] for e in generates} == {"generate"}
        assert all({"request", "tokens", "stop"} <= set(e["args"]) for e in generates)


def test_settings_reject_unknown_mode():
    with pytest.raises(ValueError, match=r"trainer\.mode='fast'"):
        Trainer(make_settings(mode="fast"), engine=None, buffer=None, driver=None, pool=None,
                tracker=None)  # fmt: skip
