"""Trajectory batches: the padded tensor form the trainer consumes, and its unpadded rows.

Knows nothing about tokenizers, models or how trajectories were produced: token ids in,
token ids out. Layout: prompts are LEFT-padded to a common width P and responses
RIGHT-padded to a common width R, so `input_ids = [prompt | response]` has every
response in its last R columns (the layout train engines read). A multi-turn response
holds tokens the policy did not sample (tool observations, template tokens): they are
attended to (`response_attention_mask`) but not trained on (`response_mask` has gaps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

__all__ = ["Trajectory", "TrajectoryBatch"]


@dataclass
class Trajectory:
    """One sampled response to one prompt, unpadded."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]  # behaviour policy log-prob of each response token
    reward: float = 0.0
    min_weight_version: int = 0  # oldest weights that produced any of its tokens
    max_weight_version: int = 0
    group_uid: str = ""  # trajectories of one prompt share it (GRPO / RLOO groups)
    session_id: str = ""
    # 1 on the tokens the policy sampled (trained on), 0 on tokens a tool or the chat
    # template wrote (attended to, not trained on); None: every response token is policy.
    response_mask: list[int] | None = None
    # Numbers about how the trajectory was made (turns, tool calls, errors), for metrics
    # only; never padded into the batch.
    info: dict[str, float] = field(default_factory=dict)
    # Per-row extras: a float (a scalar per trajectory) or a list aligned with
    # response_ids (e.g. advantages, old log-probs), whose items may themselves be
    # equal-length lists (k values per token: padded to [B, R, k]).
    extras: dict[str, Any] = field(default_factory=dict)
    # The prompt's vision inputs for the model's forward (e.g. pixel_values and
    # image_grid_thw, `offbeat.core.data.vision`); None: a text-only prompt.
    multi_modal: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if len(self.rollout_log_probs) != len(self.response_ids):
            raise ValueError(
                f"Trajectory: {len(self.response_ids)} response_ids but "
                f"{len(self.rollout_log_probs)} rollout_log_probs"
            )
        if self.response_mask is not None and len(self.response_mask) != len(self.response_ids):
            raise ValueError(
                f"Trajectory: {len(self.response_ids)} response_ids but "
                f"{len(self.response_mask)} response_mask entries"
            )


@dataclass
class TrajectoryBatch:
    """B trajectories as tensors ([B, P] prompts, [B, R] responses, [B] per row) + lists.

    `extras` holds further per-row tensors (first dim B): `[B, R]` tensors are aligned
    with the responses (advantages, old/ref log-probs, values), others are per row.
    """

    prompt_ids: torch.Tensor  # [B, P] int64, left-padded with pad_token_id
    prompt_mask: torch.Tensor  # [B, P] int64, 1 on real prompt tokens
    response_ids: torch.Tensor  # [B, R] int64, right-padded
    response_mask: torch.Tensor  # [B, R] int64, 1 on policy tokens (the loss mask)
    rollout_log_probs: torch.Tensor  # [B, R] float32, 0 on padding
    rewards: torch.Tensor  # [B] float32
    min_weight_version: torch.Tensor  # [B] int64
    max_weight_version: torch.Tensor  # [B] int64
    group_uids: list[str]
    session_ids: list[str]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    pad_token_id: int = 0
    # [B, R] int64, 1 on every real response token (policy, tool and template tokens);
    # None: the same as response_mask (single-turn responses have no gaps).
    response_attention_mask: torch.Tensor | None = None
    # Per row, its prompt's vision inputs (a dict of tensors) or None; None for the whole
    # field: a text-only batch. Rows keep theirs through select, split, concat and repad.
    multi_modal: list[dict[str, Any] | None] | None = None

    def __post_init__(self) -> None:
        if self.multi_modal is not None and not any(self.multi_modal):
            self.multi_modal = None
        if self.response_attention_mask is None:
            self.response_attention_mask = self.response_mask.clone()
        b = self.prompt_ids.shape[0]
        p, r = self.prompt_ids.shape[1], self.response_ids.shape[1]
        shapes = {
            "prompt_ids": (self.prompt_ids, (b, p)),
            "prompt_mask": (self.prompt_mask, (b, p)),
            "response_ids": (self.response_ids, (b, r)),
            "response_mask": (self.response_mask, (b, r)),
            "response_attention_mask": (self.response_attention_mask, (b, r)),
            "rollout_log_probs": (self.rollout_log_probs, (b, r)),
            "rewards": (self.rewards, (b,)),
            "min_weight_version": (self.min_weight_version, (b,)),
            "max_weight_version": (self.max_weight_version, (b,)),
        }
        for name, (t, want) in shapes.items():
            if tuple(t.shape) != want:
                raise ValueError(f"TrajectoryBatch.{name}: shape {tuple(t.shape)}, expected {want}")
        lists = [("group_uids", self.group_uids), ("session_ids", self.session_ids)]
        if self.multi_modal is not None:
            lists.append(("multi_modal", self.multi_modal))
        for name, lst in lists:
            if len(lst) != b:
                raise ValueError(f"TrajectoryBatch.{name}: {len(lst)} entries for {b} rows")
        for name, t in self.extras.items():
            if t.dim() == 0 or t.shape[0] != b:
                raise ValueError(
                    f"TrajectoryBatch.extras[{name!r}]: shape {tuple(t.shape)}, first dim must be {b}"
                )

    # -- padding -------------------------------------------------------------------------

    @classmethod
    def pad(
        cls,
        trajectories: Sequence[Trajectory],
        *,
        pad_token_id: int = 0,
        prompt_width: int | None = None,
        response_width: int | None = None,
    ) -> TrajectoryBatch:
        """Pad `trajectories` into one batch (widths default to the longest row)."""
        if not trajectories:
            raise ValueError("TrajectoryBatch.pad: no trajectories")
        p = max(len(t.prompt_ids) for t in trajectories)
        r = max(len(t.response_ids) for t in trajectories)
        p = p if prompt_width is None else _check_width("prompt_width", prompt_width, p)
        r = r if response_width is None else _check_width("response_width", response_width, r)
        b = len(trajectories)
        prompt_ids = torch.full((b, p), pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((b, p), dtype=torch.long)
        response_ids = torch.full((b, r), pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((b, r), dtype=torch.long)
        attention = torch.zeros((b, r), dtype=torch.long)
        log_probs = torch.zeros((b, r), dtype=torch.float32)
        extras: dict[str, torch.Tensor] = {}
        for name in trajectories[0].extras:
            if any(name not in t.extras for t in trajectories):
                raise ValueError(f"TrajectoryBatch.pad: extra {name!r} missing on some rows")
            per_token = isinstance(trajectories[0].extras[name], list | tuple | torch.Tensor)
            # k values per token: the width of the first non-empty row's first token.
            inner = next((tuple(torch.as_tensor(v[0]).shape) for t in trajectories
                          if len(v := t.extras[name]) > 0), ()) if per_token else ()  # fmt: skip
            extras[name] = torch.zeros((b, r, *inner) if per_token else (b,), dtype=torch.float32)
        for i, t in enumerate(trajectories):
            n, m = len(t.prompt_ids), len(t.response_ids)
            if n:
                prompt_ids[i, p - n :] = torch.as_tensor(t.prompt_ids, dtype=torch.long)
                prompt_mask[i, p - n :] = 1
            if m:
                response_ids[i, :m] = torch.as_tensor(t.response_ids, dtype=torch.long)
                attention[i, :m] = 1
                policy = t.response_mask
                response_mask[i, :m] = 1 if policy is None else torch.as_tensor(policy)
                log_probs[i, :m] = torch.as_tensor(t.rollout_log_probs, dtype=torch.float32)
            for name, out in extras.items():
                value = t.extras[name]
                if out.dim() >= 2:
                    if len(value) != m:
                        raise ValueError(
                            f"TrajectoryBatch.pad: extra {name!r} has {len(value)} values "
                            f"for {m} response tokens (row {i})"
                        )
                    if m:
                        out[i, :m] = torch.as_tensor(value, dtype=torch.float32)
                else:
                    out[i] = float(value)
        return cls(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            rollout_log_probs=log_probs,
            rewards=torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32),
            min_weight_version=torch.tensor(
                [t.min_weight_version for t in trajectories], dtype=torch.long
            ),
            max_weight_version=torch.tensor(
                [t.max_weight_version for t in trajectories], dtype=torch.long
            ),
            group_uids=[t.group_uid for t in trajectories],
            session_ids=[t.session_id for t in trajectories],
            extras=extras,
            pad_token_id=pad_token_id,
            response_attention_mask=attention,
            multi_modal=[t.multi_modal for t in trajectories],
        )

    def unpad(self) -> list[Trajectory]:
        """The rows back as unpadded `Trajectory`s (inverse of `pad`)."""
        out = []
        r = self.response_width
        for i in range(len(self)):
            pm, rm = self.prompt_mask[i].bool(), self.response_attention_mask[i].bool()
            policy = self.response_mask[i][rm]
            extras: dict[str, Any] = {}
            for name, t in self.extras.items():
                per_token = t.dim() == 2 and t.shape[1] == r
                extras[name] = t[i][rm].tolist() if per_token else t[i].tolist()
            out.append(
                Trajectory(
                    prompt_ids=self.prompt_ids[i][pm].tolist(),
                    response_ids=self.response_ids[i][rm].tolist(),
                    rollout_log_probs=self.rollout_log_probs[i][rm].tolist(),
                    reward=float(self.rewards[i]),
                    min_weight_version=int(self.min_weight_version[i]),
                    max_weight_version=int(self.max_weight_version[i]),
                    group_uid=self.group_uids[i],
                    session_id=self.session_ids[i],
                    response_mask=None if bool(policy.all()) else policy.tolist(),
                    extras=extras,
                    multi_modal=None if self.multi_modal is None else self.multi_modal[i],
                )
            )
        return out

    def repad(self, prompt_width: int, response_width: int) -> TrajectoryBatch:
        """The same rows at other widths (never narrower than the longest row)."""
        return TrajectoryBatch.pad(
            self.unpad(),
            pad_token_id=self.pad_token_id,
            prompt_width=prompt_width,
            response_width=response_width,
        )

    def trim(self) -> TrajectoryBatch:
        """The same rows at the narrowest widths that hold them."""
        return self.repad(self.max_prompt_length(), self.max_response_length())

    # -- rows ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.prompt_ids.shape[0])

    def select(self, indices: Sequence[int] | torch.Tensor) -> TrajectoryBatch:
        """The rows at `indices` (in that order; repeats allowed), at the same widths."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        rows = idx.tolist()
        return TrajectoryBatch(
            prompt_ids=self.prompt_ids[idx],
            prompt_mask=self.prompt_mask[idx],
            response_ids=self.response_ids[idx],
            response_mask=self.response_mask[idx],
            rollout_log_probs=self.rollout_log_probs[idx],
            rewards=self.rewards[idx],
            min_weight_version=self.min_weight_version[idx],
            max_weight_version=self.max_weight_version[idx],
            group_uids=[self.group_uids[i] for i in rows],
            session_ids=[self.session_ids[i] for i in rows],
            extras={k: v[idx] for k, v in self.extras.items()},
            pad_token_id=self.pad_token_id,
            response_attention_mask=self.response_attention_mask[idx],
            multi_modal=None if self.multi_modal is None else [self.multi_modal[i] for i in rows],
        )

    def split(self, size: int) -> list[TrajectoryBatch]:
        """Consecutive batches of `size` rows (the last may be shorter): mini-/micro-batches."""
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"TrajectoryBatch.split: size={size!r} must be an int > 0")
        n = len(self)
        return [self.select(range(s, min(s + size, n))) for s in range(0, n, size)]

    def chunk(self, parts: int) -> list[TrajectoryBatch]:
        """`parts` consecutive batches whose sizes differ by at most one (e.g. DP shards)."""
        if not isinstance(parts, int) or not 0 < parts <= len(self):
            raise ValueError(f"TrajectoryBatch.chunk: parts={parts!r} must be in 1..{len(self)}")
        base, extra = divmod(len(self), parts)
        out, start = [], 0
        for k in range(parts):
            stop = start + base + (1 if k < extra else 0)
            out.append(self.select(range(start, stop)))
            start = stop
        return out

    @staticmethod
    def concat(batches: Sequence[TrajectoryBatch]) -> TrajectoryBatch:
        """Rows of all `batches` in order, padded to the widest of them."""
        if not batches:
            raise ValueError("TrajectoryBatch.concat: no batches")
        pads = {b.pad_token_id for b in batches}
        keys = {tuple(sorted(b.extras)) for b in batches}
        if len(pads) > 1 or len(keys) > 1:
            raise ValueError(
                f"TrajectoryBatch.concat: batches disagree on pad_token_id {sorted(pads)} "
                f"or extras {sorted(keys)}"
            )
        p = max(b.prompt_width for b in batches)
        r = max(b.response_width for b in batches)
        same = [
            b if (b.prompt_width, b.response_width) == (p, r) else b.repad(p, r) for b in batches
        ]

        def cat(get):
            return torch.cat([get(b) for b in same])

        return TrajectoryBatch(
            prompt_ids=cat(lambda b: b.prompt_ids),
            prompt_mask=cat(lambda b: b.prompt_mask),
            response_ids=cat(lambda b: b.response_ids),
            response_mask=cat(lambda b: b.response_mask),
            rollout_log_probs=cat(lambda b: b.rollout_log_probs),
            rewards=cat(lambda b: b.rewards),
            min_weight_version=cat(lambda b: b.min_weight_version),
            max_weight_version=cat(lambda b: b.max_weight_version),
            group_uids=[u for b in same for u in b.group_uids],
            session_ids=[s for b in same for s in b.session_ids],
            extras={k: cat(lambda b, k=k: b.extras[k]) for k in same[0].extras},
            pad_token_id=same[0].pad_token_id,
            response_attention_mask=cat(lambda b: b.response_attention_mask),
            multi_modal=[m for b in same for m in (b.multi_modal or [None] * len(b))],
        )

    def to(self, device: torch.device | str) -> TrajectoryBatch:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        extras = {k: v.to(device) for k, v in self.extras.items()}
        return replace(self, **moved, extras=extras)

    # -- model view ----------------------------------------------------------------------

    @property
    def prompt_width(self) -> int:
        return int(self.prompt_ids.shape[1])

    @property
    def response_width(self) -> int:
        return int(self.response_ids.shape[1])

    def max_prompt_length(self) -> int:
        return int(self.prompt_mask.sum(-1).max()) if len(self) else 0

    def max_response_length(self) -> int:
        return int(self.response_attention_mask.sum(-1).max()) if len(self) else 0

    def num_response_tokens(self) -> int:
        """Real response tokens (policy and tool/template ones)."""
        return int(self.response_attention_mask.sum())

    @property
    def input_ids(self) -> torch.Tensor:
        """[B, P + R]: prompt then response; responses are the last R columns."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_attention_mask], dim=1)

    @property
    def position_ids(self) -> torch.Tensor:
        """0 at each row's first real token; padding gets 0 too."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """A flat dict for a train engine: input_ids, attention_mask, position_ids,
        response_mask, rollout_log_probs, rewards, every extra, and `multi_modal` (a list
        of B per-row dicts or None) when a row has vision inputs."""
        vision = {} if self.multi_modal is None else {"multi_modal": list(self.multi_modal)}
        return {
            **vision,
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
            "response_mask": self.response_mask,
            "rollout_log_probs": self.rollout_log_probs,
            "rewards": self.rewards,
            **self.extras,
        }


def _check_width(name: str, width: int, needed: int) -> int:
    if width < needed:
        raise ValueError(f"TrajectoryBatch.pad: {name}={width} < longest row ({needed})")
    return width
