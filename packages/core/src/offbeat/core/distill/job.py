"""An on-policy distillation job: separate_async with teachers in their own pools.

`run_opd(cfg)` builds the mixed dataset and the teachers (cached), reserves the job's
resource pools plus one named pool per teacher (`teacher-<name>`: a bundle per replica),
starts the student's rollout replicas and every teacher's replicas in their bundles from
the same `rollout.engine` factory, and runs the separate_async job with three hooks: the rollout's agent loop scores each finished group
on its teacher, the trainer's batch hook turns teacher log-probs into advantages, and
validation reports reward per task. A teacher replica that dies is replaced in its
bundle (`teacher_replacements`; the scoring calls on it retry on the replacement). At the
end each teacher is validated on every task.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from offbeat.core.trainer.job import RunConfig

__all__ = [
    "OPDConfig",
    "make_batch_hook",
    "run_opd",
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

        def spec(i: int, new_id: str, job: Any = job, name: str = name, placed=placed) -> Any:
            opts = {"scheduling_strategy": pools.strategy(teacher_pool(name), i)} if placed else {}
            return ReplicaSpec(job, str(model_dirs[name]), i, server_id=new_id, ray_options=opts)

        slots = {f"{name}-{i}": i for i in range(t.replicas)}
        out[name] = bundle_replacement(spec, slots, cfg.runtime)
    return out


def make_batch_hook(d: DistillationConfig, router: TeacherRouter, pool: TeacherPool, s: Any):
    """The trainer's batch hook: OPD advantages in place of the reward's, and per-teacher
    reverse KL, tokens, routed groups and scoring latency."""

    topk = d.loss == "topk_forward_kl"

    def hook(batch: Any, data: dict[str, Any]) -> dict[str, float]:
        teacher_lp = batch.extras[TEACHER_LOG_PROBS]
        data["advantages"] = opd_advantages(
            data["rollout_log_probs"], teacher_lp, data["response_mask"],
            kl_coef=0.0 if topk else d.kl_coef,  # top-k: the engine's loss term carries it
            rewards=batch.rewards, group_uids=batch.group_uids, reward_weight=d.reward_weight,
            norm_by_std=s.norm_adv_by_std_in_grpo, mode=d.advantage,
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


async def run_opd(cfg: OPDConfig) -> dict[str, Any]:
    """Run `cfg` (validated) to the end; shut every replica down after."""
    from offbeat.core.distill.agent_loop import DistillAgentLoop
    from offbeat.core.distill.build import build_teachers, write_mixed_task_files
    from offbeat.core.distill.report import plot_opd
    from offbeat.core.distill.validation import PerTaskValidator
    from offbeat.core.runtime.launch import start_pools
    from offbeat.core.tasks import read_parquet
    from offbeat.core.trainer.job import (
        JobHooks,
        announce_logs,
        init_ray,
        pin_trainer,
        prepare,
        run_with_replicas,
        shutdown_replicas,
        split_gpus,
        start_replicas,
    )  # fmt: skip
    from offbeat.core.trainer.trainer import TrainerSettings

    t0 = time.perf_counter()
    d = cfg.distillation
    from offbeat.core.models import cache_root

    cache = cache_root()
    if not cfg.data.train_files and d.tasks:
        train, val = write_mixed_task_files(list(d.tasks), cache / "tasks")
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, train_files=train, val_files=val)
        )
    # Teachers built (or read from the cache) before anything is pinned, side by side, so
    # a cold start spreads them over the machine's cores.
    teacher_dirs = await asyncio.to_thread(
        build_teachers, dict(d.teachers), cache, prompt_key=cfg.data.prompt_key
    )
    init_ray(cfg.runtime, num_gpus=split_gpus(cfg), log_to_driver=cfg.trainer.verbose)
    announce_logs(cfg)
    pin_trainer(cfg.runtime)
    p = await asyncio.to_thread(prepare, cfg)
    pools = await start_pools(p.cfg, teacher_pool_specs(p.cfg, d))
    servers = start_replicas(p, pools)
    teacher_servers = start_teachers(p.cfg, d, teacher_dirs, pools)
    everything = {**servers, **{k: v for s in teacher_servers.values() for k, v in s.items()}}
    pool = None
    try:
        await asyncio.gather(*(s.refresh() for t in teacher_servers.values() for s in t.values()))
        router = TeacherRouter(
            list(d.teachers), teacher_key=d.teacher_key, default=d.default_teacher
        )
        pool = TeacherPool(
            teacher_servers, max_retries=d.max_retries, timeout_s=d.timeout_s,
            replacements=teacher_replacements(p.cfg, d, teacher_dirs, pools),
        )  # fmt: skip
        settings = TrainerSettings.from_job(p.cfg)
        validators: list[PerTaskValidator] = []

        def make_validator(job: Any, agent: Any, rows: list) -> PerTaskValidator:
            v = PerTaskValidator(
                agent, rows, task_key=d.teacher_key, max_concurrency=job.data.val_batch_size
            )
            validators.append(v)
            agents.append(agent)
            return v

        agents: list[Any] = []
        hooks = JobHooks(
            wrap_agent=lambda agent: DistillAgentLoop(
                agent, router, pool, top_k=d.top_k if d.loss == "topk_forward_kl" else 0
            ),
            batch_hook=make_batch_hook(d, router, pool, settings),
            make_validator=make_validator,
        )
        summary = await run_with_replicas(p, servers, version_offset=0, pools=pools, hooks=hooks)
        val_rows = [r for f in p.val_files for r in read_parquet(f)]
        summary["teacher_val"] = await _evaluate_teachers(agents[0], pool, val_rows, d)
        summary["student_val"] = validators[0].history
        summary["routed"] = dict(router.counts)
        summary["teachers"] = pool.summary()  # removed, replaced, given up (per teacher)
    finally:
        if pool is not None:
            await pool.close()
            everything.update(pool.started)  # the replacements it started
        await shutdown_replicas(everything)
        pools.remove()
    history = summary["trainer"].tracker.history
    tasks = {
        k.split("/")[1] for r in history for k in r if k.startswith("val/") and k.count("/") == 2
    }
    summary["routes"] = {t: t if t in d.teachers else d.default_teacher for t in sorted(tasks)}
    path = Path(summary["run_dir"]) / "opd.png"
    summary["opd_plot"] = str(plot_opd(history, summary["teacher_val"], summary["routes"], path))
    summary["total_wall_s"] = time.perf_counter() - t0
    return summary
