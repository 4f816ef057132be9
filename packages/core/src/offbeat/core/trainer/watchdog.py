"""The stall watchdog: a run whose stages all stopped advancing stops with an error that
names the stage holding it up, instead of hanging with its devices idle.

Armed only while the training loop runs: `Trainer.run` arms it when the rollout starts
and disarms it when the rollout stops, so engine start, warm start, a resume's load and
the last checkpoint are outside it. Inside the loop, phases that may legitimately take
long with nothing else advancing report `progress.exempt` (a checkpoint save, a replica
replacement, bounded by `runtime.replica_ready_timeout_s`): the watchdog holds while one
runs and counts from its end. Validation reports a step per prompt scored.

While armed, a daemon thread reads the run's progress registry (`offbeat.core.progress`)
every `min(timeout_s / 10, 1)` s. The run is live while something moves it toward its
end: a group finishes into the buffer or a batch is taken from it, a validation prompt is
scored, an old-log-prob pass, an update or a weight sync completes, an exempt phase ends.
Generation answers, admissions and reward calls report too, but alone they do not keep
the run live (a run whose every group fails keeps them busy forever). After `timeout_s`
with none of that, the watchdog trips:

1. It names the stalled stage: of the stages holding work in flight, or failing with no
   success since, the one stuck longest (`StageState.stuck_since`; ties in pipeline
   order, `progress.STAGES`), with the in-flight count per replica, the age of the oldest
   pending request and the trainer's phase. When the event loop itself has not run the
   thread's heartbeat callback for half the timeout, nor a probe callback within a grace
   (up to 5 s), the stage is "event_loop", and the report shows where its thread is (a
   coroutine or callback that blocks it).
2. From its own thread, it writes every thread's and every asyncio task's stack to
   `<dump_dir>/stall-<UTC time>-<pid>.txt` and logs the error, so both exist even when the
   event loop itself is blocked (a coroutine that never yields). With `remote_stacks`
   (the trainer's: its rank actors and replica actors), it then asks each of those
   processes for its own stacks, waiting at most `remote_timeout_s` for all of them, and
   appends them to that file (an actor that does not answer is named as such).
3. On the loop, it adds what the trainer knows (`context()`: each replica's weight
   version, the buffer, groups failed meanwhile, trainer ranks that have not answered)
   and cancels the trainer's task; `Trainer.run` then raises `StallError` with all of it.
   A loop blocked for good never gets there: when it runs nothing for `exit_after_s`
   after the report, the watchdog ends the process with `EXIT_BLOCKED` (70), its stacks
   and the report already written.

Knows nothing about engines or Ray: a clock, a registry, the lines `context()` gives and
the text `remote_stacks()` gives (`for_trainer` wires both to the trainer's actors).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offbeat.core import progress as _progress
from offbeat.core.progress import STAGES, Progress, Snapshot, StageState
from offbeat.core.stacks import STACKS_METHOD, actor_stacks, dump_stacks, format_actor_stacks

logger = logging.getLogger(__name__)

__all__ = [
    "EXIT_BLOCKED",
    "LIVE_STAGES",
    "StallError",
    "StallWatchdog",
    "stall_report",
    "stalled_stage",
    "trainer_actors",
    "trainer_context",
]

# A success of one of these keeps the run live (see the module docstring).
LIVE_STAGES = frozenset({"buffer", "validation", "old_log_prob", "update", "sync"})
TRAINER_STAGES = ("old_log_prob", "update", "sync")
KEY = "trainer.stall_timeout_s"
# The exit status of a process whose event loop stayed blocked after the stall report
# (EX_SOFTWARE): the run could not be stopped from inside, so the process ends.
EXIT_BLOCKED = 70


class StallError(RuntimeError):
    """Nothing advanced for `trainer.stall_timeout_s`. `stage`: the stalled stage's name
    (e.g. "reward", "generation[rollout-0]", "update"); `stacks`: the stack dump's path."""

    def __init__(self, message: str, stage: str, stacks: Path | None) -> None:
        super().__init__(message)
        self.stage, self.stacks = stage, stacks


def _order(s: StageState) -> int:
    return STAGES.index(s.stage) if s.stage in STAGES else len(STAGES)


def stalled_stage(snap: Snapshot) -> StageState | None:
    """The stage stuck longest (None: no stage holds work or fails)."""
    stuck = [s for s in snap.stages if s.stuck_since() is not None]
    return min(stuck, key=lambda s: (s.stuck_since(), _order(s)), default=None)


def _last_live(snap: Snapshot) -> float | None:
    """When the run last advanced (arming counts; None: not armed)."""
    if snap.armed_s is None:
        return None
    times = [snap.armed_s, *(s.last_s for s in snap.stages if s.stage in LIVE_STAGES)]
    if snap.exempt_end_s is not None:
        times.append(snap.exempt_end_s)
    return max(times)


def _ago(now: float, t: float | None) -> str:
    return "never" if t is None else f"{now - t:.1f} s ago"


def _describe(s: StageState, now: float) -> str:
    parts = [f"{s.in_flight} in flight"]
    if s.in_flight and s.oldest_s is not None:
        what = f" ({s.oldest_detail})" if s.oldest_detail else ""
        parts.append(f"the oldest for {now - s.oldest_s:.1f} s{what}")
    last = f"last success {_ago(now, s.last_s)}" if s.done else "no success yet"
    parts.append(f"{s.done} done, {s.failed} failed, {last}")
    if s.failing_since_s is not None:
        parts.append(f"failing for {now - s.failing_since_s:.1f} s: {s.last_error}")
    return f"{s.name}: " + "; ".join(parts)


def stall_report(snap: Snapshot, timeout_s: float, replicas: list[str] = ()) -> tuple[str, str]:
    """(stalled stage's name, the report's text) for a registry that stopped advancing.
    `replicas`: the replica ids the trainer knows (listed even with no call yet)."""
    now = snap.at_s
    stage = stalled_stage(snap)
    live = _last_live(snap)
    idle = now - live if live is not None else 0.0
    idle_all = "no stage holds work in flight or fails"
    if stage is not None:
        name, head = stage.name, f"the stalled stage is {_describe(stage, now)}"
    elif "waiting for the validation" in snap.phase:
        name, head = "validation", f"the stalled stage is validation: {idle_all}"
    elif "waiting for a batch" in snap.phase or not snap.phase:
        name = "submission"
        head = f"the stalled stage is submission: {idle_all} (no prompt group admitted)"
    else:  # the trainer is busy outside its reported stages
        name = "trainer"
        head = (
            f"the stalled stage is the trainer: {idle_all}, and the trainer is in none of "
            "its reported stages (it builds the batch, runs a batch hook, the critic or "
            "the reference model)"
        )
    trainer = [s for s in snap.stages if s.stage in TRAINER_STAGES and s.in_flight]
    doing = "; ".join(f"in {s.name} ({s.oldest_detail or 'no detail'})" for s in trainer)
    phase = ", ".join(x for x in (snap.phase, doing) if x) or "not named"
    gen = {s.key: s for s in snap.stages if s.stage == "generation" and s.key is not None}
    per_replica = [
        f"{sid}: {gen[sid].in_flight} ("
        + (f"last answer {_ago(now, gen[sid].last_s)})" if gen[sid].done else "no answer yet)")
        if sid in gen
        else f"{sid}: 0 (no call yet)"
        for sid in dict.fromkeys([*replicas, *gen])
    ]
    pending = [s for s in gen.values() if s.in_flight and s.oldest_s is not None]
    oldest = min(pending, key=lambda s: s.oldest_s, default=None)
    oldest_text = (
        f"{now - oldest.oldest_s:.1f} s ({oldest.oldest_detail} on {oldest.key})"
        if oldest is not None
        else "none pending"
    )
    others = [
        _describe(s, now)
        for s in sorted(snap.stages, key=lambda s: (_order(s), s.name))
        if s is not stage
    ]
    lines = [
        f"stall: nothing advanced for {idle:.1f} s ({KEY}={timeout_s:g}); {head}",
        f"trainer phase: {phase}",
        "generation requests in flight per replica: " + (", ".join(per_replica) or "none"),
        f"oldest pending request: {oldest_text}",
        "other stages: " + ("; ".join(others) or "none"),
    ]
    return name, "\n".join(lines)


class StallWatchdog:
    """See the module docstring. `timeout_s` None or 0: off (arming does nothing).
    `dump_dir`: where the stack dump goes. `context()`: lines of what the trainer knows,
    called on the event loop when tripped. `replicas()`: the replica ids to list.
    `remote_stacks(timeout_s)`: name -> stack text of other processes (the actors'), called
    from the watchdog's thread when tripped, bounded by `remote_timeout_s`. `exit_after_s`:
    see the property."""

    def __init__(
        self,
        timeout_s: float | None,
        *,
        dump_dir: str | Path,
        context: Callable[[], list[str]] | None = None,
        replicas: Callable[[], list[str]] | None = None,
        registry: Progress | None = None,
        remote_stacks: Callable[[float], dict[str, str]] | None = None,
        remote_timeout_s: float | None = None,
        exit_after_s: float | None = None,
    ) -> None:
        self.timeout_s = timeout_s or None
        self.dump_dir = Path(dump_dir)
        self.context = context
        self.replicas = replicas
        self.progress = registry or Progress()
        self.remote_stacks = remote_stacks
        self._exit_after_s = exit_after_s
        # Long enough for a loaded machine's actors to answer, short enough not to hold
        # the stop much past the timeout.
        self.remote_timeout_s = remote_timeout_s or min(10.0, max(2.0, (timeout_s or 0) / 2))
        self.error: StallError | None = None
        self._token: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._loop_thread: int | None = None
        self._beat: float | None = None  # when the loop last ran the heartbeat callback

    recancel_s = 5.0  # after tripping: how often the cancellation is sent again

    @property
    def exit_after_s(self) -> float:
        """After tripping: how long a loop that runs nothing may stay so before the
        process exits (`EXIT_BLOCKED`): the timeout again, at least 5 s."""
        return self._exit_after_s or max(5.0, self.timeout_s or 0.0)

    @property
    def enabled(self) -> bool:
        return self.timeout_s is not None

    @classmethod
    def for_trainer(cls, trainer: Any) -> StallWatchdog:
        """The watchdog of `trainer` (a `Trainer`): `trainer.stall_timeout_s`, the stack
        dump in the run's log directory (`<tracker's dir>/logs`)."""
        log_dir = getattr(trainer.tracker, "log_dir", None) or Path(".")
        pool = trainer.pool
        return cls(
            trainer.job.trainer.stall_timeout_s or None,
            dump_dir=Path(log_dir) / "logs",
            context=lambda: trainer_context(trainer),
            replicas=lambda: [*pool.servers, *pool.guests],
            remote_stacks=lambda timeout_s: actor_stacks(trainer_actors(trainer), timeout_s),
        )

    # ---- arming ----------------------------------------------------------------------
    def arm(self) -> None:
        """Activate the registry in this context (the tasks started after this report to
        it) and start watching; call on the event loop, in the task to stop on a stall."""
        if not self.enabled:
            return
        self._token = _progress.activate(self.progress)
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._loop_thread = threading.get_ident()
        self._stop.clear()
        self.progress.arm()
        self._beat = self.progress.clock()
        self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._thread.start()

    def disarm(self) -> None:
        if self._token is None:
            return
        self._stop.set()
        self.progress.disarm()
        _progress.deactivate(self._token)
        self._token = None

    def raise_stall(self, cause: BaseException) -> None:
        """In the trainer's `except`: raise the `StallError` when this watchdog stopped the
        run (whatever `cause` the cancellation became), else return."""
        if self.error is None:
            return
        task = asyncio.current_task()
        if isinstance(cause, asyncio.CancelledError) and task is not None:
            task.uncancel()  # the cancellation was ours, and is answered by the error
        raise self.error from cause

    # ---- watching --------------------------------------------------------------------
    def check(self) -> tuple[str, str] | None:
        """(stage, report) when the run has not advanced for `timeout_s`, else None."""
        snap = self.progress.snapshot()
        live = _last_live(snap)
        if live is None or snap.exempt or snap.at_s - live <= self.timeout_s:
            return None
        replicas = self.replicas() if self.replicas is not None else []
        stage, report = stall_report(snap, self.timeout_s, list(replicas))
        stale = self._beat is not None and snap.at_s - self._beat > self.timeout_s / 2
        if stale and self._loop_blocked():
            where = _thread_top(self._loop_thread)
            stage, report = (
                "event_loop",
                (
                    f"the event loop has run nothing for {snap.at_s - self._beat:.1f} s: a "
                    f"coroutine or callback blocks it, at:\n{where}\n{report}"
                ),
            )
        return stage, report

    def _loop_blocked(self) -> bool:
        """True when the loop does not run a callback within a grace (a loop that only
        lags behind, on a loaded machine, does)."""
        ran = threading.Event()
        self._call_soon(ran.set)
        return not ran.wait(max(0.5, min(self.timeout_s / 4, 5.0)))

    def _heartbeat(self) -> None:
        self._beat = self.progress.clock()

    def _watch(self) -> None:
        every = max(0.05, min(self.timeout_s / 10, 1.0))
        while not self._stop.wait(every):
            self._call_soon(self._heartbeat)
            try:
                tripped = self.check()
            except Exception:  # a report that failed to build must not kill the thread
                logger.exception("stall watchdog: check failed")
                continue
            if tripped is not None:
                self._trip(*tripped)
                break
        # Tripped: until the run raised the error (then it disarms), cancel again every
        # few seconds, in case the cancellation was swallowed on its way (a
        # `suppress(CancelledError)` around an await it landed in). A loop that runs
        # none of it for `exit_after_s` (blocked for good: nothing can unwind the run)
        # ends the process, after the report, with `EXIT_BLOCKED`.
        tripped_at = self.progress.clock()
        every = min(self.recancel_s, max(0.05, self.exit_after_s / 4))
        while not self._stop.wait(every):
            self._call_soon(self._heartbeat)
            self._call_soon(self._cancel_again)
            now = self.progress.clock()
            if now - max(tripped_at, self._beat or tripped_at) > self.exit_after_s:
                self._exit_blocked(now - (self._beat or tripped_at))
                return

    def _exit_blocked(self, blocked_s: float) -> None:
        logger.critical(
            "stall watchdog: the event loop has run nothing for %.1f s, %.1f s after the "
            "stall report above; nothing can stop the run from inside: the process exits "
            "with code %d (a coroutine or callback blocks the loop, at:\n%s)",
            blocked_s, self.exit_after_s, EXIT_BLOCKED, _thread_top(self._loop_thread),
        )  # fmt: skip
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(EXIT_BLOCKED)

    def _call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(callback, *args)

    def _cancel_again(self) -> None:
        task = self._task
        if self.error is not None and self._token is not None and task and not task.done():
            task.cancel(f"stall watchdog: {self.error.stage}")

    def _trip(self, stage: str, report: str) -> None:
        path: Path | None = None
        try:
            path = dump_stacks(self.dump_dir, "stall", header=report)
        except Exception as e:
            report += f"\n(stack dump to {self.dump_dir} failed: {type(e).__name__}: {e})"
        actors = self._actor_stacks(path) if path is not None else ""
        where = f"\nstacks of every thread and asyncio task: {path}" if path else ""
        logger.error("%s%s%s", report, where, f"\n{actors}" if actors else "")
        self._call_soon(self._stop_run, stage, report, path, actors)

    def _actor_stacks(self, path: Path) -> str:
        """Append the other processes' stacks to `path`; a line saying whose are there."""
        if self.remote_stacks is None:
            return ""
        try:
            stacks = self.remote_stacks(self.remote_timeout_s)
        except Exception as e:  # the dump must not keep the run from stopping
            return f"(the actors' stacks failed: {type(e).__name__}: {e})"
        if not stacks:
            return ""
        with path.open("a") as f:
            f.write(format_actor_stacks(stacks))
        silent = [name for name, text in stacks.items() if text.startswith("(")]
        got = [name for name in stacks if name not in silent]
        line = f"stacks of {', '.join(got) or 'no actor'} in the same file"
        if silent:
            line += "; none from " + "; ".join(f"{n} {stacks[n]}" for n in silent)
        return line

    def _stop_run(self, stage: str, report: str, path: Path | None, actors: str = "") -> None:
        """On the loop: the trainer's context, the error, and the trainer task's cancel."""
        if self._token is None or self._task is None or self._task.done():
            return  # disarmed meanwhile: the run ended on its own
        extra: list[str] = []
        if self.context is not None:
            try:
                extra = list(self.context())
            except Exception as e:
                extra = [f"(the trainer's context failed: {type(e).__name__}: {e})"]
        where = [f"stacks of every thread and asyncio task: {path}"] if path else []
        where += [actors] if actors else []
        self.error = StallError("\n".join([report, *extra, *where]), stage, path)
        self._task.cancel(f"stall watchdog: {stage}")


def _thread_top(ident: int | None, frames: int = 4) -> str:
    """The innermost `frames` frames of thread `ident`, as text."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return "  (its thread is gone)"
    return "".join(traceback.format_stack(frame)[-frames:]).rstrip("\n")


def trainer_context(trainer: Any) -> list[str]:
    """What a `Trainer` knows of a stall: each replica's last weight version, its own
    step and version, the buffer, the groups failed meanwhile, the replicas removed and
    being replaced, and the calls its trainer group still waits on ranks for."""
    pool = trainer.pool
    versions = []
    for sid, server in {**pool.servers, **pool.guests}.items():
        try:
            versions.append(f"{sid}: {server.weight_version}")
        except Exception as e:  # a dead replica's proxy may raise
            versions.append(f"{sid}: unknown ({type(e).__name__})")
    lines = [
        "replica weight versions: " + (", ".join(versions) or "no replica"),
        f"trainer: step {trainer.step}, weight version {trainer.version}; "
        f"buffer {trainer.buffer.core.counts()}",
    ]
    failures = trainer.driver.failures
    if failures.count:
        lines.append(f"{failures.count} groups failed in a row meanwhile: {failures.describe()}")
    if pool.removed or pool.replacing:
        lines.append(f"replicas removed: {pool.removed}; being replaced: {list(pool.replacing)}")
    waiting = getattr(trainer.engine, "waiting", None)
    if callable(waiting) and (calls := waiting()):
        lines.append("trainer group calls waiting for ranks: " + "; ".join(calls))
    return lines


def trainer_actors(trainer: Any) -> dict[str, Any]:
    """name -> actor handle of each process of a `Trainer` that can give its stacks: the
    trainer group's rank actors (`trainer rank <i>`; a rank in the driver is in this
    process's own dump), the ranks of the critic's and the
    reference's worker groups of their own (`critic rank <i>`, `reference rank <i>`: the
    group's `linked` ones, `critic.placement=separate`) and the replicas, hybrid ones
    included (`replica <id>`; those with a handle that has the stacks method). Read from
    the watchdog's thread: the dicts are copied, again if the loop changed one meanwhile."""
    for _ in range(3):
        try:
            engine = trainer.engine
            out = {
                f"trainer rank {i}": h
                for i, h in enumerate(getattr(engine, "handles", None) or [])
                if not getattr(h, "in_process", False)  # its stacks are this process's
            }
            for g in list(getattr(engine, "linked", None) or []):
                role = "+".join(getattr(g, "roles", None) or ("linked",))
                for i, h in enumerate(getattr(g, "handles", None) or []):
                    out[f"{role} rank {i}"] = h
            pool, hybrid = trainer.pool, getattr(trainer, "hybrid", None)
            servers = {**pool.servers, **pool.guests, **(hybrid.servers if hybrid else {})}
            break
        except RuntimeError:  # a dict changed size while copied
            continue
    else:
        return {}
    for sid, server in servers.items():
        handle = getattr(server, "handle", None)
        if handle is not None and _has_method(handle, STACKS_METHOD):
            out[f"replica {sid}"] = handle
    return out


def _has_method(handle: Any, name: str) -> bool:
    try:
        getattr(handle, name)
    except Exception:  # an actor handle raises AttributeError for a method it lacks
        return False
    return True
