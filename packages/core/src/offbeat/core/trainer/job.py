"""Assemble and run a whole job from its config, top to bottom: prepare → pools →
replicas (two-phase when hybrid) → trainer side → rollout side → loop → report. Each step
is a function of the module that owns it; this module only composes them.

Knows no engine by name: rollout replicas come from the factory registered in
`ROLLOUT_ENGINES` under `rollout.engine` (offbeat.rollout_vllm provides "vllm"; a recipe
may register it), the train engine from `TRAIN_ENGINES` under `actor.engine` (and the
critic under `critic.engine`, the reference model under `actor.engine`, when needed).

Knows no recipe and no reward by name: a recipe changes the job through `JobExtension`s
(`offbeat.core.trainer.extension`) it passes to `run_job`, and a reward that needs more than
a scorer declares its extension in `REWARD_EXTENSIONS`, which `run_job` asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

from offbeat.core.config.run import RunConfig
from offbeat.core.data.vision import load_tokenizer
from offbeat.core.rewards import checks as _reward_checks  # noqa: F401  (registers its rules)
from offbeat.core.rollout import record_checks as _record_checks  # noqa: F401  (its rules)
from offbeat.core.runtime import checks as _runtime_checks  # noqa: F401  (registers its rules)
from offbeat.core.runtime.host import announce_logs, init_ray, pin_trainer, split_gpus
from offbeat.core.runtime.launch import start_pools, start_trainer_side
from offbeat.core.tasks import checks as _prompt_checks  # noqa: F401  (registers its rules)
from offbeat.core.trainer import extension as ext
from offbeat.core.trainer import runtime_checks  # noqa: F401  (registers its rules)
from offbeat.core.trainer.elastic import JobReplicas, await_replicas, start_job_replicas
from offbeat.core.trainer.extension import JobExtension
from offbeat.core.trainer.loop import build_loop
from offbeat.core.trainer.prepare import Prepared, prepare, run_header
from offbeat.core.trainer.report import job_summary
from offbeat.core.trainer.rollout_side import start_rollout_side

__all__ = ["run_job", "run_with_replicas"]


async def run_job(cfg: RunConfig, extensions: Sequence[JobExtension] = ()) -> dict[str, Any]:
    """Run `cfg` (already validated) to the end on fresh replicas, extended by
    `extensions` and then by the one `reward.name` declares; shut every replica down after
    (the extensions' too)."""
    t0 = time.perf_counter()
    exts = [*extensions, *ext.reward_extensions(cfg)]
    cfg = await asyncio.to_thread(ext.configure, cfg, exts)  # builds, before Ray and pinning
    init_ray(cfg.runtime, num_gpus=split_gpus(cfg), log_to_driver=cfg.trainer.verbose)
    logs = announce_logs(cfg)
    pin_trainer(cfg.runtime)
    p = await asyncio.to_thread(prepare, cfg)  # the replicas load the prepared model
    pools = await start_pools(p.cfg, extra=ext.extra_pools(p.cfg, exts))
    replicas = JobReplicas()
    try:
        side = await start_job_replicas(p, pools, exts, replicas)  # the trainer, when hybrid
        summary = await run_with_replicas(
            p, replicas.servers, version_offset=0, pools=pools, side=side,
            hybrids=replicas.hybrids, extensions=exts,
        )  # fmt: skip
    finally:
        await replicas.shutdown()
        pools.remove()
    summary.update(total_wall_s=time.perf_counter() - t0, start_order=replicas.order)
    summary["logs"] = str(logs) if logs is not None else None
    return summary


async def run_with_replicas(
    p: Prepared,
    servers: dict[str, Any],
    *,
    version_offset: int | None = None,
    pools: Any = None,
    side: Any = None,
    hybrids: dict[str, Any] | None = None,
    extensions: Sequence[JobExtension] = (),
) -> dict[str, Any]:
    """Build the trainer side around running `servers` and train to the end; then each of
    `extensions` reports into the summary, and all of them close (also on failure).

    `version_offset=None` reads the version the replicas hold (0 for fresh ones). A trainer
    group goes into `pools`' trainer pool, or into a pool of its own made here. `side`: a
    trainer already built (a two-phase start: `run_job`), closed here at the end;
    `hybrids`: its hybrid replicas, asleep. The extensions' replicas, if any, were started
    by the caller (`run_job`); here they are set up once `servers` answer."""
    exts = list(extensions)
    try:
        summary = await _train(p, servers, version_offset, pools, side, hybrids, exts)
        for e in exts:
            await e.report(summary)
    finally:
        await ext.close_extensions(exts)
    return summary


async def _train(
    p: Prepared,
    servers: dict[str, Any],
    version_offset: int | None,
    pools: Any,
    side: Any,
    hybrids: dict[str, Any] | None,
    exts: list[JobExtension],
) -> dict[str, Any]:
    t0 = time.perf_counter()
    async with contextlib.AsyncExitStack() as done:  # closes what was built, the last first
        if side is None:  # the train engine builds while the replicas start
            side, pools, own_pools = await start_trainer_side(p.cfg, pools)
            if own_pools is not None:
                done.callback(own_pools.remove)
        done.push_async_callback(side.close)
        tokenizer, processor = load_tokenizer(p.model_dir, p.cfg.model)
        version_offset = await await_replicas(servers, version_offset)
        for e in exts:
            await e.setup(p, pools)
        ready_s = time.perf_counter() - t0
        rollout = await start_rollout_side(
            p, servers, pools=pools, side=side, hybrids=hybrids, extensions=exts,
            tokenizer=tokenizer, processor=processor, version_offset=version_offset,
        )  # fmt: skip
        done.push_async_callback(rollout.close)
        loop = build_loop(
            p, side, rollout, exts,
            pad_token_id=tokenizer.pad_token_id or 0, version_offset=version_offset,
        )  # fmt: skip
        done.push_async_callback(loop.close)
        header = run_header(p, len(servers), ready_s) + "".join(f"; {n}" for n in rollout.notes)
        summary = await loop.run(header)
    return job_summary(summary, loop, rollout, startup_s=p.setup_s + ready_s)
