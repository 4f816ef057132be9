"""The `distillation` section of an on-policy distillation (OPD) job, and its checks.

Knows nothing about engines or training: teachers by name (a model, its replicas and
tensor parallelism, optionally a supervised build of a tiny teacher on a synthetic task),
the row key that routes a sample to a teacher, and how the loss mixes the teachers'
signal with the task reward. `check` rules reject routes with no teacher and a teacher
whose vocabulary is not the student's, before anything starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offbeat.core.config.validation import Problems, check
from offbeat.core.distill.advantages import ADVANTAGES, LOSSES
from offbeat.core.tasks.synthetic import SyntheticTaskConfig
from offbeat.core.tasks.visual import MIXABLE_TASKS

if TYPE_CHECKING:
    from offbeat.core.config.schema import DataConfig, JobConfig

__all__ = ["DistillationConfig", "TeacherConfig", "TeacherSFTConfig", "route_keys"]


@dataclass
class TeacherSFTConfig:
    """Build the teacher locally: supervised fine-tuning of `model` on a synthetic task
    (`steps=0`: use `model` as it is). Cached like the warm start."""

    task: str = ""  # a synthetic task (offbeat.core.tasks.visual.MIXABLE_TASKS)
    min_len: int = 1
    max_len: int = 1
    n_train: int = 4000
    steps: int = 0
    batch_size: int = 64
    lr: float = 3.0e-3
    seed: int = 0


@dataclass
class TeacherConfig:
    """One teacher: `model` (an HF directory, `offbeat-tiny:<size>` or the tiny VLM
    `offbeat-tiny-vl`), `replicas` engine replicas of `tensor_parallel_size` devices each,
    behind a balancer of their own."""

    model: str = ""
    replicas: int = 1
    tensor_parallel_size: int = 1
    sft: TeacherSFTConfig = field(default_factory=TeacherSFTConfig)


@dataclass
class DistillationConfig:
    """Teachers by name; `teacher_key` is the row field whose value names a sample's
    teacher (`default_teacher` takes values no teacher is named after; "" none)."""

    teachers: dict[str, TeacherConfig] = field(default_factory=dict)
    teacher_key: str = "data_source"
    default_teacher: str = ""
    # Advantage = -(log pi_student - log pi_teacher) per token (verl's k1, no discount,
    # no group baseline) + reward_weight x the task reward's GRPO advantage.
    # `advantage`: "k1" (the published recipe) or "k1_centred" (minus its token mean over
    # the step's batch: a constant baseline, the same gradient in expectation, far less
    # variance when the student is many nats per token from its teacher).
    advantage: str = "k1"
    # `loss`: "reverse_kl" (the advantage above, the published recipe) or
    # "topk_forward_kl": forward KL to the teacher's `top_k` most likely tokens at each
    # sampled prefix (renormalised), added to the policy loss with weight kl_coef; the
    # advantage is then the reward mix only (`advantage` is not read).
    loss: str = "reverse_kl"
    top_k: int = 20  # topk_forward_kl: teacher log-probs per token (vLLM: max_logprobs)
    kl_coef: float = 1.0
    reward_weight: float = 0.0
    max_retries: int = 2  # per trajectory; then its group fails (never the run)
    timeout_s: float = 120.0  # one scoring call
    # Cores the teacher replicas run on ([]: runtime.rollout_cpus), Ray CPUs per replica.
    teacher_cpus: list[int] = field(default_factory=list)
    teacher_num_cpus: float = 0.5
    # The embedded default's dataset: these synthetic tasks mixed (ignored when
    # data.train_files is given).
    tasks: list[SyntheticTaskConfig] = field(default_factory=list)


def route_keys(data: DataConfig, d: DistillationConfig) -> set[str] | None:
    """The values of `d.teacher_key` in the job's training data: the synthetic tasks' data
    sources (`d.tasks`), or the parquet column of `data.train_files`; None when they
    cannot be read."""
    if not data.train_files:
        if d.teacher_key != "data_source" or not d.tasks:
            return None
        from offbeat.core.tasks.visual import task_rows

        if any(t.name not in MIXABLE_TASKS for t in d.tasks):
            return None  # named by the tasks rule
        return {
            task_rows(t.name, 1, seed=0, min_len=1, max_len=1)[0]["data_source"] for t in d.tasks
        }
    import pyarrow.parquet as pq

    keys: set[str] = set()
    for f in data.train_files:
        if not Path(f).is_file():
            return None
        table = pq.read_table(f)
        if d.teacher_key not in table.column_names:
            return {"<missing column>"}
        keys.update(str(v) for v in table.column(d.teacher_key).unique().to_pylist())
    return keys


def _vocab(path: str) -> tuple[Any, Any] | None:
    """(config vocab_size, tokenizer vocab) of an HF directory; None: not a directory."""
    d = Path(path)
    if not (d / "config.json").is_file():
        return None
    size = json.loads((d / "config.json").read_text()).get("vocab_size")
    tok = None
    if (d / "tokenizer.json").is_file():
        tok = json.loads((d / "tokenizer.json").read_text()).get("model", {}).get("vocab")
    return size, tok


def _tiny_or_dir(path: str) -> str:
    # Every offbeat-tiny preset shares one character vocabulary; the tiny VLM's adds its
    # vision tokens to it (a vocabulary of its own).
    return "offbeat-tiny" if path.startswith("offbeat-tiny:") else path


def _built(path: str) -> bool:
    from offbeat.core.models.tiny_vlm import TINY_VLM_PREFIX

    return path.startswith("offbeat-tiny:") or path == TINY_VLM_PREFIX


@check
def _distillation_rules(cfg: JobConfig, p: Problems) -> None:
    d = getattr(cfg, "distillation", None)
    if d is None:
        return
    if not d.teachers:
        p.add("distillation.teachers", {}, "at least one teacher: name -> {model, replicas}")
        return
    if d.default_teacher and d.default_teacher not in d.teachers:
        p.add(
            "distillation.default_teacher", d.default_teacher, f"'' or one of {sorted(d.teachers)}"
        )
    for name, t in d.teachers.items():
        key = f"distillation.teachers.{name}"
        if not t.model:
            p.add(
                f"{key}.model",
                t.model,
                "an HF model directory, offbeat-tiny:<size> or offbeat-tiny-vl",
            )
        elif not _built(t.model) and not Path(t.model).is_dir():
            p.add(f"{key}.model", t.model, "an existing HF model directory")
        p.require_int(f"{key}.replicas", t.replicas)
        p.require_int(f"{key}.tensor_parallel_size", t.tensor_parallel_size)
        if t.sft.steps and t.sft.task:
            p.require_choice(f"{key}.sft.task", t.sft.task, MIXABLE_TASKS)
        student, teacher = _tiny_or_dir(cfg.model.path), _tiny_or_dir(t.model)
        if (student == "offbeat-tiny") != (teacher == "offbeat-tiny"):
            p.add(
                f"{key}.model",
                t.model,
                f"a model with the vocabulary of model.path={cfg.model.path}",
            )
        elif (
            student != teacher and (sv := _vocab(student)) and (tv := _vocab(teacher)) and sv != tv
        ):
            p.add(
                f"{key}.model",
                t.model,
                f"a model with the student's vocabulary (vocab_size {tv[0]} vs model.path's "
                f"{sv[0]}{'' if tv[0] != sv[0] else ', different tokens'})",
            )
    p.require_int("distillation.max_retries", d.max_retries, minimum=0)
    p.require_choice("distillation.advantage", d.advantage, ADVANTAGES)
    p.require_choice("distillation.loss", d.loss, LOSSES)
    if d.loss == "topk_forward_kl":
        p.require_int("distillation.top_k", d.top_k, minimum=1)
        if cfg.actor.engine != "fsdp2":
            p.add(
                "distillation.loss", d.loss,
                f"reverse_kl with actor.engine={cfg.actor.engine!r} (the top-k forward-KL "
                "term is built into the fsdp2 engine only)",
            )  # fmt: skip
    if d.kl_coef < 0 or d.reward_weight < 0:
        p.add("distillation.kl_coef/reward_weight", (d.kl_coef, d.reward_weight), "numbers >= 0")
    for i, t in enumerate(d.tasks):
        p.require_choice(f"distillation.tasks[{i}].name", t.name, MIXABLE_TASKS)
    keys = route_keys(cfg.data, d)
    if keys is not None and not d.default_teacher:
        orphan = sorted(keys - set(d.teachers))
        if orphan:
            p.add(
                "distillation.teachers",
                sorted(d.teachers),
                f"a teacher for every {d.teacher_key} of the dataset (no teacher for "
                f"{orphan}), or distillation.default_teacher",
            )
