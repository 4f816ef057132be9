"""The staleness-bounded replay buffer (transfer queue) between rollout and training.

Pure Python and single-threaded: no Ray, no asyncio, no tensors. It knows prompt groups,
their status, the step they were submitted at and the weight versions of their samples;
it does not know how prompts are generated, scored or trained on. Blocking callers (the
trainer waiting for a batch) wrap it: see `AsyncReplayBuffer`.

Rules (DESIGN.md §3):
- span of a group = current step - submission step + 1; batches are taken oldest first;
- admission: at step s, at most `depth` batches' worth of groups are untrained, counting
  the groups already taken at step s; `depth` = 1 + num_warmup_batches (the batch the
  trainer takes next plus the warm-up batches generated ahead of it), and under `wait` at
  most max_off_policy_threshold. So a group is trained at span `depth` unless a straggler
  holds it back; num_warmup_batches=0 (or `wait` with threshold 1) is on-policy;
- `drop`: a finished group whose span exceeds the threshold is evicted, counted, and its
  slot reopens, so exactly as many new prompts are admitted as were evicted;
- `wait`: sampling is blocked while an unfinished group has reached the threshold;
- failed groups (reward function or engine error) are evicted, counted and refilled.
Every submitted prompt ends trained exactly once, evicted, failed, or is still in flight;
`prompts` (a `PromptLedger`) keeps that account by position of the data order, and is
saved and restored with the buffer, so it holds across resumes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from offbeat.core.buffer.group import GroupStatus, PromptGroup
from offbeat.core.buffer.prompt_ledger import EVICTED, FAILED, TRAINED, PromptLedger
from offbeat.core.data import Trajectory

STRATEGIES = ("drop", "wait")


@dataclass
class BufferConfig:
    """`groups_per_step`: prompt groups trained per global step (the train batch size in
    prompts). `num_warmup_batches`: batches generated ahead of the one being trained
    (submitted before step 1 and kept in flight)."""

    groups_per_step: int
    max_off_policy_threshold: int = 2
    max_off_policy_strategy: str = "drop"
    num_warmup_batches: int = 1

    def __post_init__(self) -> None:
        for key, low in (
            ("groups_per_step", 1),
            ("max_off_policy_threshold", 1),
            ("num_warmup_batches", 0),
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"buffer.{key}={value!r}: must be an int >= {low}")
        if self.max_off_policy_strategy not in STRATEGIES:
            raise ValueError(
                f"buffer.max_off_policy_strategy={self.max_off_policy_strategy!r}: "
                f"expected one of {STRATEGIES}"
            )
        if (
            self.max_off_policy_strategy == "drop"
            and self.num_warmup_batches + 1 > self.max_off_policy_threshold
        ):
            # Steady-state span equals the pipeline depth: every group would be dropped.
            raise ValueError(
                drop_depth_message(self.num_warmup_batches, self.max_off_policy_threshold)
            )

    @property
    def depth(self) -> int:
        """How many batches may be untrained at once (in the current step's window)."""
        if self.max_off_policy_strategy == "wait":
            return min(self.num_warmup_batches + 1, self.max_off_policy_threshold)
        return self.num_warmup_batches + 1


def drop_depth_message(num_warmup_batches: int, threshold: int) -> str:
    return (
        f"num_warmup_batches={num_warmup_batches} with max_off_policy_threshold={threshold} "
        f"under 'drop': groups are trained at span num_warmup_batches + 1 = "
        f"{num_warmup_batches + 1} > {threshold}, so every one would be evicted; use "
        f"num_warmup_batches <= {threshold - 1} (or the 'wait' strategy)"
    )


class ReplayBuffer:
    """Prompt groups from submission to training. See the module docstring for the rules."""

    def __init__(self, config: BufferConfig, *, start_step: int = 1) -> None:
        self.config = config
        self._step = start_step
        self._taken_this_step = 0
        self._next_seq = 0
        self._groups: dict[str, PromptGroup] = {}  # live: pending, running, finished
        # uid -> "trained" | "evicted" | "failed": every group that left the buffer.
        self._ledger: dict[str, str] = {}
        self._evicted_total = 0
        self._failed_total = 0
        self._trained_total = 0
        self.prompts = PromptLedger()  # position of the data order -> how it stands

    # ---- steps ---------------------------------------------------------------------------
    @property
    def current_step(self) -> int:
        return self._step

    def begin_step(self, step: int) -> None:
        """Enter global step `step` (after the previous step's weight sync)."""
        if step < self._step:
            raise ValueError(f"begin_step({step}): the buffer is already at step {self._step}")
        if step > self._step:
            self._taken_this_step = 0
        self._step = step

    # ---- admission -----------------------------------------------------------------------
    def num_untrained(self) -> int:
        return len(self._groups)

    def free_slots(self) -> int:
        """How many new prompts may be submitted now (0 when the pipeline is full)."""
        cap = self.config.depth * self.config.groups_per_step
        return max(0, cap - self._taken_this_step - len(self._groups))

    def submit(
        self, prompts: Sequence[dict[str, Any]], positions: Sequence[int] | None = None
    ) -> list[PromptGroup]:
        """Admit new prompts as pending groups at the current step. `positions`: theirs in
        the data order (None: the ones after the last prompt drawn)."""
        if len(prompts) > self.free_slots():
            raise ValueError(
                f"submit: {len(prompts)} prompts but only {self.free_slots()} free slots "
                f"at step {self._step}"
            )
        if positions is None:
            positions = range(self.prompts.next_position, self.prompts.next_position + len(prompts))
        if len(positions) != len(prompts):
            raise ValueError(f"submit: {len(prompts)} prompts but {len(positions)} positions")
        out = []
        for prompt, position in zip(prompts, positions, strict=True):
            seq = self._next_seq
            group = PromptGroup(uid=f"g{seq}", seq=seq, prompt=prompt, submission_step=self._step)
            self.prompts.draw(int(position), group.uid, self._step)  # raises on a duplicate
            self._next_seq += 1
            self._groups[group.uid] = group
            out.append(group)
        return out

    # ---- rollout side --------------------------------------------------------------------
    def take_pending(self, max_groups: int | None = None) -> list[PromptGroup]:
        """Oldest pending groups, marked running, for rollout workers to generate."""
        pending = [g for g in self._groups.values() if g.status is GroupStatus.PENDING]
        pending.sort(key=lambda g: g.seq)
        if max_groups is not None:
            pending = pending[:max_groups]
        for g in pending:
            g.status = GroupStatus.RUNNING
        return pending

    def finish(self, uid: str, trajectories: Iterable[Trajectory]) -> PromptGroup:
        group = self._live(uid, GroupStatus.RUNNING)
        group.trajectories = list(trajectories)
        if not group.trajectories:
            raise ValueError(f"finish({uid!r}): a finished group needs at least one trajectory")
        group.status = GroupStatus.FINISHED
        return group

    def fail(self, uid: str, error: str, reason: str = "error") -> PromptGroup:
        """A reward function or the engine raised: evict the group and count it, with
        the agent loop's `reason` (bad_row, reward_timeout, engine_error, ...)."""
        group = self._live(uid, GroupStatus.PENDING, GroupStatus.RUNNING)
        self.prompts.left(uid, FAILED, self._step, reason)
        group.status = GroupStatus.FAILED
        group.error = error
        del self._groups[uid]
        self._ledger[uid] = "failed"
        self._failed_total += 1
        return group

    # ---- trainer side --------------------------------------------------------------------
    def evict_stale(self) -> list[PromptGroup]:
        """Under `drop`, evict finished groups whose span exceeds the threshold."""
        if self.config.max_off_policy_strategy != "drop":
            return []
        limit = self.config.max_off_policy_threshold
        stale = [
            g
            for g in self._groups.values()
            if g.status is GroupStatus.FINISHED and g.span(self._step) > limit
        ]
        for g in stale:
            self.prompts.left(g.uid, EVICTED, self._step, f"span {g.span(self._step)} > {limit}")
            del self._groups[g.uid]
            self._ledger[g.uid] = "evicted"
        self._evicted_total += len(stale)
        return stale

    def blocked_by(self) -> list[PromptGroup]:
        """Under `wait`, the unfinished groups that have reached the threshold."""
        if self.config.max_off_policy_strategy != "wait":
            return []
        limit = self.config.max_off_policy_threshold
        return [
            g
            for g in self._groups.values()
            if g.status in (GroupStatus.PENDING, GroupStatus.RUNNING)
            and g.span(self._step) >= limit
        ]

    def num_finished(self) -> int:
        return sum(g.status is GroupStatus.FINISHED for g in self._groups.values())

    def ready(self, num_groups: int) -> bool:
        """Whether `sample(num_groups)` would succeed now (call `evict_stale` first)."""
        return self.num_finished() >= num_groups and not self.blocked_by()

    def sample(self, num_groups: int) -> list[PromptGroup]:
        """Take the `num_groups` oldest finished groups for training."""
        if num_groups <= 0:
            raise ValueError(f"sample({num_groups}): need at least one group")
        if blockers := self.blocked_by():
            raise RuntimeError(
                f"sample: blocked under 'wait' by {len(blockers)} unfinished groups at span "
                f">= {self.config.max_off_policy_threshold}"
            )
        finished = sorted(
            (g for g in self._groups.values() if g.status is GroupStatus.FINISHED),
            key=lambda g: g.seq,
        )
        if len(finished) < num_groups:
            raise RuntimeError(f"sample: {len(finished)} finished groups, need {num_groups}")
        batch = finished[:num_groups]
        for g in batch:
            if g.uid in self._ledger:  # by construction impossible; a cheap guard
                raise AssertionError(f"group {g.uid} left the buffer twice")
            self.prompts.left(g.uid, TRAINED, self._step)
            del self._groups[g.uid]
            self._ledger[g.uid] = "trained"
        self._trained_total += len(batch)
        self._taken_this_step += len(batch)
        return batch

    # ---- accounting ----------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        by_status = {s.value: 0 for s in GroupStatus if s is not GroupStatus.FAILED}
        for g in self._groups.values():
            by_status[g.status.value] += 1
        return {
            "submitted": self._next_seq,
            "trained": self._trained_total,
            "evicted": self._evicted_total,
            "failed": self._failed_total,
            **by_status,
        }

    def ledger(self) -> dict[str, str]:
        """uid -> how it left the buffer ("trained", "evicted" or "failed")."""
        return dict(self._ledger)

    def live_uids(self) -> list[str]:
        return list(self._groups)

    def check_accounting(self) -> None:
        """Raise if any submitted prompt is lost or counted twice."""
        c = self.counts()
        accounted = (
            c["trained"] + c["evicted"] + c["failed"] + c["pending"] + c["running"] + c["finished"]
        )
        if accounted != c["submitted"]:
            raise AssertionError(f"accounting broken: {c}")
        if set(self._ledger) & set(self._groups):
            raise AssertionError("a group is both live and gone")
        if len(self._ledger) + len(self._groups) != c["submitted"]:
            raise AssertionError(f"ledger size mismatch: {c}")
        self.prompts.check(set(self._groups))  # by position of the data order

    # ---- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Finished groups are kept; pending and running ones are saved as prompts to
        re-issue (their partial samples are discarded) with their submission steps; the
        prompt ledger goes with them."""
        live = sorted(self._groups.values(), key=lambda g: g.seq)
        return {
            "step": self._step,
            "taken_this_step": self._taken_this_step,
            "next_seq": self._next_seq,
            "finished": [g.to_dict() for g in live if g.status is GroupStatus.FINISHED],
            "reissue": [
                {
                    "uid": g.uid,
                    "seq": g.seq,
                    "prompt": g.prompt,
                    "submission_step": g.submission_step,
                }
                for g in live
                if g.status is not GroupStatus.FINISHED
            ],
            "ledger": dict(self._ledger),
            "prompts": self.prompts.state_dict(),
            "totals": {
                "evicted": self._evicted_total,
                "failed": self._failed_total,
                "trained": self._trained_total,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; re-issued prompts become pending again (their generation restarts on
        the restored weights), each exactly once, keeping its submission step (so the
        span rules judge it as the uninterrupted run would; a checkpoint without one: the
        restored step). They stay in flight in the prompt ledger."""
        self._step = int(state["step"])
        self._taken_this_step = int(state["taken_this_step"])
        self._next_seq = int(state["next_seq"])
        self._groups = {}
        for d in state["finished"]:
            g = PromptGroup.from_dict(d)
            self._groups[g.uid] = g
        for d in state["reissue"]:
            step = int(d.get("submission_step", self._step))
            g = PromptGroup(uid=d["uid"], seq=d["seq"], prompt=d["prompt"], submission_step=step)
            self._groups[g.uid] = g
        self._ledger = dict(state["ledger"])
        self.prompts = PromptLedger(self.prompts.dataset_size)
        if "prompts" in state:
            self.prompts.load_state_dict(state["prompts"])
        else:  # a checkpoint from before the prompt ledger: positions are submission order
            self.prompts.load_state_dict(_ledger_of(state, self._ledger))
        self.prompts.reissued += len(state["reissue"])
        self._evicted_total = int(state["totals"]["evicted"])
        self._failed_total = int(state["totals"]["failed"])
        self._trained_total = int(state["totals"]["trained"])

    # ---- helpers -------------------------------------------------------------------------
    def _live(self, uid: str, *allowed: GroupStatus) -> PromptGroup:
        group = self._groups.get(uid)
        if group is None:
            gone = self._ledger.get(uid)
            raise KeyError(f"group {uid!r} is not live" + (f" (it was {gone})" if gone else ""))
        if group.status not in allowed:
            raise ValueError(
                f"group {uid!r} is {group.status.value}; expected {[s.value for s in allowed]}"
            )
        return group


def _ledger_of(state: dict[str, Any], gone: dict[str, str]) -> dict[str, Any]:
    """A prompt ledger for a buffer state saved without one: group `g<seq>` was drawn at
    position `seq`; the groups that left the buffer left as its ledger says."""
    live = [d["uid"] for d in state["finished"]] + [d["uid"] for d in state["reissue"]]
    how = {**gone, **dict.fromkeys(live, "in_flight")}
    records = [(int(uid[1:]), uid, status, 0, 0, "") for uid, status in how.items()]
    n = int(state["next_seq"])
    return {"records": sorted(records), "start": 0, "next_position": n, "resumes": 0}
