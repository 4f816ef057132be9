"""How far each stage of a run has come: a registry of progress that the stall watchdog
reads (`offbeat.core.trainer.watchdog`).

Per stage (optionally per key, e.g. generation per replica): how many operations
succeeded and failed, the monotonic time of the last success and of the first failure
since, and the operations in flight (when each began, what it is). Stages report with
three hooks: `advance(stage)` (one operation done), `working(stage)` (a context manager:
in flight inside, one success or failure at the exit) and `exempt(what)` (a legitimately
long phase; the watchdog holds while one is in flight). `phase(label)` names what the
trainer is doing (waiting for a batch, ...).

The registry of a run is a context variable (`activate`), like the step timeline's
(`offbeat.core.trace`): hooks anywhere below it (tasks started there, threads of
`asyncio.to_thread`) report to it, and cost a context-variable lookup when none is
active. Reporting is a lock and a few dict operations (thread-safe; no Ray, no asyncio).

Knows nothing about what the stages mean or what to do when they stop.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "STAGES",
    "Progress",
    "Snapshot",
    "StageState",
    "activate",
    "advance",
    "current",
    "deactivate",
    "exempt",
    "fail",
    "phase",
    "working",
]

# The stages a run reports, in pipeline order (names and ties in reports follow it).
STAGES = (
    "submission",  # prompt groups admitted into the buffer
    "generation",  # server calls, keyed by replica id
    "reward",  # a group's reward calls
    "tool",  # a turn's tool calls
    "teacher",  # a group's teacher scoring (distillation), keyed by teacher
    "buffer",  # groups finished (success) or failed into the buffer; batches taken
    "validation",  # validation prompts scored
    "old_log_prob",  # the trainer's old-policy log-probs
    "update",  # the trainer's mini-batch updates
    "sync",  # weight syncs
)


@dataclass(frozen=True)
class StageState:
    """One stage (and key) at a moment; times are the registry's clock."""

    stage: str
    key: str | None
    done: int  # operations that succeeded
    failed: int  # operations that failed
    last_s: float  # the last success (or when the stage was first seen)
    failing_since_s: float | None  # the first failure after the last success
    in_flight: int
    oldest_s: float | None  # when the oldest operation in flight began
    oldest_detail: str  # what it is
    last_error: str  # the last failure's error

    @property
    def name(self) -> str:
        return self.stage if self.key is None else f"{self.stage}[{self.key}]"

    def stuck_since(self) -> float | None:
        """Since when this stage has held work or failed without succeeding (None: it
        does not): failing since its first failure after its last success; else, with
        work in flight, since its last success or its oldest operation's start."""
        if self.failing_since_s is not None:
            return self.failing_since_s
        if self.in_flight and self.oldest_s is not None:
            return max(self.last_s, self.oldest_s)
        return None


@dataclass(frozen=True)
class Snapshot:
    at_s: float
    armed_s: float | None  # when the watchdog was armed (None: it is not)
    stages: tuple[StageState, ...]
    exempt: tuple[tuple[str, float], ...]  # (what, since) of the exempt phases in flight
    exempt_end_s: float | None  # when the last exempt phase ended
    phase: str  # the trainer's phase ("" when none was named)


class _Stage:
    __slots__ = ("active", "done", "failed", "failing_since", "last", "last_error")

    def __init__(self, now: float) -> None:
        self.done = 0
        self.failed = 0
        self.last = now
        self.failing_since: float | None = None
        self.last_error = ""
        self.active: dict[int, tuple[float, str]] = {}  # ticket -> (start, detail), in order


class Progress:
    """The registry; see the module docstring. `clock` is monotonic (seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._stages: dict[tuple[str, str | None], _Stage] = {}
        self._tickets = itertools.count()
        self._where: dict[int, tuple[str, str | None]] = {}  # ticket -> its stage
        self._exempt: dict[int, tuple[str, float]] = {}
        self._exempt_end: float | None = None
        self._phases: dict[int, str] = {}
        self.armed_s: float | None = None

    def _stage(self, stage: str, key: str | None, now: float) -> _Stage:
        s = self._stages.get((stage, key))
        if s is None:
            s = self._stages[(stage, key)] = _Stage(now)
        return s

    # ---- the watchdog's switch -------------------------------------------------------
    def arm(self) -> None:
        with self._lock:
            self.armed_s = self.clock()

    def disarm(self) -> None:
        with self._lock:
            self.armed_s = None

    # ---- reporting -------------------------------------------------------------------
    def advance(self, stage: str, key: str | None = None, n: int = 1) -> None:
        """`n` operations of `stage` succeeded."""
        with self._lock:
            now = self.clock()
            s = self._stage(stage, key, now)
            s.done += n
            s.last, s.failing_since = now, None

    def fail(self, stage: str, key: str | None = None, error: str = "") -> None:
        """One operation of `stage` failed (a failure is no progress)."""
        with self._lock:
            now = self.clock()
            s = self._stage(stage, key, now)
            s.failed += 1
            s.last_error = error
            if s.failing_since is None:
                s.failing_since = now

    def begin(self, stage: str, key: str | None = None, detail: str = "") -> int:
        """An operation of `stage` is in flight until `end(ticket)`."""
        with self._lock:
            now = self.clock()
            ticket = next(self._tickets)
            self._stage(stage, key, now).active[ticket] = (now, detail)
            self._where[ticket] = (stage, key)
            return ticket

    def end(self, ticket: int, error: str | None = None) -> None:
        """The operation `ticket` ended: a success, or a failure when `error` is given."""
        with self._lock:
            where = self._where.pop(ticket, None)
            if where is None:
                return
            now = self.clock()
            s = self._stages[where]
            s.active.pop(ticket, None)
            if error is None:
                s.done += 1
                s.last, s.failing_since = now, None
            else:
                s.failed += 1
                s.last_error = error
                if s.failing_since is None:
                    s.failing_since = now

    def drop(self, ticket: int) -> None:
        """The operation `ticket` is no longer in flight, and counts neither way."""
        with self._lock:
            where = self._where.pop(ticket, None)
            if where is not None:
                self._stages[where].active.pop(ticket, None)

    def begin_exempt(self, what: str) -> int:
        with self._lock:
            ticket = next(self._tickets)
            self._exempt[ticket] = (what, self.clock())
            return ticket

    def end_exempt(self, ticket: int) -> None:
        with self._lock:
            if self._exempt.pop(ticket, None) is not None:
                self._exempt_end = self.clock()

    def push_phase(self, label: str) -> int:
        with self._lock:
            ticket = next(self._tickets)
            self._phases[ticket] = label
            return ticket

    def pop_phase(self, ticket: int) -> None:
        with self._lock:
            self._phases.pop(ticket, None)

    # ---- reading ---------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        with self._lock:
            now = self.clock()
            stages = []
            for (stage, key), s in self._stages.items():
                oldest = next(iter(s.active.values()), None)
                stages.append(
                    StageState(
                        stage=stage,
                        key=key,
                        done=s.done,
                        failed=s.failed,
                        last_s=s.last,
                        failing_since_s=s.failing_since,
                        in_flight=len(s.active),
                        oldest_s=oldest[0] if oldest else None,
                        oldest_detail=oldest[1] if oldest else "",
                        last_error=s.last_error,
                    )
                )
            return Snapshot(
                now,
                self.armed_s,
                tuple(stages),
                tuple(self._exempt.values()),
                self._exempt_end,
                self._phases[max(self._phases)] if self._phases else "",
            )


# ---- the hooks: report to the active registry, if any ------------------------------------
_CURRENT: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("offbeat_progress")


def activate(progress: Progress | None) -> contextvars.Token:
    """Make `progress` the registry the hooks below report to (in this context and the
    tasks and `to_thread` threads started from it); undo with `deactivate(token)`."""
    return _CURRENT.set(progress)


def deactivate(token: contextvars.Token) -> None:
    _CURRENT.reset(token)


def current() -> Progress | None:
    return _CURRENT.get(None)


def advance(stage: str, key: str | None = None, n: int = 1) -> None:
    p = _CURRENT.get(None)
    if p is not None:
        p.advance(stage, key, n)


def fail(stage: str, key: str | None = None, error: str = "") -> None:
    p = _CURRENT.get(None)
    if p is not None:
        p.fail(stage, key, error)


class _Null:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _Null()


class _Working:
    __slots__ = ("detail", "key", "progress", "stage", "ticket")

    def __init__(self, progress: Progress, stage: str, key: str | None, detail: str) -> None:
        self.progress, self.stage, self.key, self.detail = progress, stage, key, detail

    def __enter__(self) -> None:
        self.ticket = self.progress.begin(self.stage, self.key, self.detail)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.progress.end(self.ticket)
        elif issubclass(exc_type, Exception):
            self.progress.end(self.ticket, f"{exc_type.__name__}: {exc}")
        else:  # cancelled or interrupted: neither a success nor the stage's failure
            self.progress.drop(self.ticket)


class _Exempt:
    __slots__ = ("progress", "ticket", "what")

    def __init__(self, progress: Progress, what: str) -> None:
        self.progress, self.what = progress, what

    def __enter__(self) -> None:
        self.ticket = self.progress.begin_exempt(self.what)

    def __exit__(self, *exc: Any) -> None:
        self.progress.end_exempt(self.ticket)


class _Phase:
    __slots__ = ("label", "progress", "ticket")

    def __init__(self, progress: Progress, label: str) -> None:
        self.progress, self.label = progress, label

    def __enter__(self) -> None:
        self.ticket = self.progress.push_phase(self.label)

    def __exit__(self, *exc: Any) -> None:
        self.progress.pop_phase(self.ticket)


def working(stage: str, key: str | None = None, detail: str = "") -> Any:
    """`with working("reward"): ...`: one operation of `stage` in flight inside; it
    succeeds when the block ends, fails when it raises an `Exception` (a cancellation is
    neither)."""
    p = _CURRENT.get(None)
    return _NULL if p is None else _Working(p, stage, key, detail)


def exempt(what: str) -> Any:
    """`with exempt("checkpoint save"): ...`: a phase that may legitimately take long with
    nothing else advancing; the watchdog holds while it runs and counts from its end."""
    p = _CURRENT.get(None)
    return _NULL if p is None else _Exempt(p, what)


def phase(label: str) -> Any:
    """`with phase("waiting for a batch"): ...`: what the trainer does meanwhile (the
    innermost, latest one is reported)."""
    p = _CURRENT.get(None)
    return _NULL if p is None else _Phase(p, label)
