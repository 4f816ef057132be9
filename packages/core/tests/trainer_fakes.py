"""Fakes for the training-loop tests: a rollout server (RolloutServer + SyncTarget that
really receives weights through the ckpt engine's `naive` backend), a train engine, a
tokenizer, and a `Harness` that wires them to the real buffer, agent loop,
PartialRolloutClient, AsyncLoadBalancer, checkpoint engine and Trainer. The trainer
drives the fake engine as a job drives one in the driver: the one rank of a local
`TrainerGroup`, synced by a `GroupCheckpointEngine`."""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.ckpt_engine import ReceiveSpec, receive
from offbeat.core.buffer import AsyncReplayBuffer, BufferConfig
from offbeat.core.config import JobConfig
from offbeat.core.rewards import RewardRegistry
from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig, TokenOutput
from offbeat.core.runtime import GroupCheckpointEngine, TrainerGroup
from offbeat.core.tasks import PromptDataLoader, make_rows, write_parquet
from offbeat.core.trainer import (
    CheckpointManager,
    MetricsTracker,
    ReplicaPool,
    RolloutDriver,
    SingleTurnAgentLoop,
    Trainer,
    Validator,
)
from offbeat.core.trainer.hybrid import HybridReplicas

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
    token per tick; aborts return what was produced; weights arrive through `receive`.
    `hold(request_id)`: while it is true, the request produces nothing (a straggler)."""

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
        self.aborted_calls = 0  # abort_all() calls (one per weight sync)
        self.interrupted = 0  # generate calls that returned "aborted"
        self.hold: Callable[[str], bool] | None = None
        self.asleep = 0  # the level of the last sleep(); 0 once woken
        self.outputs: list[TokenOutput] = []  # what every generate call returned

    @property
    def weight_version(self) -> int:
        if self.dead:
            raise ConnectionError(f"{self.server_id} is dead")
        return self._version

    async def generate(self, request_id, prompt_ids, sampling_params):
        if self.dead:
            raise ConnectionError(f"{self.server_id} is dead")
        await self._running.wait()
        if self.asleep:
            raise RuntimeError(f"{self.server_id} started a request while asleep")
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
        while self.hold is not None and self.hold(request_id):
            await asyncio.sleep(self.tick_s)
            if self._abort != epoch:
                self.interrupted += 1
                return self._out(TokenOutput(out, lps, "aborted", version), request_id)
        for tok in answer[done:]:
            if len(out) >= budget:
                return self._out(TokenOutput(out, lps, "length", version), request_id)
            await asyncio.sleep(self.tick_s)
            if self.dead:
                raise ConnectionError(f"{self.server_id} died mid-request")
            if self._abort != epoch:
                self.interrupted += 1
                return self._out(TokenOutput(out, lps, "aborted", version), request_id)
            out.append(tok)
            lps.append(-0.1)
        return self._out(TokenOutput(out, lps, "stop", version), request_id)

    def _out(self, out: TokenOutput, request_id: str) -> TokenOutput:
        out.extra["request_id"] = request_id
        self.outputs.append(out)
        return out

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
        await self.abort_all()
        self.asleep = level

    async def wake_up(self, tags=None):
        self.asleep = 0

    async def status(self):
        return {"server_id": self.server_id, "asleep_level": self.asleep}

    async def refresh(self):
        return self.weight_version

    async def update_weights(self, spec: ReceiveSpec) -> int:
        if self.dead:
            raise ConnectionError(f"{self.server_id} is dead")

        def load(pairs):
            for name, t in pairs:
                self.weights[name] = t.clone()

        self._version = await asyncio.to_thread(receive, spec, load, self._version)
        return self._version


class FakeEngine:
    """A TrainEngine with one parameter that moves by one each update. The old-policy
    log-probs it computes are -(1 + updates so far) on every response token, so each step's
    differ from the rollout's (-0.1) and from every other step's. `save_s`: how long a
    save blocks its thread (as a real engine's does)."""

    def __init__(self, save_s: float = 0.0) -> None:
        self.w = torch.zeros(4)
        self.updates = 0
        self.log_prob_calls: list[int] = []  # update count at each compute_log_probs
        self.recomputed: list[torch.Tensor] = []  # what each compute_log_probs returned
        self.batches: list[dict] = []
        self.save_s = save_s
        self.saves: list[tuple[float, float]] = []  # (start, end) of each save

    lr = 1e-3
    dp_rank = 0
    dp_size = 1

    @property
    def global_update_count(self) -> int:
        return self.updates

    def compute_log_probs(self, batch, temperature=1.0):
        self.log_prob_calls.append(self.updates)
        mask = batch["response_mask"].float()
        out = -(1.0 + self.updates) * mask
        self.recomputed.append(out.clone())
        return out

    def update(self, mini_batch, temperature=None):
        self.updates += 1
        self.batches.append(mini_batch)
        self.w += 1.0
        return {"actor/loss": float(mini_batch["advantages"].mean()), "actor/lr": self.lr}

    def export_weights(self):
        yield "model.w", self.w.clone()

    def save(self, path):
        t0 = time.perf_counter()
        time.sleep(self.save_s)
        Path(path).mkdir(parents=True)
        torch.save({"w": self.w, "updates": self.updates}, Path(path) / "engine.pt")
        self.saves.append((t0, time.perf_counter()))

    def load(self, path):
        state = torch.load(Path(path) / "engine.pt")
        self.w, self.updates = state["w"], state["updates"]


class RecordingBuffer(AsyncReplayBuffer):
    """Counts the prompts admitted at each step (refills after evictions show here) and the
    span at which each group was trained or evicted (uid -> span)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.submitted_at: Counter[int] = Counter()
        self.trained_spans: dict[str, int] = {}
        self.evicted_spans: dict[str, int] = {}

    async def submit(self, prompts, positions=None):
        self.submitted_at[self.core.current_step] += len(prompts)
        return await super().submit(prompts, positions)

    async def sample(self, num_groups, timeout=None):
        batch, evicted = await super().sample(num_groups, timeout)
        step = self.core.current_step  # the step the trainer waited in (it evicts there)
        self.trained_spans.update((g.uid, g.span(step)) for g in batch)
        self.evicted_spans.update((g.uid, g.span(step)) for g in evicted)
        return batch, evicted


# The section of each job key the trainer reads, by its name (`make_settings(n=4)`).
_SECTIONS = {
    "train_batch_size": "data", "ppo_mini_batch_size": "actor", "ppo_epochs": "actor",
    "parameter_sync_step": "async_training", "n": "rollout", "temperature": "rollout",
    "adv_estimator": "algorithm", "norm_adv_by_std_in_grpo": "algorithm",
    "old_log_prob_source": "algorithm",
}  # fmt: skip


def make_settings(**kw) -> JobConfig:
    """The job config a test's trainer runs: small steps, no checkpoints, no stall
    watchdog, with `kw` (key names without their section) over it."""
    base = dict(
        mode="separate_async", total_training_steps=3, train_batch_size=2,
        ppo_mini_batch_size=1, parameter_sync_step=2, n=2, save_freq=-1,
        stall_timeout_s=None,
    )  # fmt: skip
    base.update(kw)
    job = JobConfig()
    for key, value in base.items():
        section = getattr(job, _SECTIONS.get(key, "trainer"))
        if not hasattr(section, key):
            raise TypeError(f"make_settings: no job key {key!r}")
        setattr(section, key, value)
    return job


class Harness:
    """`max_failures`: the rollout's limit of groups failing in a row (None: no limit).
    `wrap_agent(agent)`: replace the agent loop (e.g. by a fake that fails groups).
    `engine`: a fake train engine (`self.engine`; the trainer drives `self.group`, a local
    group around it) or a `TrainerGroup` (both are it; set `pool.manager` to match)."""

    def __init__(self, tmp: Path, *, servers=1, threshold=2, strategy="drop", warmup=1,
                 max_tokens=16, engine=None, rows=None, tick_s=0.0005, max_failures=None, tracer=None,
                 wrap_agent=None, hybrids=0, replacement=None, **settings):  # fmt: skip
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
        self.engine = engine or FakeEngine()
        self.own_group = not isinstance(self.engine, TrainerGroup)
        self.group = TrainerGroup.around(self.engine) if self.own_group else self.engine
        self.manager = GroupCheckpointEngine(self.group, "naive", phase_timeout_s=10)
        depth_warmup = 0 if self.settings.trainer.mode == "sync" else warmup
        self.buffer = RecordingBuffer(
            BufferConfig(self.settings.data.train_batch_size, threshold, strategy, depth_warmup)
        )
        self.pool = ReplicaPool(
            self.servers, self.balancer, self.manager, health_timeout_s=2, replacement=replacement
        )
        self.agent = SingleTurnAgentLoop(
            self.client, FakeTokenizer(), RewardRegistry(), {"max_tokens": max_tokens},
            on_engine_error=self.pool.on_engine_error,
        )  # fmt: skip
        agent = wrap_agent(self.agent) if wrap_agent else self.agent
        self.driver = RolloutDriver(
            self.buffer, self.loader, agent, n=self.settings.rollout.n, max_concurrent_groups=4,
            max_consecutive_failures=max_failures,
        )  # fmt: skip
        self.pool.on_pause = self.driver.clock.pause
        self.hybrid_servers = {f"h{i}": FakeServer(f"h{i}", tick_s) for i in range(hybrids)}
        self.hybrid = None
        if hybrids:
            manager = GroupCheckpointEngine(self.group, "naive", phase_timeout_s=10, slot="hybrid")
            self.hybrid = HybridReplicas(
                self.hybrid_servers, self.pool, manager, client=self.client, phase_timeout_s=10,
            )  # fmt: skip
        self.tracker = MetricsTracker(tmp / "logs", ("jsonl",), progress=False)
        self.checkpoints = CheckpointManager(tmp / "ckpt")
        self.trainer = Trainer(
            self.settings, engine=self.group, buffer=self.buffer, driver=self.driver,
            pool=self.pool, tracker=self.tracker, checkpoints=self.checkpoints,
            validator=Validator(self.agent, make_rows("reverse", 4, seed=99)), tracer=tracer,
            hybrid=self.hybrid,
        )  # fmt: skip

    async def run(self):
        try:
            return await asyncio.wait_for(self.trainer.run(), 60)
        finally:
            self.tracker.close()
            if self.own_group:  # its rank's threads and backends go; the fake stays
                await self.manager.aclose()
                if self.hybrid is not None:
                    await self.hybrid.manager.aclose()
                self.group.shutdown()

    def rows(self):
        lines = (self.tmp / "logs" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines]

    def train_rows(self):
        return [r for r in self.rows() if "reward/mean" in r]


def check_accounting(h: Harness):
    c = h.buffer.core.counts()
    trained, evicted = h.trainer.trained_uids, h.trainer.evicted_uids
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert c["trained"] == len(trained) and c["evicted"] == len(evicted)
    live = set(h.buffer.core.live_uids())
    ledger = h.buffer.core.ledger()
    assert set(ledger) | live == {f"g{i}" for i in range(c["submitted"])}
    h.buffer.core.check_accounting()
