"""The rollout side of a run: keep the replay buffer fed and its pending groups generated.

Knows nothing about training or weight syncs: a feeder admits prompts from the dataloader
whenever the buffer has free slots (so refills after evictions and failures are automatic
and exact), and `max_concurrent_groups` workers take pending groups, run the agent loop
and report each group finished or failed. It also keeps the clock of how long the rollout
had work in flight (for the rollout idle fraction) and how many tokens it produced.

A failed group is refilled, so a rollout whose every group fails would spin forever: after
`max_consecutive_failures` groups in a row fail with none finishing, the workers stop and
`check()` raises `RolloutFailing`, naming the data source and the first error of the run
of failures. Failed groups are counted by the reason the agent loop gave (`GroupFailed.
reason`: bad_row, reward_timeout, ...): `failure_metrics()`, `failed/<reason>_total`.

Each prompt is submitted with its position in the data order (the loader's
`stream_position`), which the buffer's prompt ledger keeps. With `sample_seed` set, a
group's requests are seeded from (sample_seed, position): the same prompt of the data
order is sampled alike in a resumed run as in an uninterrupted one.

Admissions and finished or failed groups are reported to the run's progress registry
(stages "submission" and "buffer", `offbeat.core.progress`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from offbeat.core import progress
from offbeat.core.buffer import AsyncReplayBuffer, BufferConfig
from offbeat.core.trainer.agent_loop import GroupFailed, SingleTurnAgentLoop

logger = logging.getLogger(__name__)


if TYPE_CHECKING:
    from offbeat.core.config.run import RunConfig
    from offbeat.core.config.schema import JobConfig


class BusyClock:
    """Seconds during which at least one unit of work was in flight and not paused."""

    def __init__(self) -> None:
        self._inflight = 0
        self._paused = False
        self._since: float | None = None
        self.busy_s = 0.0

    def _flush(self) -> None:
        now = time.perf_counter()
        if self._since is not None:
            self.busy_s += now - self._since
        self._since = now if (self._inflight > 0 and not self._paused) else None

    def enter(self) -> None:
        self._flush()
        self._inflight += 1
        self._flush()

    def exit(self) -> None:
        self._flush()
        self._inflight -= 1
        self._flush()

    def pause(self, paused: bool) -> None:
        self._flush()
        self._paused = paused
        self._flush()

    def read(self) -> float:
        self._flush()
        return self.busy_s


class RolloutFailing(RuntimeError):
    """Every prompt group of a window failed: the rollout produces nothing to train on."""


@dataclass
class FailureRun:
    """The groups that failed since the last one finished (in completion order)."""

    count: int = 0
    first_uid: str = ""
    first_source: str = ""
    first_error: str = ""
    sources: dict[str, int] = field(default_factory=dict)

    def add(self, uid: str, source: str, error: str) -> None:
        if self.count == 0:
            self.first_uid, self.first_source, self.first_error = uid, source, error
        self.count += 1
        self.sources[source] = self.sources.get(source, 0) + 1

    def describe(self) -> str:
        return (
            f"data_source {self.first_source!r} (failed groups by data_source: "
            f"{self.sources}); first error, group {self.first_uid}: {self.first_error}"
        )


class RolloutDriver:
    """Feeds `buffer` from `loader` and generates its pending groups with `agent`.

    `max_consecutive_failures`: how many groups in a row may fail (none finishing in
    between) before the rollout gives up (None: never; the trainer's stall watchdog still
    applies). `limit_key` names where that number comes from, for the error message."""

    def __init__(
        self,
        buffer: AsyncReplayBuffer,
        loader: Any,
        agent: SingleTurnAgentLoop,
        *,
        n: int,
        max_concurrent_groups: int,
        max_consecutive_failures: int | None = None,
        limit_key: str = "max_consecutive_failures",
        sample_seed: int | None = None,
    ) -> None:
        if max_concurrent_groups < 1:
            raise ValueError(f"max_concurrent_groups={max_concurrent_groups}: must be >= 1")
        if max_consecutive_failures is not None and max_consecutive_failures < 1:
            raise ValueError(
                f"max_consecutive_failures={max_consecutive_failures}: must be >= 1 or None"
            )
        self.buffer = buffer
        self.loader = loader
        self.agent = agent
        self.n = n
        self.max_concurrent_groups = max_concurrent_groups
        self.clock = BusyClock()
        self.max_consecutive_failures = max_consecutive_failures
        self.limit_key = limit_key
        self.sample_seed = sample_seed
        if (size := _size(loader)) is not None:
            buffer.core.prompts.dataset_size = size
        self.tokens_generated = 0
        self.groups_finished = 0  # groups that can be trained: the rollout's progress
        self.groups_failed = 0
        self.failed_by_reason: dict[str, int] = {}
        self.errors: list[str] = []
        self.failures = FailureRun()  # since the last finished group
        self.fatal: RolloutFailing | None = None
        self._fatal_set = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def running(self) -> bool:
        return bool(self._tasks)

    def start(self) -> None:
        if self._tasks:
            return
        self._tasks = [asyncio.create_task(self._feed(), name="rollout-feeder")]
        self._tasks += [
            asyncio.create_task(self._work(), name=f"rollout-worker-{i}")
            for i in range(self.max_concurrent_groups)
        ]

    async def stop(self) -> None:
        """Cancel the feeder and the workers; groups they held stay `running` in the
        buffer (a checkpoint re-issues them)."""
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def check(self) -> None:
        """Raise `RolloutFailing` once the failure limit was reached; re-raise the first
        unexpected error of a background task (a bug, not a failed group), so a broken
        rollout side stops the run instead of hanging it."""
        if self.fatal is not None:
            raise self.fatal
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise RuntimeError(f"rollout task {t.get_name()} crashed") from t.exception()

    async def wait_fatal(self) -> None:
        """Return once the failure limit is reached (then `check()` raises)."""
        await self._fatal_set.wait()

    def failure_metrics(self) -> dict[str, float]:
        """`failed/<reason>_total`: groups failed since this driver started, by reason."""
        return {f"failed/{r}_total": float(n) for r, n in sorted(self.failed_by_reason.items())}

    def _failed(self, uid: str, row: Any, error: GroupFailed) -> None:
        self.groups_failed += 1
        reason = getattr(error, "reason", "error")
        self.failed_by_reason[reason] = self.failed_by_reason.get(reason, 0) + 1
        self.errors.append(f"{uid}: {error}")
        logger.warning("group %s failed (%s): %s", uid, reason, error)
        source = row.get("data_source", "") if hasattr(row, "get") else ""
        self.failures.add(uid, str(source), str(error))
        limit = self.max_consecutive_failures
        if limit is not None and self.failures.count >= limit and self.fatal is None:
            self.fatal = RolloutFailing(
                f"the rollout is failing: {self.failures.count} prompt groups in a row failed "
                f"and none finished ({self.limit_key}: {limit} groups), so there is nothing "
                f"to train on; {self.failures.describe()}"
            )
            self._fatal_set.set()

    async def _feed(self) -> None:
        while True:
            slots = await self.buffer.wait_for_slots()
            # No await between the draw and the submit: the two stay one snapshot.
            start = getattr(self.loader, "stream_position", None)
            rows = self.loader.next(slots)
            positions = None if start is None else range(start, start + len(rows))
            await self.buffer.submit(rows, positions)
            progress.advance("submission", n=len(rows))

    def group_seed(self, uid: str) -> int | None:
        """The seed of group `uid`'s first sample (sample i: + i), from its position in
        the data order; None without `sample_seed`."""
        position = self.buffer.core.prompts.position_of(uid)
        if self.sample_seed is None or position is None:
            return None
        return zlib.crc32(f"{self.sample_seed}:{position}".encode()) & 0x3FFFFFFF

    async def _sample(self, group: Any) -> list[Any]:
        seed = self.group_seed(group.uid)
        if seed is None:
            return await self.agent.sample(group.uid, group.prompt, self.n)
        return await self.agent.sample(group.uid, group.prompt, self.n, {"seed": seed})

    async def _work(self) -> None:
        while self.fatal is None:
            (group,) = await self.buffer.take_pending(1)
            self.clock.enter()
            try:
                trajectories = await self._sample(group)
            except GroupFailed as e:
                self._failed(group.uid, group.prompt, e)
                await self.buffer.fail(group.uid, str(e), getattr(e, "reason", "error"))
                progress.fail("buffer", error=f"group {group.uid} failed ({e.reason}): {e}")
                continue
            finally:
                self.clock.exit()
            self.tokens_generated += sum(len(t.response_ids) for t in trajectories)
            self.groups_finished += 1
            self.failures = FailureRun()
            await self.buffer.finish(group.uid, trajectories)
            progress.advance("buffer")


def _size(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def make_buffer(cfg: JobConfig) -> AsyncReplayBuffer:
    """The run's replay buffer: `data.train_batch_size` groups a step, the staleness bound
    and warm-up of `async_training` (no warm-up in trainer.mode=sync, where generation
    and training alternate)."""
    s = cfg.async_training
    return AsyncReplayBuffer(
        BufferConfig(
            groups_per_step=cfg.data.train_batch_size,
            max_off_policy_threshold=s.max_off_policy_threshold,
            max_off_policy_strategy=s.max_off_policy_strategy,
            num_warmup_batches=0 if cfg.trainer.mode == "sync" else s.num_warmup_batches,
        )
    )


def make_driver(
    cfg: RunConfig, buffer: AsyncReplayBuffer, loader: Any, agent: Any
) -> RolloutDriver:
    """The run's rollout driver: `rollout.n` samples a prompt, `rollout.seed`'s per-prompt
    seeds, `runtime.max_concurrent_groups` workers, and a stop after
    `runtime.max_failed_batches` train batches' worth of groups fail in a row."""
    rt, batch = cfg.runtime, cfg.data.train_batch_size
    return RolloutDriver(
        buffer, loader, agent, n=cfg.rollout.n,
        max_concurrent_groups=rt.max_concurrent_groups,
        max_consecutive_failures=rt.max_failed_batches * batch,
        limit_key=f"runtime.max_failed_batches={rt.max_failed_batches} × "
        f"data.train_batch_size={batch}",
        sample_seed=cfg.rollout.seed,
    )  # fmt: skip
