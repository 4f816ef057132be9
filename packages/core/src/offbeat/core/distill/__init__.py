"""On-policy distillation (OPD): teachers score the student's own samples token by token.

The pieces an `opd` recipe composes on top of the separate_async job: the
`distillation` config and its checks, teacher routing and scoring pools, the agent loop
that scores finished groups, the advantage (negative per-token reverse KL, verl's k1),
per-task validation, and the job runner. `distillation.loss=topk_forward_kl` swaps the
advantage for a forward-KL term to the teacher's top-k tokens in the train engine's loss.
"""

from offbeat.core.distill.advantages import (
    ADVANTAGES,
    LOSSES,
    TEACHER_ID,
    TEACHER_LOG_PROBS,
    TEACHER_TOP_IDS,
    TEACHER_TOP_LOG_PROBS,
    opd_advantages,
    reverse_kl_by_teacher,
)
from offbeat.core.distill.config import DistillationConfig, TeacherConfig, TeacherSFTConfig
from offbeat.core.distill.teachers import TeacherPool, TeacherRouter, TeacherScoringError

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "TEACHER_ID",
    "TEACHER_LOG_PROBS",
    "TEACHER_TOP_IDS",
    "TEACHER_TOP_LOG_PROBS",
    "DistillationConfig",
    "TeacherConfig",
    "TeacherPool",
    "TeacherRouter",
    "TeacherSFTConfig",
    "TeacherScoringError",
    "opd_advantages",
    "reverse_kl_by_teacher",
]
