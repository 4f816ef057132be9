"""The training loop of `sync` and `separate_async` runs.

One global step: take the oldest finished batch from the replay buffer (waiting for it is
the trainer's idle time), compute advantages and old-policy log-probs, run
`parameter_sync_step` mini-batch updates, then one weight sync to every rollout replica,
so one global step is one model version. In `separate_async` the rollout keeps generating
during the update (the buffer admits `1 + num_warmup_batches` batches ahead; a sync
interrupts in-flight requests, which the client resumes on the new weights); in `sync`
the buffer admits one batch at a time, so generation and training alternate.

Validation runs in the background on the rollout replicas; with hybrid replicas
(`offbeat.core.trainer.hybrid`) it runs as a validation cycle on the trainer's devices
too, and the trainer waits for it. While the trainer waits for a batch, replacements of
dead replicas join at its weight version (`ReplicaPool.admit`).

Knows nothing about the concrete engines: it drives a `TrainerGroup` (whose calls are
coroutines; one rank in this process when the trainer runs in the driver), a
`ReplicaPool` (weight syncs), a `RolloutDriver` (generation) and an `AsyncReplayBuffer`. Each step's
phases are spans of the run's step timeline, when it has one (`offbeat.core.trace`), and
report to the run's progress registry, which the stall watchdog reads while the rollout
runs (`offbeat.core.trainer.watchdog`, `trainer.stall_timeout_s`).
Step hooks see each trained batch and may add metrics (rollout record and replay).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from offbeat.core import progress, trace
from offbeat.core.agent.metrics import agent_metrics
from offbeat.core.algorithms.advantages import compute_advantages
from offbeat.core.algorithms.logprob_drift import DRIFT_MASK
from offbeat.core.buffer import AsyncReplayBuffer, PromptGroup
from offbeat.core.config.support import needs_critic
from offbeat.core.config.validation import TRAINER_MODES
from offbeat.core.data import TrajectoryBatch
from offbeat.core.trainer.checkpoint import CheckpointManager, rng_state, set_rng_state
from offbeat.core.trainer.logprob_drift import (
    DriftWarning,
    drift_mask_of,
    drift_of_old_log_probs,
)
from offbeat.core.trainer.replicas import ReplicaPool
from offbeat.core.trainer.rollout import RolloutDriver
from offbeat.core.trainer.tracking import MetricsTracker
from offbeat.core.trainer.validation import Validator
from offbeat.core.trainer.watchdog import StallWatchdog

if TYPE_CHECKING:
    from offbeat.core.config.schema import AlgorithmConfig, JobConfig

logger = logging.getLogger(__name__)

MODES = TRAINER_MODES  # trainer.mode, checked by the config rules before anything starts


def build_train_batch(
    groups: list[PromptGroup], algorithm: AlgorithmConfig, pad_token_id: int = 0
) -> tuple[TrajectoryBatch, dict[str, torch.Tensor]]:
    """The padded batch of every trajectory of `groups` (group by group) and the tensor
    dict the train engine reads, with `algorithm.adv_estimator`'s advantages."""
    s = algorithm
    trajectories = [t for g in groups for t in g.trajectories]
    batch = TrajectoryBatch.pad(trajectories, pad_token_id=pad_token_id)
    # GAE's advantages come with the critic's values (CriticAndReference.prepare fills them).
    advantages = (
        torch.zeros_like(batch.rollout_log_probs)
        if needs_critic(s.adv_estimator)
        else compute_advantages(
            s.adv_estimator,
            rewards=batch.rewards,
            response_mask=batch.response_mask,
            group_uids=batch.group_uids,
            norm_by_std=s.norm_adv_by_std_in_grpo,
        )[0]
    )
    data = {
        "input_ids": torch.cat([batch.prompt_ids, batch.response_ids], dim=1),
        # Tool and template tokens of a multi-turn response are attended to, not trained.
        "attention_mask": batch.attention_mask,
        "response_mask": batch.response_mask,
        "advantages": advantages.float(),
        "rollout_log_probs": batch.rollout_log_probs,
        "old_log_probs": batch.rollout_log_probs,
    }
    if batch.multi_modal is not None:  # each row's vision inputs (a VLM's image prompts)
        data["multi_modal"] = list(batch.multi_modal)
    return batch, data


def _rows(data: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in data.items()}


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        f"{prefix}_mean": sum(values) / len(values),
        f"{prefix}_max": max(values),
        f"{prefix}_min": min(values),
    }


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux: KiB


class Trainer:
    """Runs global steps until `trainer.total_training_steps`; see the module docstring.

    `job`: the sections it reads are `trainer` (steps, save/test frequency, resume, the
    stall watchdog, the drift warning), `data.train_batch_size`, `actor` (mini-batch
    size, epochs), `async_training.parameter_sync_step`, `rollout` (n, temperature) and
    `algorithm` (advantage estimator, old-log-prob source); `pad_token_id`: the
    tokenizer's."""

    def __init__(
        self,
        job: JobConfig,
        *,
        pad_token_id: int = 0,
        engine: Any,
        buffer: AsyncReplayBuffer,
        driver: RolloutDriver,
        pool: ReplicaPool,
        tracker: MetricsTracker,
        checkpoints: CheckpointManager | None = None,
        validator: Validator | None = None,
        rollout_memory: Any = None,
        version_offset: int = 0,
        tracer: trace.Tracer | None = None,
        batch_hook: Any = None,
        step_hooks: Sequence[Any] = (),
        critic_ref: Any = None,
        hybrid: Any = None,
    ) -> None:
        self.job = job
        self.pad_token_id = pad_token_id
        # Greedy rollout (temperature 0) has no distribution to match: score at 1 then.
        self.temperature = job.rollout.temperature or 1.0
        self.engine = engine
        self.buffer = buffer
        self.driver = driver
        self.pool = pool
        self.tracker = tracker
        self.checkpoints = checkpoints
        self.validator = validator
        self.rollout_memory = rollout_memory  # async () -> dict of engine memory metrics
        # Replicas that already hold version v (shared engines, attached pools) start the
        # numbering there: step t syncs version `version_offset + t`.
        self.version_offset = version_offset
        self.version = version_offset
        self.step = 0
        self.trained_uids: list[str] = []
        self.evicted_uids: list[str] = []
        self.val_history: list[tuple[int, float]] = []
        self._val_task: asyncio.Task | None = None
        self._val_version = 0  # the version the validation under way measures
        self.val_abandoned: list[tuple[int, str]] = []  # (version, why)
        self.sync_results: list[Any] = []
        self.tracer = tracer or trace.Tracer(None, steps=0)  # the step timeline; default off
        # A recipe's say over each train batch (e.g. distillation advantages):
        # `batch_hook(batch, data) -> metrics`, run in a worker thread; it may replace
        # tensors of `data` (the train engine's input).
        self.batch_hook = batch_hook
        # After each step, `hook.after_step(step, groups, batch, metrics)` (it may add
        # metrics; e.g. rollout record/replay); `await hook.close()` when the run ends.
        self.step_hooks = list(step_hooks)
        # The critic and/or reference model (offbeat.core.trainer.ppo.CriticAndReference).
        self.critic_ref = critic_ref
        # HybridReplicas: validation cycles on the trainer's devices (None: no hybrids).
        self.hybrid = hybrid
        self.hybrid_metrics: list[tuple[int, dict[str, float]]] = []
        self.drift_warning = DriftWarning(job.trainer.logprob_drift_warn)

    # ---- checkpoint ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything but the engine; taken with no await in between, so the dataloader
        position and the buffer agree."""
        return {
            "step": self.step,
            "version": self.version,
            "version_offset": self.version_offset,
            "dataloader": self.driver.loader.state_dict(),
            "buffer": self.buffer.core.state_dict(),
            "rng": rng_state(),
            "trained_uids": list(self.trained_uids),
            "evicted_uids": list(self.evicted_uids),
            "critic_ref": self.critic_ref.state() if self.critic_ref is not None else None,
        }

    def _other_engines(self) -> dict[str, Any]:
        """`others=` for the checkpoint manager: engines saved beside the actor's (the
        critic); no keyword at all without them."""
        others = self.critic_ref.engines() if self.critic_ref is not None else {}
        return {"others": others} if others else {}

    def _restore(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.version = int(state["version"])
        self.version_offset = int(state.get("version_offset", 0))
        self.driver.loader.load_state_dict(state["dataloader"])
        self.buffer.core.load_state_dict(state["buffer"])
        set_rng_state(state["rng"])
        self.trained_uids = list(state.get("trained_uids", []))
        self.evicted_uids = list(state.get("evicted_uids", []))
        if self.critic_ref is not None and state.get("critic_ref") is not None:
            self.critic_ref.load_state(state["critic_ref"])

    async def _save(self) -> None:
        """Save in a worker thread: the rollout keeps generating meanwhile. The state is
        taken here, on the loop, so it is one consistent snapshot."""
        if self.checkpoints is None:
            return
        state = self.state()
        with progress.exempt("checkpoint save"):  # may take long: the watchdog holds
            path = await asyncio.to_thread(
                self.checkpoints.save, self.step, self.engine, state, **self._other_engines()
            )
        self.tracker.event(f"[step {self.step}] checkpoint saved: {path}")

    # ---- validation ----------------------------------------------------------------------
    async def _finish_validation(self, *, weights_at_version: bool = True) -> None:
        """Wait for the validation under way. `weights_at_version`: the trainer's weights
        are still `self.version` (no update since the last sync), so a replacement waiting
        to join is admitted meanwhile; a validation whose every replica died waits for it.
        After an update they cannot be: a validation left without any replica while a
        replacement waits is abandoned (its version's weights are gone), never awaited
        forever."""
        if self._val_task is None:
            return
        task, self._val_task = self._val_task, None
        with trace.span("validation_wait"), progress.phase("waiting for the validation"):
            while not task.done():
                await asyncio.wait([task], timeout=1.0)
                if task.done() or not self.pool.joining:
                    continue
                if weights_at_version:
                    await self.pool.admit(self.engine.export_weights, self.version)
                elif not self.pool.servers and not self.pool.guests:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    why = (
                        "every replica serving it was lost after the trainer's weights moved "
                        f"on; replicas removed: {self.pool.removed}"
                    )
                    self.val_abandoned.append((self._val_version, why))
                    self.tracker.event(
                        f"[validation] weight version {self._val_version} abandoned: {why}"
                    )
                    return
            version, metrics = task.result()
        self.val_history.append((version, metrics["val/reward"]))
        self.tracker.log(version, metrics, advance=False)
        self.tracker.event(
            f"[validation] weight version {version}: "
            + " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        )

    def _start_validation(self) -> None:
        if self.validator is None:
            return
        version = self.version

        async def run() -> tuple[int, dict[str, float]]:
            return version, await self.validator.run(tag=f"v{version}")

        self._val_task = asyncio.create_task(run(), name=f"validation-v{version}")
        self._val_version = version

    async def _validate(self) -> None:
        """Validate the current version: on the hybrid replicas too when there are any
        (the trainer waits: its devices serve them), else in the background."""
        if self.validator is None:
            return
        if self.hybrid is None or not self.hybrid.servers:
            self._start_validation()
            return
        await self._finish_validation()
        version = self.version

        async def run() -> tuple[int, dict[str, float]]:
            with trace.span("validation_cycle", version=version):
                metrics, cycle = await self.hybrid.cycle(
                    self.engine.export_weights, version,
                    lambda: self.validator.run(tag=f"v{version}"),
                )  # fmt: skip
            self.hybrid_metrics.append((version, cycle))
            return version, {**metrics, **cycle}

        self._val_task = asyncio.create_task(run(), name=f"validation-cycle-v{version}")
        self._val_version = version
        await self._finish_validation()

    def _hybrid_levels(self) -> asyncio.Future | None:
        """The hybrid replicas' sleep levels, asked now (None without hybrid replicas)."""
        if self.hybrid is None or not self.hybrid.servers:
            return None
        return asyncio.ensure_future(self.hybrid.asleep_levels())

    # ---- the loop ------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        s, estimator = self.job.trainer, self.job.algorithm.adv_estimator
        if needs_critic(estimator) and getattr(self.critic_ref, "critic", None) is None:
            raise ValueError(
                f"adv_estimator={estimator!r} needs a critic: pass critic_ref="
                "CriticAndReference.build(...) (offbeat.core.trainer.ppo)"
            )
        start = 1
        if s.resume and self.checkpoints is not None and (path := self.checkpoints.latest()):
            state = await asyncio.to_thread(
                self.checkpoints.load, path, self.engine, **self._other_engines()
            )
            self._restore(state)
            start = self.step + 1
            self.tracker.event(f"resumed from {path} at step {start} (version {self.version})")
            # The replicas started from the base model: bring them to the restored version.
            await self.pool.sync(self.engine.export_weights, self.version)
        run_t0 = time.perf_counter()
        token = trace.activate(self.tracer)  # the rollout tasks started below inherit it
        watchdog = StallWatchdog.for_trainer(self)  # and its progress registry
        watchdog.arm()
        self.driver.start()
        try:
            if s.val_before_train and self.validator is not None:
                await self._validate()
                await self._finish_validation()
            for step in range(start, s.total_training_steps + 1):
                with (
                    trace.span(f"step {step}", trace.MAIN_TRACK, step=step),
                    progress.phase(f"step {step}"),
                ):
                    metrics = await self._global_step(step)
                self.tracker.log(step, metrics)
                await self.tracer.end_step()  # writes the step's spans off the event loop
                if s.save_freq > 0 and step % s.save_freq == 0:
                    await self._save()
            await self._finish_validation()
        except BaseException as e:
            watchdog.raise_stall(e)  # the StallError, when the watchdog stopped the run
            raise
        finally:
            watchdog.disarm()
            await self.driver.stop()
            await self.tracer.close()
            for hook in self.step_hooks:
                await hook.close()
            trace.deactivate(token)
        if s.save_freq == 0 and self.step >= start:
            await self._save()
        self.buffer.core.check_accounting()  # and the prompt ledger: none lost, none twice
        self.tracker.event(f"{self.buffer.core.prompts.describe()}; none duplicated, none lost")
        return {
            "wall_s": time.perf_counter() - run_t0,
            "steps": self.step,
            "version": self.version,
            "counts": self.buffer.core.counts(),
            "prompts": self.buffer.core.prompts.summary(),
            "val_history": self.val_history,
            "val_abandoned": self.val_abandoned,
        }

    async def _wait_for_batch(self, step: int) -> tuple[list[PromptGroup], list[PromptGroup]]:
        waiter = asyncio.ensure_future(self.buffer.sample(self.job.data.train_batch_size))
        fatal = asyncio.ensure_future(self.driver.wait_fatal())
        try:
            while True:  # a rollout that stops advancing: the stall watchdog's (run())
                await asyncio.wait(
                    [waiter, fatal], timeout=1.0, return_when=asyncio.FIRST_COMPLETED
                )
                if waiter.done():
                    progress.advance("buffer")  # a batch taken
                    return waiter.result()
                if self.pool.joining:  # the weights are `self.version` while we wait
                    await self.pool.admit(self.engine.export_weights, self.version)
                self.driver.check()  # the failure limit, or a crashed rollout task
        finally:
            fatal.cancel()
            if not waiter.done():
                waiter.cancel()

    async def _global_step(self, step: int) -> dict[str, float]:
        """One global step: a batch of finished groups, what the update needs beside it
        (old and reference log-probs, values), the update, the weight sync (and a
        validation when one is due), then the step's metrics."""
        s = _Step(step, time.perf_counter(), self.driver.clock.read(), self.driver.tokens_generated)
        await self.buffer.begin_step(step)
        self.step = step
        self.engine.begin_step(step)  # the group's errors name the step
        await self._take_batch(s)
        await self._before_update(s)
        await self._update(s)
        await self._sync_and_validate(s)
        s.times["step_s"] = time.perf_counter() - s.t0
        return await self._step_metrics(s)

    async def _take_batch(self, s: _Step) -> None:
        """Wait for the step's batch of finished groups; build the train batch; a
        recipe's batch hook has its say."""
        job = self.job
        t0 = time.perf_counter()
        waiting = f"waiting for a batch of {job.data.train_batch_size} prompt groups"
        with trace.span("generate_wait"), progress.phase(f"step {s.step}: {waiting}"):
            s.groups, s.evicted = await self._wait_for_batch(s.step)
        s.times["generate_wait_s"] = time.perf_counter() - t0
        self.trained_uids += [g.uid for g in s.groups]
        self.evicted_uids += [g.uid for g in s.evicted]
        if self._val_task is not None and not self.pool.servers and not self.pool.guests:
            # The validation under way lost every replica: only a replacement can finish
            # it, and one is admitted at this version only while the weights still are.
            await self._finish_validation()
        s.batch, s.data = await asyncio.to_thread(
            build_train_batch, s.groups, job.algorithm, self.pad_token_id
        )
        if self.batch_hook is not None:
            s.hook_metrics = await asyncio.to_thread(self.batch_hook, s.batch, s.data)

    async def _before_update(self, s: _Step) -> None:
        """The old log-probs (decoupled PPO), the log-prob drift, and the critic's and
        reference's part (ref log-probs, KL in the reward, values, GAE)."""
        data = s.data
        t0 = time.perf_counter()
        decoupled = self.job.algorithm.old_log_prob_source == "trainer"
        if decoupled:
            # Decoupled PPO: the proximal policy is the frozen start-of-step weights.
            with (
                trace.span("old_log_prob"),
                progress.working("old_log_prob", None, f"step {s.step}"),
            ):
                data["old_log_probs"] = await self.engine.compute_log_probs(data, self.temperature)
        s.times["old_log_prob_s"] = time.perf_counter() - t0
        # Log-prob drift against the rollout's, on the trajectories sampled at the weights
        # the trainer holds now (offbeat.core.trainer.logprob_drift): from the old
        # log-probs when there are some, else measured by the first update.
        s.drift_mask = drift_mask_of(s.batch, self.version)
        if decoupled:
            s.drift, s.drift_mask = drift_of_old_log_probs(data, s.drift_mask), None
        if self.critic_ref is not None:
            s.extra = await self.critic_ref.prepare(data, s.batch.rewards, s.batch.group_uids)

    async def _update(self, s: _Step) -> None:
        """`actor.ppo_epochs` passes over the batch in `parameter_sync_step` mini-batches;
        then the critic's update."""
        job, a = self.job, self.job.actor
        sync_step = job.async_training.parameter_sync_step
        rows_per_mb = a.ppo_mini_batch_size * job.rollout.n
        t0 = time.perf_counter()
        # The hybrid replicas' own word on whether they sleep, asked while the trainer
        # trains on their devices.
        asleep = self._hybrid_levels()
        with trace.span("train"):
            for epoch in range(a.ppo_epochs):
                for k in range(sync_step):
                    mb = _rows(s.data, k * rows_per_mb, (k + 1) * rows_per_mb)
                    if s.drift_mask is not None and epoch == k == 0:  # before any optimizer step
                        mb[DRIFT_MASK] = s.drift_mask[:rows_per_mb]
                    where = f"step {s.step}, mini-batch {k + 1}/{sync_step}"
                    with (
                        trace.span("mini-batch", index=k, epoch=epoch),
                        progress.working(
                            "update", None, f"{where}, epoch {epoch + 1}/{a.ppo_epochs}"
                        ),
                    ):
                        s.updates.append(await self.engine.update(mb))
        s.times["train_s"] = time.perf_counter() - t0
        if asleep is not None and (levels := await asleep):
            s.extra["hybrid/asleep_level"] = float(min(levels.values()))
        if self.critic_ref is not None:
            s.extra.update(await self.critic_ref.update_critic(s.data, rows_per_mb, sync_step))

    async def _sync_and_validate(self, s: _Step) -> None:
        """The new weights to the replicas (after the validation under way, which must see
        only its own version), then a validation when one is due."""
        t = self.job.trainer
        await self._finish_validation(weights_at_version=False)
        t0 = time.perf_counter()
        version = self.version_offset + s.step
        with trace.span("sync", version=version), progress.working("sync", None, f"v{version}"):
            s.sync = await self.pool.sync(self.engine.export_weights, version)
            trace.add_sync(s.sync)  # each phase, and every replica's phases on its track
        s.times["sync_s"] = time.perf_counter() - t0
        self.version = version
        self.sync_results.append(s.sync)
        if (t.test_freq > 0 and s.step % t.test_freq == 0) or s.step == t.total_training_steps:
            await self._validate()

    async def _step_metrics(self, s: _Step) -> dict[str, float]:
        """The step's metrics: rewards, lengths, staleness, the buffer's counts, timings,
        the sync, throughput and idle fractions, memory; the updates', the drift's, the
        critic's and the hooks'. Then the step hooks see them."""
        step, groups, result, times = s.step, s.groups, s.sync, s.times
        step_s, wait_s = times["step_s"], times["generate_wait_s"]
        busy = self.driver.clock.read() - s.busy0
        tokens = self.driver.tokens_generated - s.tokens0
        trajectories = [t for g in groups for t in g.trajectories]
        spans = [float(g.span(step)) for g in groups for _ in g.trajectories]
        policy = self.version_offset + step - 1  # the version the batch was trained from
        stale = [float(policy - t.min_weight_version) for t in trajectories]
        lengths = [float(len(t.response_ids)) for t in trajectories]
        rewards = s.batch.rewards.tolist()
        counts = self.buffer.core.counts()
        metrics: dict[str, float] = {
            "weight_version": float(self.version),
            "reward/mean": sum(rewards) / len(rewards),
            "reward/max": max(rewards),
            "reward/min": min(rewards),
            **_stats("response_length", lengths),
            **_stats("off_policy/trajectory_spans", spans),
            **_stats("off_policy/trajectory_staleness", stale),
            "buffer/evicted": float(len(s.evicted)),
            "buffer/evicted_total": float(counts["evicted"]),
            "buffer/failed_total": float(counts["failed"]),
            **self.driver.failure_metrics(),  # failed/<reason>_total: bad_row, reward_timeout...
            "buffer/submitted_total": float(counts["submitted"]),
            "buffer/in_flight": float(counts["pending"] + counts["running"] + counts["finished"]),
            **{f"timing/{k}": times[k] for k in _STEP_TIMES},
            "sync/gbps": result.transfer_gbps,
            "sync/bytes": float(result.bytes),
            "sync/replicas": float(len(result.succeeded)),
            "perf/tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            "perf/trainer_idle_frac": wait_s / step_s if step_s > 0 else 0.0,
            "perf/rollout_idle_frac": max(0.0, 1.0 - busy / step_s) if step_s > 0 else 0.0,
            "memory/trainer_peak_rss_gb": _peak_rss_gb(),
            **self.pool.counts(),
            **self.buffer.core.prompts.metrics(),  # the data order's account, across resumes
        }
        metrics.update(agent_metrics(trajectories))
        for phase, secs in result.phase_s.items():
            metrics[f"timing/sync_{phase}_s"] = secs
        metrics.update(_merge_updates(s.updates))
        metrics.update(s.drift)
        if warning := self.drift_warning.check(step, metrics):
            if "console" in getattr(self.tracker, "loggers", ()):
                self.tracker.event(warning)
            else:
                logger.warning(warning)
        metrics.update(s.extra)
        metrics.update(s.hook_metrics)
        if self.rollout_memory is not None:
            metrics.update(await self.rollout_memory())
        for hook in self.step_hooks:
            hook.after_step(step, groups, s.batch, metrics)
        return metrics


# The phases of a step, timed in that order (`timing/<name>`).
_STEP_TIMES = ("generate_wait_s", "old_log_prob_s", "train_s", "sync_s", "step_s")


@dataclass
class _Step:
    """One global step's state, filled in by its phases in order."""

    step: int
    t0: float  # perf_counter at its start
    busy0: float  # the rollout's busy clock then
    tokens0: int  # the rollout's token count then
    groups: list[PromptGroup] = field(default_factory=list)
    evicted: list[PromptGroup] = field(default_factory=list)
    batch: Any = None  # the TrajectoryBatch
    data: dict[str, Any] = field(default_factory=dict)  # its tensors, as the engine takes them
    hook_metrics: dict[str, float] = field(default_factory=dict)
    drift: dict[str, float] = field(default_factory=dict)
    drift_mask: torch.Tensor | None = None
    extra: dict[str, float] = field(default_factory=dict)  # critic, reference, hybrid
    updates: list[dict[str, float]] = field(default_factory=list)
    sync: Any = None  # the SyncResult
    times: dict[str, float] = field(default_factory=dict)


def _merge_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """Merge the metrics of a step's mini-batch updates: counts and LR last, others mean."""
    if not updates:
        return {}
    try:
        from offbeat.core.metrics import MetricsAggregator
    except ImportError:
        MetricsAggregator = None
    if MetricsAggregator is not None:
        agg = MetricsAggregator()
        for u in updates:
            agg.add(u)
        return dict(agg.result())
    out: dict[str, float] = {}
    for k in updates[0]:
        vals = [u[k] for u in updates if k in u]
        out[k] = vals[-1] if k in ("actor/lr", "actor/update_count") else sum(vals) / len(vals)
    return out
