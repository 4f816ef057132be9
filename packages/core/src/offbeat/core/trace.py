"""A timeline of a run in the Chrome trace event format (ui.perfetto.dev, chrome://tracing).

A span is a complete event (``"ph": "X"``) on a track; a track is ``"process/thread"``
(e.g. ``"trainer/steps"``, ``"rollout-0/sync"``), each process and thread named by a
metadata event. Spans on one track must nest, so concurrent work never shares a track:
`lane_span` puts each of many concurrent requests of a group (a replica) on its lowest
free lane, and keeps a counter of how many are in flight.

The tracer of a run is a context variable (`activate`): `span(...)` anywhere below it
(tasks it starts, threads of `asyncio.to_thread`, which copy the context) records into
it, and is a no-op returning a shared object when no tracer is active or it is off. A
span with no track lands on the track of the span around it. Events are written off the
event loop (`flush`): the file is valid JSON after every flush.

Knows nothing about trainers, engines or replicas: callers name the spans and tracks.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "MAIN_TRACK",
    "Tracer",
    "activate",
    "add",
    "add_sync",
    "current",
    "deactivate",
    "lane_span",
    "nesting_problems",
    "span",
]

MAIN_TRACK = "trainer/steps"
_TRACER: contextvars.ContextVar[Tracer | None] = contextvars.ContextVar("offbeat_tracer")
_TRACK: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("offbeat_track")
_HEAD = '{"displayTimeUnit": "ms", "traceEvents": [\n'
_TAIL = "\n]}\n"
# Threads listed first in each process; lanes follow in lane order.
_THREAD_ORDER = {"steps": 0, "sync": 1}


class _Discard(dict):
    """The args of a span nobody records: writes vanish."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def update(self, *args: Any, **kwargs: Any) -> None:
        pass


class _NullSpan:
    __slots__ = ()
    _args = _Discard()

    def __enter__(self) -> dict[str, Any]:
        return self._args

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _NullSpan()


class _Span:
    """Records [enter, exit) on `track`; the body's spans default to the same track."""

    __slots__ = ("args", "name", "start", "token", "tracer", "track")

    def __init__(self, tracer: Tracer, name: str, track: tuple[int, int], args: dict) -> None:
        self.tracer, self.name, self.track, self.args = tracer, name, track, args

    def __enter__(self) -> dict[str, Any]:
        self.token = _TRACK.set(self.track)
        self.start = self.tracer.clock()
        return self.args

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        end = self.tracer.clock()
        _TRACK.reset(self.token)
        if exc_type is not None:
            self.args["error"] = exc_type.__name__
        self.tracer._record(self.name, self.track, self.start, end, self.args)


class _LaneSpan(_Span):
    __slots__ = ("group", "lane")

    def __init__(self, tracer: Tracer, name: str, group: str, args: dict) -> None:
        self.group = group
        self.lane = tracer._take_lane(group)
        super().__init__(tracer, name, tracer.track(f"{group}/lane {self.lane}"), args)

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self.tracer._free_lane(self.group, self.lane)


class Tracer:
    """Collects spans and writes them to `path` (None: keep them in `events()` only).

    `steps`: how many `end_step` calls stay traced (None: all); after that the tracer is
    off and every span is a no-op. `clock` must be `time.perf_counter`'s (spans from
    other modules, e.g. a weight sync's phase times, are read on that clock)."""

    def __init__(
        self, path: str | Path | None, *, steps: int | None = None, clock=time.perf_counter
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.steps = steps
        self.clock = clock
        self.origin = clock()
        self.enabled = steps is None or steps > 0
        self.steps_done = 0
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._written: list[dict[str, Any]] = []  # everything flushed (when path is None)
        self._pids: dict[str, int] = {}
        self._tids: dict[tuple[str, str], tuple[int, int]] = {}
        self._lanes: dict[str, tuple[list[int], list[int]]] = {}  # group -> (free heap, [next])
        self._in_flight: dict[str, int] = {}
        self._tail_at: int | None = None  # file offset of the closing "]}"
        self._write_lock = asyncio.Lock()

    # ---- tracks ----------------------------------------------------------------------
    def track(self, track: str | None) -> tuple[int, int]:
        """(pid, tid) of "process/thread"; a name without "/" is a thread of "trainer";
        None: the track of the enclosing span (MAIN_TRACK outside any)."""
        if track is None:
            return _TRACK.get(None) or self.track(MAIN_TRACK)
        process, _, thread = track.rpartition("/") if "/" in track else ("trainer", "", track)
        key = (process, thread)
        with self._lock:
            ids = self._tids.get(key)
            if ids is None:
                pid = self._pids.get(process)
                if pid is None:
                    pid = self._pids[process] = len(self._pids) + 1
                    self._meta("process_name", pid, 0, process)
                    self._meta("process_sort_index", pid, 0, pid, key="sort_index")
                ids = self._tids[key] = (pid, len(self._tids) + 1)
                self._meta("thread_name", pid, ids[1], thread)
                order = _THREAD_ORDER.get(thread)
                if order is None:
                    lane = thread.removeprefix("lane ")
                    order = 10 + int(lane) if lane.isdigit() else 5
                self._meta("thread_sort_index", pid, ids[1], order, key="sort_index")
        return ids

    def _meta(self, kind: str, pid: int, tid: int, value: Any, key: str = "name") -> None:
        self._pending.append(
            {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {key: value}}
        )

    def _take_lane(self, group: str) -> int:
        with self._lock:
            free, nxt = self._lanes.setdefault(group, ([], [0]))
            if free:
                lane = heapq.heappop(free)
            else:
                lane, nxt[0] = nxt[0], nxt[0] + 1
            self._in_flight[group] = self._in_flight.get(group, 0) + 1
        self._count(group)
        return lane

    def _free_lane(self, group: str, lane: int) -> None:
        with self._lock:
            heapq.heappush(self._lanes[group][0], lane)
            self._in_flight[group] -= 1
        self._count(group)

    def _count(self, group: str) -> None:
        if not self.enabled:
            return
        pid = self.track(f"{group}/lane 0")[0]
        ts = self._us(self.clock())
        with self._lock:
            n = self._in_flight[group]
            self._pending.append(
                {"ph": "C", "name": "in flight", "pid": pid, "ts": ts, "args": {"requests": n}}
            )

    # ---- recording -------------------------------------------------------------------
    def _us(self, t: float) -> int:
        return round((t - self.origin) * 1e6)

    def _record(
        self, name: str, track: tuple[int, int], start: float, end: float, args: Mapping
    ) -> None:
        if not self.enabled:
            return
        ts = self._us(start)
        event = {"ph": "X", "name": name, "pid": track[0], "tid": track[1], "ts": ts}
        event["dur"] = max(0, self._us(end) - ts)
        if args:
            event["args"] = dict(args)
        with self._lock:
            self._pending.append(event)

    def span(self, name: str, track: str | None = None, **args: Any) -> Any:
        """A context manager timing its body; it yields the span's args dict (add to it)."""
        if not self.enabled:
            return _NULL
        return _Span(self, name, self.track(track), args)

    def lane_span(self, name: str, group: str, **args: Any) -> Any:
        """`span` on the lowest free lane of `group` ("<group>/lane <i>")."""
        if not self.enabled:
            return _NULL
        return _LaneSpan(self, name, group, args)

    def add(self, name: str, track: str | None, start: float, end: float, **args: Any) -> None:
        """A span measured elsewhere, from `clock` readings `start` and `end`."""
        if self.enabled:
            self._record(name, self.track(track), start, end, args)

    # ---- writing ---------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        """Every event flushed or pending (tests)."""
        with self._lock:
            return [*self._written, *self._pending]

    async def end_step(self) -> None:
        """Flush this step's events; after `steps` steps the tracer turns off."""
        self.steps_done += 1
        if self.steps is not None and self.steps_done >= self.steps:
            self.enabled = False
        await self.flush()

    async def flush(self) -> None:
        """Write the events recorded so far, in a worker thread."""
        async with self._write_lock:
            with self._lock:
                batch, self._pending = self._pending, []
            if not batch:
                return
            if self.path is None:
                self._written += batch
                return
            await asyncio.to_thread(self._append, batch)

    async def close(self) -> None:
        self.enabled = False
        await self.flush()

    def _append(self, batch: list[dict[str, Any]]) -> None:
        # Parents before the children that start with them (viewers read in file order).
        batch.sort(key=lambda e: (e.get("ts", -1), -e.get("dur", 0)))
        body = ",\n".join(json.dumps(e, separators=(",", ":")) for e in batch)
        assert self.path is not None
        if self._tail_at is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w") as f:
                f.write(_HEAD + body)
                self._tail_at = f.tell()
                f.write(_TAIL)
            return
        with open(self.path, "r+") as f:
            f.seek(self._tail_at)
            f.write(",\n" + body)
            self._tail_at = f.tell()
            f.write(_TAIL)
            f.truncate()


# ---- the active tracer -------------------------------------------------------------------
def activate(tracer: Tracer | None) -> contextvars.Token:
    """Make `tracer` the one `span` records into, in this context and the tasks and
    threads it starts from now on; `deactivate(token)` undoes it."""
    return _TRACER.set(tracer)


def deactivate(token: contextvars.Token) -> None:
    _TRACER.reset(token)


def current() -> Tracer | None:
    return _TRACER.get(None)


def span(name: str, track: str | None = None, **args: Any) -> Any:
    """`Tracer.span` on the active tracer; a shared no-op when there is none."""
    t = _TRACER.get(None)
    return _NULL if t is None or not t.enabled else t.span(name, track, **args)


def lane_span(name: str, group: str, **args: Any) -> Any:
    t = _TRACER.get(None)
    return _NULL if t is None or not t.enabled else t.lane_span(name, group, **args)


def add(name: str, track: str | None, start: float, end: float, **args: Any) -> None:
    t = _TRACER.get(None)
    if t is not None and t.enabled:
        t.add(name, track, start, end, **args)


def add_sync(result: Any, track: str | None = None) -> None:
    """The phases of a weight sync: the pool-wide window of each phase on `track` (the
    caller's), and on "<replica>/sync" a "sync v<version>" span around that replica's
    own phases. `result` has `version`, `phase_spans` {phase: (start, end)} and
    `replica_spans` {replica: [(phase, start, end)]} (offbeat.ckpt_engine.SyncResult)."""
    t = _TRACER.get(None)
    if t is None or not t.enabled:
        return
    for phase, (start, end) in getattr(result, "phase_spans", {}).items():
        t.add(phase, track, start, end)
    failed = getattr(result, "failed", {})
    for replica, spans in getattr(result, "replica_spans", {}).items():
        if not spans:
            continue
        where = f"{replica}/sync"
        args = {"failed": failed[replica]} if replica in failed else {}
        start, end = min(s for _, s, _ in spans), max(e for _, _, e in spans)
        t.add(f"sync v{result.version}", where, start, end, **args)
        for phase, s, e in spans:
            t.add(phase, where, s, e)


def nesting_problems(events: list[dict[str, Any]]) -> list[str]:
    """Pairs of complete events that overlap partially on one track (what a viewer cannot
    draw): on each (pid, tid), in start order, a span must end before the next one starts
    or contain it. Empty when the trace is well formed."""
    by_track: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        if e.get("ph") == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    problems = []
    for track, spans in by_track.items():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_: list[dict[str, Any]] = []  # the chain of spans containing the current one
        for e in spans:
            while open_ and open_[-1]["ts"] + open_[-1]["dur"] <= e["ts"]:
                open_.pop()
            if open_ and e["ts"] + e["dur"] > open_[-1]["ts"] + open_[-1]["dur"]:
                p = open_[-1]
                problems.append(
                    f"track {track}: {e['name']!r} [{e['ts']}, +{e['dur']}] overlaps "
                    f"{p['name']!r} [{p['ts']}, +{p['dur']}]"
                )
            open_.append(e)
    return problems
