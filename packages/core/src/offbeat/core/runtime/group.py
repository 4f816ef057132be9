"""TrainerGroup: the trainer as N data-parallel rank actors on the trainer pool, driven
from the job's event loop.

Ranks are `TrainerRank` actors, one per bundle of the trainer pool in (node, bundle)
order; rank 0 publishes the rendezvous address, then every rank joins and builds the
engines of the group's roles at once (the actor, and the critic and/or the reference
policy when the job has them). Every group method fans out to all ranks and awaits their
refs together (never `ray.get` on the loop); the first rank to fail fails the call with
`TrainerRankFailed`, naming the rank, what it was doing and the global step. A batch is
split across ranks by token count (`split_by_tokens`), rows come back in batch order,
and the ranks' metrics are merged (`merge_rank_metrics`). The group offers the
`TrainEngine` calls the training loop makes: `update` and `compute_log_probs` are
coroutines; `save`/`load` block (the checkpoint manager calls them in a worker thread);
the critic's and the reference's calls are coroutines too, which `GroupCriticEngine` and
`GroupReferenceEngine` (`engines.py`) turn into blocking engine calls for worker threads.
Weights never come to the driver: a weight sync goes through `GroupCheckpointEngine`
(`weight_sync.py`), whose sender is rank 0.

One trainer shape: with the trainer in the driver (`runtime.trainer_in_driver`) the
group is one `TrainerRank` in this process behind a `LocalRank` handle (`local.py`,
`start_local`, or `around` engines built already), driven through the same calls, so
its errors are `TrainerRankFailed` naming rank 0 too, and its sender streams from the
engine with no copy.

Knows nothing about the engines inside a rank, the replicas, or the training loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from offbeat.core.metrics import reduction_for
from offbeat.core.runtime.local import LocalRank
from offbeat.core.runtime.rank import TrainerRank

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

# After one rank raised, how long to wait for a rank that died (the likelier cause).
_GRACE_S = 3.0

__all__ = [
    "TrainerGroup",
    "TrainerRankFailed",
    "gather_rows",
    "merge_rank_metrics",
    "split_by_tokens",
]


class TrainerRankFailed(RuntimeError):
    """A trainer rank died or raised; `rank`, `what` (the call) and `step` say where.
    `died`: the rank's process is gone (killed, crashed), not an exception it raised or a
    call past its timeout; a restart from the last checkpoint may cure only that
    (`offbeat.core.trainer.restart`)."""

    def __init__(self, rank: int, what: str, step: int | None, cause: BaseException) -> None:
        self.rank, self.what, self.step = rank, what, step
        self.cause = cause
        self.died = _died(cause)
        at = f" during global step {step}" if step is not None else ""
        super().__init__(
            f"trainer rank {rank} failed in {what}{at}: {type(cause).__name__}: {cause}"
        )


def split_by_tokens(tokens: Sequence[int], parts: int) -> list[list[int]]:
    """Row indices for each of `parts` ranks, balanced by token count (largest rows first
    onto the lightest rank; ties to the lower rank), each rank's rows in batch order. Every
    rank gets at least one row."""
    if len(tokens) < parts:
        raise ValueError(
            f"a batch of {len(tokens)} rows cannot give each of {parts} trainer ranks a row"
        )
    load = [0] * parts
    rows: list[list[int]] = [[] for _ in range(parts)]
    order = sorted(range(len(tokens)), key=lambda i: (-tokens[i], i))
    for n, i in enumerate(order):
        # The first `parts` rows seed one rank each, so no rank is left empty.
        r = n if n < parts else min(range(parts), key=lambda k: (load[k], k))
        rows[r].append(i)
        load[r] += int(tokens[i])
    return [sorted(r) for r in rows]


def merge_rank_metrics(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """One dict from every rank's update metrics. Engines reduce their metrics over the
    ranks already (identical everywhere); what still differs is rank-local (peak memory):
    max for max-named metrics, min for min-named, else the mean."""
    out: dict[str, float] = {}
    for key in per_rank[0]:
        values = [float(m[key]) for m in per_rank if key in m]
        how = reduction_for(key)
        if how == "max":
            out[key] = max(values)
        elif how == "min":
            out[key] = min(values)
        else:
            out[key] = values[0] if len(set(values)) == 1 else sum(values) / len(values)
    return out


def gather_rows(parts: Sequence[list[int]], shards: Sequence[torch.Tensor], rows: int):
    """One [rows, ...] tensor from each rank's answer for its rows (`parts[r]`, as
    `split_by_tokens` gave them): row i of the result is the answer for batch row i."""
    if sorted(i for part in parts for i in part) != list(range(rows)):
        raise ValueError(f"the ranks' rows {list(parts)} do not cover a batch of {rows} rows")
    out = torch.empty((rows, *shards[0].shape[1:]), dtype=shards[0].dtype)
    for part, shard in zip(parts, shards, strict=True):
        if shard.shape[0] != len(part):
            raise ValueError(f"a rank answered {shard.shape[0]} rows for its {len(part)}")
        out[torch.tensor(part, dtype=torch.long)] = shard
    return out


def _rows(data: dict[str, Any], index: list[int]) -> dict[str, Any]:
    idx = torch.tensor(index, dtype=torch.long)

    def rows(k: str, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.index_select(0, idx)
        if k == "multi_modal" and isinstance(v, list):  # per-row vision inputs
            return [v[i] for i in index]
        return v

    return {k: rows(k, v) for k, v in data.items()}


class _NotOnTheDriver:
    """What `TrainerGroup.export_weights` returns: the weights stay on the ranks."""

    def __iter__(self):
        raise TypeError(
            "a TrainerGroup's weights stay on its ranks: sync them with "
            "GroupCheckpointEngine (offbeat.core.runtime), whose sender is rank 0"
        )


class TrainerGroup:
    """N rank actors (`handles`, rank order). Build with `await TrainerGroup.start(...)`."""

    def __init__(self, handles: list[Any], *, kill_on_failure: bool = True) -> None:
        self.handles = handles
        self.step: int | None = None  # the global step now running (for error messages)
        self.failed: TrainerRankFailed | None = None
        self.kill_on_failure = kill_on_failure
        self.node_ids: list[str] = []
        self.master: tuple[str, int] = ("", 0)  # rank 0's rendezvous address
        self.pids: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.call_timeout_s: float | None = None  # no answer this long: the call fails
        self.roles: tuple[str, ...] = ("actor",)  # the engines every rank holds
        self.reference_fingerprint: list[float] | None = None  # with the reference role
        # Groups whose calls belong to this one's global steps (a critic of its own).
        self.linked: list[TrainerGroup] = []
        # Calls in flight: (what, ranks, their futures, monotonic start), for `waiting`.
        self._calls: list[tuple[str, list[int], list[asyncio.Future], float]] = []

    @property
    def dp_size(self) -> int:
        return len(self.handles)

    dp_rank = 0

    @classmethod
    async def start(
        cls,
        job: JobConfig,
        world: int,
        *,
        options: list[dict[str, Any]],
        cpus: list[list[int]] | None = None,
        seed: int = 0,
        threads: int = 1,
        roles: Sequence[str] = ("actor",),
    ) -> TrainerGroup:
        """Start `world` ranks (rank r with Ray actor `options[r]`, e.g. its placement-group
        bundle and devices), rendezvous through rank 0 and build `job`'s engines of `roles`
        (see `TrainerRank.build`) on each."""
        import ray

        actor = ray.remote(TrainerRank)
        handles = [
            actor.options(max_concurrency=4, **options[r]).remote(
                r, world, (cpus or [[]] * world)[r]
            )
            for r in range(world)
        ]
        group = cls(handles)
        await group._build(job, seed, threads, roles, rendezvous=True)
        return group

    @classmethod
    async def start_local(
        cls, job: JobConfig, *, threads: int = 1, roles: Sequence[str] = ("actor",)
    ) -> TrainerGroup:
        """One rank in this process (`runtime.trainer_in_driver`): no actor, no
        rendezvous, no reseeding; `job`'s engines of `roles` built on the rank's thread."""
        group = cls([LocalRank(TrainerRank(0, 1))])
        await group._build(job, None, threads, roles, rendezvous=False)
        return group

    @classmethod
    def around(
        cls, engine: Any = None, *, critic: Any = None, reference: Any = None
    ) -> TrainerGroup:
        """A one-rank group in this process around engines built already (any
        `TrainEngine`; a critic and/or a reference engine), e.g. a test's fake or an
        engine a script made itself. Its roles are the engines given."""
        rank = TrainerRank(0, 1)
        rank.engine, rank.critic, rank.reference = engine, critic, reference
        group = cls([LocalRank(rank)])
        group.roles = tuple(rank._built())
        if not group.roles:
            raise ValueError("TrainerGroup.around: give it an engine (actor, critic or reference)")
        if reference is not None:
            group.reference_fingerprint = rank._fingerprint(reference)
        with contextlib.suppress(RuntimeError):  # else bound at its first awaited call
            group._loop = asyncio.get_running_loop()
        group.pids = [os.getpid()]
        return group

    async def _build(
        self,
        job: JobConfig,
        seed: int | None,
        threads: int,
        roles: Sequence[str],
        *,
        rendezvous: bool,
    ) -> None:
        """Build `job`'s engines of `roles` on every rank (after the rendezvous through
        rank 0 when `rendezvous`); on any failure the ranks are shut down."""
        self._loop = asyncio.get_running_loop()
        self.roles = tuple(roles)
        handles = self.handles
        try:
            master = None
            if rendezvous:
                master = self.master = await self._one(0, "address", handles[0].address.remote())
            built = await self._all(
                "build", [h.build.remote(job, master, seed, threads, self.roles) for h in handles]
            )
            self.pids = [b["pid"] for b in built]
            self.reference_fingerprint = built[0].get("reference_fingerprint")
            self.node_ids = await self._all("node_id", [h.node_id.remote() for h in handles])
        except BaseException:
            self.shutdown()
            raise

    @property
    def local_rank(self) -> TrainerRank | None:
        """The rank object when the group is one rank in this process (its engines, to
        read after the run), else None."""
        h = self.handles[0] if len(self.handles) == 1 else None
        return h.rank if isinstance(h, LocalRank) else None

    # ---- fan-out -------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        for g in self.linked:
            g.begin_step(step)

    async def _one(self, rank: int, what: str, ref: Any) -> Any:
        return (await self._all(what, [ref], ranks=[rank]))[0]

    async def _all(self, what: str, refs: list[Any], ranks: list[int] | None = None) -> list:
        """Await `refs` together. The first failure fails the call: a rank that died is
        named before one that only saw its peer go (given `_GRACE_S` to show up), and the
        other ranks, which may wait in a collective for the failed one, are killed when
        `kill_on_failure`. A call with no answer within `call_timeout_s` fails too."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        if self.failed is not None:
            raise self.failed
        if self._loop is None:  # a group made `around` engines outside a loop
            self._loop = asyncio.get_running_loop()
        futures = [asyncio.ensure_future(_await(r)) for r in refs]
        self._calls = [c for c in self._calls if not all(f.done() for f in c[2])]
        self._calls.append((what, ranks, futures, time.monotonic()))
        try:
            done, _ = await asyncio.wait(
                futures, timeout=self.call_timeout_s, return_when=asyncio.FIRST_EXCEPTION
            )
            failed = [f for f in done if f.exception() is not None]
            if failed and not any(_died(f.exception()) for f in failed):
                await asyncio.wait(futures, timeout=_GRACE_S)
        except asyncio.CancelledError:
            for f in futures:
                f.cancel()
            raise
        errors = {
            r: f.exception()
            for r, f in zip(ranks, futures, strict=True)
            if f.done() and not f.cancelled() and f.exception() is not None
        }
        if not errors and all(f.done() for f in futures):
            return [f.result() for f in futures]
        if errors:
            rank = min(errors, key=lambda r: (not _died(errors[r]), r))
            cause: BaseException = errors[rank]
        else:
            late = [r for r, f in zip(ranks, futures, strict=True) if not f.done()]
            rank, cause = (
                late[0],
                TimeoutError(
                    f"ranks {late} gave no answer within {self.call_timeout_s:.0f}s "
                    f"(the group's call timeout: 2 x trainer.stall_timeout_s in a job)"
                ),
            )
        self.failed = TrainerRankFailed(rank, what, self.step, cause)
        for f in futures:
            f.cancel()
        if self.kill_on_failure:
            if not (rank == 0 and _died(cause)):
                # Rank 0 may hold a checkpoint-engine backend (shared-memory files); a free
                # thread of its actor closes it before the kill, which skips exit hooks.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.handles[0].close_backend.remote(), _GRACE_S)
            self.shutdown()
        raise self.failed

    def waiting(self) -> list[str]:
        """The calls in flight (this group's and its linked groups'), each with the ranks
        that have not answered yet and for how long, e.g. "update: ranks [1] for 12.0 s"
        (the stall watchdog's report)."""
        now = time.monotonic()
        out = []
        for what, ranks, futures, t0 in self._calls:
            late = [r for r, f in zip(ranks, futures, strict=True) if not f.done()]
            if late:
                out.append(f"{what}: ranks {late} for {now - t0:.1f} s")
        return out + [w for g in self.linked for w in g.waiting()]

    # ---- the TrainEngine calls of the training loop --------------------------------------
    def _shards(self, data: dict[str, Any]) -> list[list[int]]:
        tokens = data["attention_mask"].sum(dim=1).tolist()
        return split_by_tokens(tokens, self.dp_size)

    async def _scatter(self, method: str, data: dict[str, Any], *args: Any) -> tuple[list, list]:
        """Every rank's `method` on its token-balanced shard of `data`: (rows, results).
        One rank takes `data` itself (no copy of its rows)."""
        if self.dp_size == 1:
            rows = data["attention_mask"].shape[0]
            ref = getattr(self.handles[0], method).remote(data, *args)
            return [list(range(rows))], await self._all(method, [ref])
        parts = self._shards(data)
        refs = [
            getattr(h, method).remote(_rows(data, part), *args)
            for h, part in zip(self.handles, parts, strict=True)
        ]
        return parts, await self._all(method, refs)

    async def _per_row(self, method: str, data: dict[str, Any], *args: Any) -> torch.Tensor:
        """`method`'s [rows, R] answer for `data`, each rank's rows put back in order (one
        rank's answer as it is)."""
        parts, shards = await self._scatter(method, data, *args)
        if self.dp_size == 1:
            return shards[0]
        return gather_rows(parts, shards, data["response_mask"].shape[0])

    async def update(self, mini_batch: dict[str, Any], temperature: float | None = None) -> dict:
        """One optimizer step of every rank on its token-balanced shard of `mini_batch`."""
        _, metrics = await self._scatter("update", mini_batch, temperature)
        return merge_rank_metrics(metrics)

    async def compute_log_probs(self, batch: dict[str, Any], temperature: float | None = None):
        """Log-probs [B, R] of `batch`, each rank scoring its shard; rows back in order."""
        return await self._per_row("compute_log_probs", batch, temperature)

    def export_weights(self) -> _NotOnTheDriver:
        return _NotOnTheDriver()

    # ---- the critic's and the reference policy's calls (roles "critic", "reference") -----
    async def compute_values(self, batch: dict[str, Any]) -> torch.Tensor:
        """The critic's values [B, R] of `batch`; rows back in order."""
        return await self._per_row("compute_values", batch)

    async def update_critic(self, mini_batch: dict[str, Any]) -> dict[str, float]:
        """One critic step of every rank on its shard of `mini_batch` (the value loss is
        normalised over the whole mini-batch, on every rank)."""
        _, metrics = await self._scatter("update_critic", mini_batch)
        return merge_rank_metrics(metrics)

    async def ref_log_probs(self, batch: dict[str, Any], temperature: float | None = None):
        """The reference policy's log-probs [B, R] of `batch`; rows back in order."""
        return await self._per_row("ref_log_probs", batch, temperature)

    # ---- blocking calls, for worker threads (the checkpoint manager's, the critic's) -----
    def _block_on(self, what: str, call: Callable[[], Awaitable[Any]]) -> Any:
        """Run the coroutine `call()` on the group's event loop and wait for it: for a
        worker thread (on the loop itself it would deadlock, so it refuses)."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("TrainerGroup: not started on an event loop")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError(f"TrainerGroup.{what} blocks: call it from a worker thread")
        return asyncio.run_coroutine_threadsafe(call(), loop).result()

    def _blocking(self, what: str, refs: list[Any]) -> list:
        """`_all` from a worker thread: the refs are awaited on the group's event loop."""
        return self._block_on(what, lambda: self._all(what, refs))

    def save(self, path: str, role: str = "actor") -> None:
        """Every rank writes its shard of `role`'s engine to `path` (DCP; a shared
        filesystem across nodes)."""
        what = "save" if role == "actor" else f"save ({role})"
        self._blocking(what, [h.save.remote(path, role) for h in self.handles])

    def load(self, path: str, role: str = "actor") -> None:
        what = "load" if role == "actor" else f"load ({role})"
        self._blocking(what, [h.load.remote(path, role) for h in self.handles])

    # ---- teardown ------------------------------------------------------------------------
    def shutdown(self) -> None:
        for h in self.handles:
            with contextlib.suppress(Exception):  # already gone
                _kill(h)


def _kill(handle: Any) -> None:
    if isinstance(handle, LocalRank):
        handle.kill()
        return
    import ray

    ray.kill(handle)


async def _await(ref: Any) -> Any:
    return await ref


def _died(e: BaseException) -> bool:
    """The rank's process is gone (not an exception it raised)."""
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError)
