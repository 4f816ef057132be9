"""Every prompt of the data order, from the moment it is drawn to how it left the run.

Pure Python. A prompt is named by its position in the sampler's stream (epoch × dataset
size + index within the epoch's permutation, or the draw count for a loader without a
position), and ends exactly one way: trained (at a step), evicted (stale, at a step) or
failed (with the reason the agent loop gave); until then it is in flight. The ledger is
saved with the replay buffer, so across any number of kills and resumes the prompts the
checkpoint's weights were trained on are counted once: a prompt drawn twice or leaving
twice raises `PromptDuplicated` where it happens, and `check` raises `PromptLost` when a
prompt in flight is no longer in the buffer or a position of the stream was skipped.
Knows nothing of groups' samples, weights or the loader: callers report transitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IN_FLIGHT = "in_flight"
TRAINED = "trained"
EVICTED = "evicted"
FAILED = "failed"
STATUSES = (IN_FLIGHT, TRAINED, EVICTED, FAILED)


class PromptAccountingError(AssertionError):
    """The run's prompt accounting is broken: a prompt was duplicated or lost."""


class PromptDuplicated(PromptAccountingError):
    """A position of the data order was drawn twice, or a prompt left the run twice."""


class PromptLost(PromptAccountingError):
    """A prompt in flight is gone from the buffer, or a position of the stream was skipped."""


@dataclass
class PromptRecord:
    """One prompt of the data order: its group, how it stands, the step it was drawn and
    the step it left (0 while in flight), and a failure's reason."""

    position: int
    uid: str
    status: str = IN_FLIGHT
    drawn_step: int = 0
    left_step: int = 0
    reason: str = ""

    def to_tuple(self) -> tuple:
        return (self.position, self.uid, self.status, self.drawn_step, self.left_step, self.reason)

    @classmethod
    def from_tuple(cls, t: Any) -> PromptRecord:
        position, uid, status, drawn, left, reason = t
        if status not in STATUSES:
            raise ValueError(f"prompt ledger: status {status!r} of prompt {position}: {STATUSES}")
        return cls(int(position), str(uid), status, int(drawn), int(left), str(reason))


class PromptLedger:
    """Positions of the data order -> `PromptRecord`. `dataset_size` (None: unknown) gives
    `summary()` its count of prompts of the epochs begun that were never drawn."""

    def __init__(self, dataset_size: int | None = None) -> None:
        self.dataset_size = dataset_size
        self._records: dict[int, PromptRecord] = {}
        self._by_uid: dict[str, int] = {}
        self.start = 0  # the first position drawn (a run may start mid-stream)
        self.next_position = 0  # the position the next draw must have
        self.resumes = 0
        self.reissued = 0  # prompts in flight at a checkpoint, generated again on resume

    # ---- transitions ---------------------------------------------------------------------
    def draw(self, position: int, uid: str, step: int) -> PromptRecord:
        """`position` of the data order was submitted as group `uid` at `step`."""
        if position in self._records:
            old = self._records[position]
            raise PromptDuplicated(
                f"prompt {position} of the data order drawn twice: as group {old.uid} at step "
                f"{old.drawn_step} ({old.status}) and as {uid} at step {step}; the sampler's "
                "position and the buffer's state come from different checkpoints"
            )
        if uid in self._by_uid:
            first = self._by_uid[uid]
            raise PromptDuplicated(f"group {uid} submitted twice: positions {first}, {position}")
        if not self._records:
            self.start = self.next_position = position
        if position != self.next_position:
            raise PromptLost(
                f"the data order skipped positions {self.next_position}..{position - 1}: "
                f"prompt {position} drawn next (group {uid}, step {step})"
            )
        record = PromptRecord(position, uid, drawn_step=step)
        self._records[position] = record
        self._by_uid[uid] = position
        self.next_position = position + 1
        return record

    def left(self, uid: str, status: str, step: int, reason: str = "") -> PromptRecord:
        """Group `uid` left the run: `status` is trained, evicted or failed."""
        if status not in (TRAINED, EVICTED, FAILED):
            raise ValueError(f"left({uid!r}, {status!r}): expected trained, evicted or failed")
        if uid not in self._by_uid:
            raise PromptLost(f"group {uid} left the run ({status}) but was never drawn")
        record = self._records[self._by_uid[uid]]
        if record.status != IN_FLIGHT:
            raise PromptDuplicated(
                f"prompt {record.position} (group {uid}) left twice: {record.status} at step "
                f"{record.left_step}, then {status} at step {step}"
            )
        record.status, record.left_step, record.reason = status, step, reason
        return record

    # ---- reading -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._records)

    def record(self, uid: str) -> PromptRecord:
        return self._records[self._by_uid[uid]]

    def position_of(self, uid: str) -> int | None:
        return self._by_uid.get(uid)

    def records(self) -> list[PromptRecord]:
        return [self._records[p] for p in sorted(self._records)]

    def positions(self, status: str) -> list[int]:
        return sorted(p for p, r in self._records.items() if r.status == status)

    def in_flight_uids(self) -> set[str]:
        return {r.uid for r in self._records.values() if r.status == IN_FLIGHT}

    def summary(self) -> dict[str, Any]:
        """Counts: drawn, trained, evicted, failed (and by reason), in flight, unseen (of
        the epochs begun, never drawn; None without a dataset size), resumes, reissued."""
        by_status = dict.fromkeys(STATUSES, 0)
        reasons: dict[str, int] = {}
        for r in self._records.values():
            by_status[r.status] += 1
            if r.status == FAILED:
                reasons[r.reason or "error"] = reasons.get(r.reason or "error", 0) + 1
        unseen = None
        if self.dataset_size:
            end = -(-self.next_position // self.dataset_size) * self.dataset_size
            unseen = end - self.next_position
        return {
            "drawn": len(self._records),
            **by_status,
            "failed_by_reason": dict(sorted(reasons.items())),
            "unseen": unseen,
            "first_position": self.start,
            "next_position": self.next_position,
            "resumes": self.resumes,
            "reissued": self.reissued,
        }

    def metrics(self) -> dict[str, float]:
        """`prompts/<count>` of `summary()`, and `prompts/failed_<reason>`."""
        s = self.summary()
        out = {
            f"prompts/{k}": float(s[k])
            for k in ("drawn", TRAINED, EVICTED, FAILED, IN_FLIGHT, "resumes", "reissued")
        }
        if s["unseen"] is not None:
            out["prompts/unseen"] = float(s["unseen"])
        out.update({f"prompts/failed_{r}": float(n) for r, n in s["failed_by_reason"].items()})
        return out

    def describe(self) -> str:
        s = self.summary()
        failed = ", ".join(f"{k} {v}" for k, v in s["failed_by_reason"].items())
        return (
            f"prompts drawn {s['drawn']}: trained {s['trained']}, evicted {s['evicted']}, "
            f"failed {s['failed']}{f' ({failed})' if failed else ''}, in flight "
            f"{s['in_flight']}; unseen in the epochs begun {s['unseen']}; resumes "
            f"{s['resumes']} (re-issued {s['reissued']})"
        )

    def check(self, live_uids: set[str] | list[str] | None = None) -> None:
        """Raise `PromptLost` / `PromptDuplicated` unless every drawn position is accounted
        once and, given the buffer's live groups, exactly those are in flight."""
        expected = range(self.start, self.next_position)
        if len(self._records) != len(expected) or any(p not in self._records for p in expected):
            missing = [p for p in expected if p not in self._records][:10]
            raise PromptLost(f"prompt ledger: positions missing from the data order: {missing}")
        if len(self._by_uid) != len(self._records):
            raise PromptDuplicated("prompt ledger: a group holds two positions")
        if live_uids is not None:
            live, flying = set(live_uids), self.in_flight_uids()
            if lost := sorted(flying - live):
                raise PromptLost(
                    f"{len(lost)} prompts in flight are no longer in the buffer (lost): {lost[:10]}"
                )
            if extra := sorted(live - flying):
                raise PromptDuplicated(
                    f"{len(extra)} groups in the buffer are not in flight in the ledger: "
                    f"{extra[:10]}"
                )

    # ---- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "records": [r.to_tuple() for r in self.records()],
            "start": self.start,
            "next_position": self.next_position,
            "dataset_size": self.dataset_size,
            "resumes": self.resumes,
            "reissued": self.reissued,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved ledger; this counts as one more resume."""
        records = [PromptRecord.from_tuple(t) for t in state["records"]]
        self._records = {r.position: r for r in records}
        self._by_uid = {r.uid: r.position for r in records}
        self.start = int(state["start"])
        self.next_position = int(state["next_position"])
        if self.dataset_size is None:
            self.dataset_size = state.get("dataset_size")
        self.resumes = int(state.get("resumes", 0)) + 1
        self.reissued = int(state.get("reissued", 0))
