"""On-policy distillation's part of the separate_async job: teachers in their own pools.

`OPDExtension` (a `JobExtension`; the opd recipe runs `run_job(cfg, [OPDExtension()])`)
builds the mixed dataset and the teachers (cached) before Ray starts, reserves one named
pool per teacher (`teacher-<name>`: a bundle per replica), starts every teacher's replicas
in their bundles from the same `rollout.engine` factory as the student's, and then: the
rollout's agent loop scores each finished group on its teacher, the trainer's batch hook
turns teacher log-probs into advantages, and validation reports reward per task. A
teacher replica that dies is replaced in its bundle (`teacher_replacements`; the scoring
calls on it retry on the replacement). At the end each teacher is validated on every
task and the summary gets the per-task table's parts and `opd.png`. Knows nothing of the
job's assembly: only what to do at each of the extension's points.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offbeat.core.config.run import RunConfig
from offbeat.core.config.schema import AlgorithmConfig
from offbeat.core.distill import config as _distill_checks  # noqa: F401  (registers its rules)
from offbeat.core.distill.advantages import (
    TEACHER_ID,
    TEACHER_LOG_PROBS,
    TEACHER_TOP_IDS,
    TEACHER_TOP_LOG_PROBS,
    opd_advantages,
    reverse_kl_by_teacher,
)
from offbeat.core.distill.config import DistillationConfig
from offbeat.core.distill.teachers import TeacherPool, TeacherRouter
from offbeat.core.train.loss import TEACHER_TOPK_IDS as TOPK_IDS
from offbeat.core.train.loss import TEACHER_TOPK_LOG_PROBS as TOPK_LOG_PROBS
from offbeat.core.trainer.extension import JobExtension

__all__ = [
    "OPDConfig",
    "OPDExtension",
    "make_batch_hook",
    "start_teachers",
    "teacher_job",
    "teacher_pool",
    "teacher_pool_specs",
    "teacher_replacements",
]


@dataclass
class OPDConfig(RunConfig):
    """A separate_async job config plus its `distillation` section."""

    distillation: DistillationConfig = field(default_factory=DistillationConfig)

    def topk_kl_coef(self) -> float:
        """`distillation.kl_coef` with `distillation.loss=topk_forward_kl`, else 0."""
        d = self.distillation
        return float(d.kl_coef) if d.loss == "topk_forward_kl" else 0.0


def teacher_job(cfg: RunConfig, d: DistillationConfig, name: str) -> RunConfig:
    """The job config a rollout-engine factory starts teacher `name`'s replicas from."""
    t = d.teachers[name]
    rt = cfg.runtime
    kwargs = dict(cfg.rollout.engine_kwargs)
    if "max_model_len" in kwargs:  # prompt + the whole response, and the one scoring token
        kwargs["max_model_len"] = int(kwargs["max_model_len"]) + 1
    if d.loss == "topk_forward_kl" and cfg.rollout.engine == "vllm" and d.top_k > 20:
        kwargs["max_logprobs"] = max(int(kwargs.get("max_logprobs", 20)), d.top_k)
    return dataclasses.replace(
        cfg,
        rollout=dataclasses.replace(
            cfg.rollout, tensor_parallel_size=t.tensor_parallel_size, engine_kwargs=kwargs
        ),
        resources=dataclasses.replace(
            cfg.resources, rollout_devices=t.replicas * t.tensor_parallel_size
        ),
        runtime=dataclasses.replace(
            rt,
            rollout_cpus=list(d.teacher_cpus or rt.rollout_cpus),
            rollout_num_cpus=d.teacher_num_cpus,
        ),
    )


def teacher_pool(name: str) -> str:
    """The named resource pool teacher `name`'s replicas run in."""
    return f"teacher-{name}"


def teacher_pool_specs(cfg: RunConfig, d: DistillationConfig) -> list[Any]:
    """One named pool per teacher: a bundle per replica of `tensor_parallel_size` devices,
    `distillation.teacher_num_cpus` CPUs and the rollout pool's extra Ray resources."""
    from offbeat.core.runtime.pools import DEVICE_RESOURCES, PoolSpec

    out = []
    for name, t in d.teachers.items():
        bundle = {"CPU": float(d.teacher_num_cpus)}
        if cfg.resources.device in DEVICE_RESOURCES:
            bundle[DEVICE_RESOURCES[cfg.resources.device]] = float(t.tensor_parallel_size)
        bundle.update({k: float(v) for k, v in cfg.runtime.rollout_resources.items()})
        out.append(PoolSpec(teacher_pool(name), t.replicas, {k: v for k, v in bundle.items() if v}))
    return out


def start_teachers(
    cfg: RunConfig, d: DistillationConfig, model_dirs: dict[str, Path], pools: Any = None
) -> dict[str, dict[str, Any]]:
    """{teacher: {server_id: server}}: every teacher's replicas (not awaited), each in its
    bundle of the teacher's named pool when `pools` has one."""
    from offbeat.core.rollout.replica_spec import ReplicaSpec, start_replica

    out: dict[str, dict[str, Any]] = {}
    for name, t in d.teachers.items():
        job = teacher_job(cfg, d, name)
        out[name] = {}
        for i in range(t.replicas):
            opts = {}
            if pools is not None and teacher_pool(name) in pools.groups:
                opts["scheduling_strategy"] = pools.strategy(teacher_pool(name), i)
            spec = ReplicaSpec(job, str(model_dirs[name]), i, ray_options=opts)
            out[name][f"{name}-{i}"] = start_replica(spec)
    return out


def teacher_replacements(
    cfg: RunConfig, d: DistillationConfig, model_dirs: dict[str, Path], pools: Any = None
) -> dict[str, Any]:
    """{teacher: Replacement}: a dead replica `<name>-<i>` of a teacher is replaced by one
    started as `start_teachers` starts it, in its bundle; {} when
    `runtime.replica_replace_attempts` is 0."""
    from offbeat.core.rollout.replica_spec import ReplicaSpec
    from offbeat.core.trainer.elastic import bundle_replacement

    if cfg.runtime.replica_replace_attempts <= 0:
        return {}
    out = {}
    for name, t in d.teachers.items():
        job = teacher_job(cfg, d, name)
        placed = pools is not None and teacher_pool(name) in pools.groups

        def spec(i: int, new_id: str, job: RunConfig = job, name: str = name, placed=placed) -> Any:
            opts = {"scheduling_strategy": pools.strategy(teacher_pool(name), i)} if placed else {}
            return ReplicaSpec(job, str(model_dirs[name]), i, server_id=new_id, ray_options=opts)

        slots = {f"{name}-{i}": i for i in range(t.replicas)}
        out[name] = bundle_replacement(spec, slots, cfg.runtime)
    return out


def make_batch_hook(
    d: DistillationConfig, router: TeacherRouter, pool: TeacherPool, algorithm: AlgorithmConfig
):
    """The trainer's batch hook: OPD advantages in place of the reward's, and per-teacher
    reverse KL, tokens, routed groups and scoring latency."""

    topk = d.loss == "topk_forward_kl"

    def hook(batch: Any, data: dict[str, Any]) -> dict[str, float]:
        teacher_lp = batch.extras[TEACHER_LOG_PROBS]
        data["advantages"] = opd_advantages(
            data["rollout_log_probs"], teacher_lp, data["response_mask"],
            kl_coef=0.0 if topk else d.kl_coef,  # top-k: the engine's loss term carries it
            rewards=batch.rewards, group_uids=batch.group_uids, reward_weight=d.reward_weight,
            norm_by_std=algorithm.norm_adv_by_std_in_grpo, mode=d.advantage,
        )  # fmt: skip
        if topk:  # [B, R, k]: the train engine's forward-KL term reads them
            data[TOPK_IDS] = batch.extras[TEACHER_TOP_IDS].round().long()
            data[TOPK_LOG_PROBS] = batch.extras[TEACHER_TOP_LOG_PROBS]
        metrics = reverse_kl_by_teacher(
            data["rollout_log_probs"], teacher_lp, data["response_mask"],
            batch.extras[TEACHER_ID], router.names,
        )  # fmt: skip
        metrics.update(pool.drain_metrics())
        for name in router.names:
            metrics[f"distill/{name}/routed_groups_total"] = float(router.counts.get(name, 0))
        return metrics

    return hook


async def _evaluate_teachers(agent: Any, pool: TeacherPool, rows: list, d: DistillationConfig):
    """{teacher: per-task validation metrics} of every teacher on every task."""
    from offbeat.core.distill.validation import PerTaskValidator
    from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
    from offbeat.core.trainer.agent_loop import SingleTurnAgentLoop

    agent = agent.loop() if hasattr(agent, "loop") else agent  # a router: its default loop
    out = {}
    for name, balancer in pool.balancers.items():
        client = PartialRolloutClient(
            balancer, PartialRolloutConfig(max_tokens=agent.sampling["max_tokens"])
        )
        processor = getattr(agent, "processor", None)  # a VLM's: rows with images
        loop = SingleTurnAgentLoop(
            client, agent.tokenizer, agent.rewards, agent.sampling, prompt_key=agent.prompt_key,
            **({"processor": processor} if processor is not None else {}),
        )  # fmt: skip
        out[name] = await PerTaskValidator(loop, rows, task_key=d.teacher_key).run(f"t-{name}")
    return out


class OPDExtension(JobExtension):
    """The teachers of `distillation` (an `OPDConfig`), from their build to their report."""

    def __init__(self) -> None:
        self.d: DistillationConfig | None = None
        self.teacher_dirs: dict[str, Path] = {}
        self.teachers: dict[str, dict[str, Any]] = {}  # teacher -> {server_id: server}
        self.router: TeacherRouter | None = None
        self.pool: TeacherPool | None = None
        self._batch_hook: Any = None
        self.validator: Any = None  # the student's PerTaskValidator
        self.val_agent: Any = None  # what it samples with (the teachers' validation reuses it)
        self.val_files: list[str] = []

    def configure(self, cfg: OPDConfig) -> OPDConfig:
        """The mixed task files (when no dataset is given) and the teachers, built or read
        from the cache before anything is pinned, so a cold start spreads them over the
        machine's cores."""
        from offbeat.core.distill.build import build_teachers, write_mixed_task_files
        from offbeat.core.models import cache_root

        d, cache = cfg.distillation, cache_root()
        if not cfg.data.train_files and d.tasks:
            train, val = write_mixed_task_files(list(d.tasks), cache / "tasks")
            data = dataclasses.replace(cfg.data, train_files=train, val_files=val)
            cfg = dataclasses.replace(cfg, data=data)
        self.teacher_dirs = build_teachers(dict(d.teachers), cache, prompt_key=cfg.data.prompt_key)
        return cfg

    def pools(self, cfg: OPDConfig) -> list[Any]:
        return teacher_pool_specs(cfg, cfg.distillation)

    def start_replicas(self, cfg: OPDConfig, pools: Any) -> dict[str, Any]:
        self.teachers = start_teachers(cfg, cfg.distillation, self.teacher_dirs, pools)
        return {k: v for servers in self.teachers.values() for k, v in servers.items()}

    async def setup(self, prepared: Any, pools: Any) -> None:
        cfg = prepared.cfg
        d = self.d = cfg.distillation
        self.val_files = list(prepared.val_files)
        await asyncio.gather(*(s.refresh() for t in self.teachers.values() for s in t.values()))
        self.router = TeacherRouter(list(d.teachers), teacher_key=d.teacher_key,
                                    default=d.default_teacher)  # fmt: skip
        self.pool = TeacherPool(
            self.teachers, max_retries=d.max_retries, timeout_s=d.timeout_s,
            replacements=teacher_replacements(cfg, d, self.teacher_dirs, pools),
        )  # fmt: skip
        self._batch_hook = make_batch_hook(d, self.router, self.pool, cfg.algorithm)

    def wrap_agent(self, agent: Any) -> Any:
        from offbeat.core.distill.agent_loop import DistillAgentLoop

        d = self.d
        top_k = d.top_k if d.loss == "topk_forward_kl" else 0
        return DistillAgentLoop(agent, self.router, self.pool, top_k=top_k)

    def make_validator(self, cfg: OPDConfig, agent: Any, rows: list) -> Any:
        from offbeat.core.distill.validation import PerTaskValidator

        self.val_agent = agent
        self.validator = PerTaskValidator(
            agent, rows, task_key=self.d.teacher_key, max_concurrency=cfg.data.val_batch_size
        )
        return self.validator

    def batch_hook(self, batch: Any, data: dict[str, Any]) -> dict[str, float]:
        return self._batch_hook(batch, data)

    async def report(self, summary: dict[str, Any]) -> None:
        """Every teacher validated on every task; the student's per-task history, the
        routing counts, each teacher's replicas and `opd.png`."""
        from offbeat.core.distill.report import plot_opd
        from offbeat.core.tasks import read_parquet

        d = self.d
        rows = [r for f in self.val_files for r in read_parquet(f)]
        summary["teacher_val"] = await _evaluate_teachers(self.val_agent, self.pool, rows, d)
        summary["student_val"] = self.validator.history
        summary["routed"] = dict(self.router.counts)
        summary["teachers"] = self.pool.summary()  # removed, replaced, given up (per teacher)
        history = summary["trainer"].tracker.history
        per_task = (k for r in history for k in r if k.startswith("val/") and k.count("/") == 2)
        tasks = {k.split("/")[1] for k in per_task}  # val/<task>/<metric>
        routes = {t: t if t in d.teachers else d.default_teacher for t in sorted(tasks)}
        path = Path(summary["run_dir"]) / "opd.png"
        summary["routes"] = routes
        summary["opd_plot"] = str(plot_opd(history, summary["teacher_val"], routes, path))

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()

    def replacements(self) -> dict[str, Any]:
        return dict(self.pool.started) if self.pool is not None else {}
