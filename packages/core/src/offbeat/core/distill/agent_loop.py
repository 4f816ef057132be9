"""The distillation agent loop: the single-turn loop's trajectories, scored by their
teacher as soon as their group finishes.

Wraps any agent loop with `sample(uid, row, n, sampling) -> list[Trajectory]`: routes
the row to a teacher, asks that teacher for the log-prob of every response token (all of
the group's trajectories at once, while the rollout goes on with other groups), and
stores them in each trajectory's extras beside the student's rollout log-probs. A
row with images has them sent with its sequences (a vision-language teacher scores the
student's widened image placeholders with the same images). A
teacher that still fails after its retries fails the group (`GroupFailed`, reason
`teacher_error`: evicted, counted, refilled by the rollout driver), never the run. A
group's teacher calls are in flight in the run's progress registry (stage "teacher",
keyed by teacher). Knows nothing about engines or the loss.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from offbeat.core import progress
from offbeat.core.data import Trajectory
from offbeat.core.data.vision import png_bytes
from offbeat.core.distill.advantages import (
    TEACHER_ID,
    TEACHER_LOG_PROBS,
    TEACHER_TOP_IDS,
    TEACHER_TOP_LOG_PROBS,
)
from offbeat.core.distill.teachers import TeacherPool, TeacherRouter, TeacherScoringError
from offbeat.core.tasks.images import decode_image, row_images
from offbeat.core.trainer.agent_loop import GroupFailed

__all__ = ["DistillAgentLoop", "row_multi_modal_data"]


def row_multi_modal_data(row: Mapping[str, Any]) -> dict[str, list[bytes]] | None:
    """A row's images as a teacher's scoring request takes them (`{"image": [PNG bytes,
    ...]}`, decoded and re-encoded as the student's prompt sent them to its engine), or
    None for a text row. The student's prompt ids hold the images' widened placeholders:
    a vision-language teacher scores them with the same images."""
    images = row_images(row)
    if not images:
        return None
    return {"image": [png_bytes(decode_image(im)) for im in images]}


class DistillAgentLoop:
    """`agent` (the student's loop) + teacher scoring; see the module docstring.
    `top_k > 0`: also the teacher's k most likely tokens at each response position (the
    top-k forward-KL loss)."""

    def __init__(
        self, agent: Any, router: TeacherRouter, teachers: TeacherPool, *, top_k: int = 0
    ) -> None:
        self.agent = agent
        self.router = router
        self.teachers = teachers
        self.top_k = top_k

    def __getattr__(self, name: str) -> Any:  # the inner loop's tokenizer, client, ...
        return getattr(self.agent, name)

    async def sample(
        self, uid: str, row: Mapping[str, Any], n: int, sampling: Mapping[str, Any] | None = None
    ) -> list[Trajectory]:
        try:
            teacher = self.router.route(row)
        except KeyError as e:
            raise GroupFailed(str(e)) from e
        trajectories = await self.agent.sample(uid, row, n, sampling)
        k = self.top_k
        mm = await asyncio.to_thread(row_multi_modal_data, row)  # PNG encoding: off the loop
        try:
            with progress.working("teacher", teacher, f"group {uid}"):
                scores = await asyncio.gather(
                    *(
                        self.teachers.score_top(teacher, [*t.prompt_ids, *t.response_ids], len(t.prompt_ids), k, mm)
                        if k
                        else self.teachers.score(teacher, [*t.prompt_ids, *t.response_ids], len(t.prompt_ids), mm)
                        for t in trajectories
                        if t.response_ids
                    )
                )  # fmt: skip
        except TeacherScoringError as e:
            raise GroupFailed(str(e), "teacher_error") from e
        it = iter(scores)
        index = float(self.router.index(teacher))
        for t in trajectories:
            s = next(it) if t.response_ids else None
            if k:
                t.extras[TEACHER_LOG_PROBS] = s["log_probs"] if s else []
                t.extras[TEACHER_TOP_IDS] = s["top_ids"] if s else []
                t.extras[TEACHER_TOP_LOG_PROBS] = s["top_log_probs"] if s else []
            else:
                t.extras[TEACHER_LOG_PROBS] = s if s else []
            t.extras[TEACHER_ID] = index
        return trajectories
