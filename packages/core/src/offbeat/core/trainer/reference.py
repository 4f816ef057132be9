"""The reference policy in the training loop: a frozen copy of the initial policy that
gives every batch its ``ref_log_probs``, and the KL to it, as the actor's loss term
(`algorithm.use_kl_loss`, applied by the actor's loss) and/or as a penalty in the reward
(`algorithm.use_kl_in_reward`, with a fixed or adaptive coefficient).

Knows nothing about the engine behind it beyond `compute_log_probs` and
`export_weights`, or `weights_fingerprint()` when the engine offers it (a worker group's
reference, whose weights stay on its ranks: `offbeat.core.runtime.GroupReferenceEngine`);
it is built through the train-engine registry (`build_reference_engine`). Nothing about
advantages. Its checkpoint state is the KL controller's coefficient and a
fingerprint of the reference weights: the weights themselves are model.path's, rebuilt on
resume, and the fingerprint proves that they are the same ones.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from offbeat.core.algorithms import (
    KLPenalty,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
    masked_mean,
)

if TYPE_CHECKING:
    from offbeat.core.config.schema import AlgorithmConfig

__all__ = ["Reference", "weights_fingerprint"]


def weights_fingerprint(named_tensors: Any) -> list[float]:
    """[parameter count, sum, sum of squares] over (name, tensor) pairs, in float64: equal
    for the same weights, different (in practice) for any others."""
    count, total, squares = 0, 0.0, 0.0
    for _, t in named_tensors:
        t = t.detach().to(torch.float64)
        count += t.numel()
        total += float(t.sum())
        squares += float(t.square().sum())
    return [float(count), total, squares]


class Reference:
    """`log_probs(data)` from the frozen engine; `kl_metrics` and `penalise` (the
    in-reward KL with its controller, stepped once per batch)."""

    def __init__(
        self, engine: Any, algorithm: AlgorithmConfig, temperature: float | None = None
    ) -> None:
        """`algorithm`: the job's section, whose KL keys it reads (`use_kl_loss`,
        `kl_loss_type`, `kl_loss_coef`, `use_kl_in_reward`, `kl_penalty`, `kl_clamp`,
        `kl_ctrl`); `temperature`: the rollout's (its log-probs are the sampler's)."""
        self.engine = engine
        self.algorithm = algorithm
        self.temperature = temperature
        k = algorithm.kl_ctrl
        self.controller = (
            build_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
            if algorithm.use_kl_in_reward
            else None
        )
        self._fingerprint: list[float] | None = None

    @property
    def fingerprint(self) -> list[float]:
        if self._fingerprint is None:
            own = getattr(self.engine, "weights_fingerprint", None)
            self._fingerprint = (
                list(own())
                if own is not None
                else weights_fingerprint(self.engine.export_weights())
            )
        return self._fingerprint

    def log_probs(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, R] reference log-probs of the batch's responses (blocking: run it in a
        worker thread)."""
        return self.engine.compute_log_probs(data, self.temperature)

    def kl_metrics(self, data: dict[str, torch.Tensor]) -> dict[str, float]:
        """`actor/kl`: the KL of the policy that sampled (old log-probs) to the reference,
        token mean with the configured estimator (the in-reward one when that is on, else
        the loss's); `actor/kl_coef`: the coefficient in use."""
        al = self.algorithm
        kind = al.kl_penalty if al.use_kl_in_reward else al.kl_loss_type
        per_token = kl_penalty(data["old_log_probs"], data["ref_log_probs"], kind, al.kl_clamp)
        coef = self.controller.value if self.controller is not None else al.kl_loss_coef
        return {
            "actor/kl": float(masked_mean(per_token, data["response_mask"])),
            "actor/kl_coef": float(coef),
        }

    def penalise(
        self, token_scores: torch.Tensor, data: dict[str, torch.Tensor]
    ) -> tuple[KLPenalty, dict[str, float]]:
        """token_scores - beta × KL per token (beta: the controller's value now), then one
        controller step with the batch's KL over its number of rows."""
        assert self.controller is not None, "penalise needs algorithm.use_kl_in_reward"
        pen = apply_kl_penalty(
            token_scores, data["old_log_probs"], data["ref_log_probs"], data["response_mask"],
            self.controller.value, kind=self.algorithm.kl_penalty, clamp=self.algorithm.kl_clamp,
        )  # fmt: skip
        self.controller.update(pen.current_kl, n_steps=int(token_scores.shape[0]))
        return pen, {"actor/reward_kl_penalty": pen.current_kl, "actor/kl_coef": pen.beta}

    # ---- checkpoint ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "kl_controller": self.controller.state_dict() if self.controller else None,
            "fingerprint": self.fingerprint,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore the controller; fail when the reference weights differ from the saved
        run's (model.path changed between the run and its resume)."""
        saved = state.get("fingerprint")
        if saved is not None and not _close(saved, self.fingerprint):
            raise ValueError(
                "resume: the reference model's weights differ from the checkpointed run's "
                f"(fingerprint {saved} vs {self.fingerprint}); the reference is built from "
                "model.path, which must name the same initial policy as before"
            )
        if self.controller is not None and state.get("kl_controller") is not None:
            self.controller.load_state_dict(state["kl_controller"])


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-6) for x, y in zip(a, b, strict=True)
    )
