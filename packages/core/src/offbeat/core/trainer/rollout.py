"""The rollout side of a run: keep the replay buffer fed and its pending groups generated.

Knows nothing about training or weight syncs: a feeder admits prompts from the dataloader
whenever the buffer has free slots (so refills after evictions and failures are automatic
and exact), and `max_concurrent_groups` workers take pending groups, run the agent loop
and report each group finished or failed. It also keeps the clock of how long the rollout
had work in flight (for the rollout idle fraction) and how many tokens it produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from offbeat.core.buffer import AsyncReplayBuffer
from offbeat.core.trainer.agent_loop import GroupFailed, SingleTurnAgentLoop

logger = logging.getLogger(__name__)


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


class RolloutDriver:
    """Feeds `buffer` from `loader` and generates its pending groups with `agent`."""

    def __init__(
        self,
        buffer: AsyncReplayBuffer,
        loader: Any,
        agent: SingleTurnAgentLoop,
        *,
        n: int,
        max_concurrent_groups: int,
    ) -> None:
        if max_concurrent_groups < 1:
            raise ValueError(f"max_concurrent_groups={max_concurrent_groups}: must be >= 1")
        self.buffer = buffer
        self.loader = loader
        self.agent = agent
        self.n = n
        self.max_concurrent_groups = max_concurrent_groups
        self.clock = BusyClock()
        self.tokens_generated = 0
        self.groups_failed = 0
        self.errors: list[str] = []
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
        """Re-raise the first unexpected error of a background task (a bug, not a failed
        group), so a broken rollout side stops the run instead of hanging it."""
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise RuntimeError(f"rollout task {t.get_name()} crashed") from t.exception()

    async def _feed(self) -> None:
        while True:
            slots = await self.buffer.wait_for_slots()
            await self.buffer.submit(self.loader.next(slots))

    async def _work(self) -> None:
        while True:
            (group,) = await self.buffer.take_pending(1)
            self.clock.enter()
            try:
                trajectories = await self.agent.sample(group.uid, group.prompt, self.n)
            except GroupFailed as e:
                self.groups_failed += 1
                self.errors.append(f"{group.uid}: {e}")
                logger.warning("group %s failed: %s", group.uid, e)
                await self.buffer.fail(group.uid, str(e))
                continue
            finally:
                self.clock.exit()
            self.tokens_generated += sum(len(t.response_ids) for t in trajectories)
            await self.buffer.finish(group.uid, trajectories)
