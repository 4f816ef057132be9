"""Judge replicas for GenRM: where they are started, and the transport that routes judge
calls to them through offbeat's own LoadBalancer.

Knows how to start judge replicas from the `rollout.engine` registry entry with a job
config of their own (`judge_job`) in a named resource pool of their own (`judge_pools`), how
to call a replica handle (`handle.generate`, a Ray actor's `.remote` or a plain
coroutine), and the trainer step hook that logs the judge's metrics. Judges never get
weight syncs: nothing here hands them to the checkpoint engine. Knows nothing else of the
trainer; a replica that fails a call and does not answer a probe is removed from the
balancer and replaced in its bundle (`judge_replacement`); the retry goes to another
replica, or waits for the replacement.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offbeat.core.rewards.genrm import GenRMConfig

if TYPE_CHECKING:
    from offbeat.core.config.run import RunConfig
    from offbeat.core.config.schema import JobConfig


def judge_job(cfg: RunConfig) -> RunConfig:
    """The job config a rollout-engine factory starts judge replicas from: the judge's
    model (no policy overrides), `reward.genrm.engine_kwargs` over the rollout's,
    `replicas` x `tensor_parallel_size` devices, `judge_cpus` (default: the rollout's
    cores, shared) and `judge_num_cpus` Ray CPUs per replica."""
    g = GenRMConfig(**dict(cfg.reward.genrm or {}))
    rt = cfg.runtime
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            cfg.model, path=g.model_path, override_config={}, tokenizer_path=""
        ),
        rollout=dataclasses.replace(
            cfg.rollout,
            tensor_parallel_size=g.tensor_parallel_size,
            engine_kwargs={**cfg.rollout.engine_kwargs, **dict(g.engine_kwargs)},
        ),
        resources=dataclasses.replace(
            cfg.resources, rollout_devices=g.replicas * g.tensor_parallel_size
        ),
        runtime=dataclasses.replace(
            rt,
            rollout_cpus=list(g.judge_cpus or rt.rollout_cpus),
            rollout_num_cpus=g.judge_num_cpus,
        ),
    )


def resolve_judge_model(cfg: RunConfig, cache_dir: str | Path) -> RunConfig:
    """`cfg` with `reward.genrm.model_path` a local directory (`offbeat-tiny:<size>` is built,
    untrained, under `cache_dir`); unchanged when it names none. Blocking: file I/O."""
    raw = dict(cfg.reward.genrm or {})
    path = str(raw.get("model_path") or "")
    if not path.startswith("offbeat-tiny:"):
        return cfg
    from offbeat.core.models.resolve import resolve_model

    raw["model_path"] = str(resolve_model(path, Path(cache_dir) / "models"))
    return dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, genrm=raw))


def judge_pools(cfg: RunConfig) -> list[Any]:
    """The named resource pool the judge replicas go into (`start_pools(cfg, extra=...)`):
    "judge", one bundle per replica shaped as a rollout replica's of `judge_job` (its
    devices, `judge_num_cpus` CPUs); [] when no judge replica is asked for."""
    from offbeat.core.runtime.pools import PoolSpec, pool_specs

    n = int(dict(cfg.reward.genrm or {}).get("replicas", 0))
    if cfg.reward.name != "genrm" or n <= 0:
        return []
    (spec,) = [s for s in pool_specs(judge_job(cfg), trainer=False) if s.name == "rollout"]
    return [PoolSpec("judge", spec.bundles, spec.bundle)]


def _judge_options(pools: Any, i: int) -> dict[str, Any]:
    """Judge replica i's bundle of `pools`' "judge" pool (none without that pool)."""
    if pools is not None and "judge" in pools.groups:
        return {"scheduling_strategy": pools.strategy("judge", i)}
    return {}


def start_judges(cfg: RunConfig, pools: Any = None) -> dict[str, Any]:
    """Start the `reward.genrm.replicas` judge replicas of `reward.genrm.model_path` (a
    directory: `resolve_judge_model` first) from the `rollout.engine` factory, not awaited,
    each in its bundle of `pools`' "judge" pool when there is one (`judge_pools`); {} when
    none are asked for or reward.name is not genrm. They are never handed to the
    checkpoint engine: no weight syncs."""
    from offbeat.core.rollout.replica_spec import ReplicaSpec, start_replica

    n = int(dict(cfg.reward.genrm or {}).get("replicas", 0))
    if cfg.reward.name != "genrm" or n <= 0:
        return {}
    job = judge_job(cfg)
    return {
        f"judge-{i}": start_replica(
            ReplicaSpec(job, job.model.path, i, ray_options=_judge_options(pools, i))
        )
        for i in range(n)
    }


def judge_replacement(cfg: RunConfig, pools: Any = None) -> Any:
    """How a dead judge replica `judge-<i>` is replaced: one started as `start_judges`
    starts it, in its bundle (`offbeat.core.trainer.elastic.bundle_replacement`); None
    when `runtime.replica_replace_attempts` is 0 or no judge replica is asked for."""
    from offbeat.core.rollout.replica_spec import ReplicaSpec
    from offbeat.core.trainer.elastic import bundle_replacement

    n = int(dict(cfg.reward.genrm or {}).get("replicas", 0))
    if cfg.reward.name != "genrm" or n <= 0 or cfg.runtime.replica_replace_attempts <= 0:
        return None
    job = judge_job(cfg)

    def spec(i: int, new_id: str) -> Any:
        return ReplicaSpec(
            job, job.model.path, i, server_id=new_id, ray_options=_judge_options(pools, i)
        )

    return bundle_replacement(spec, {f"judge-{i}": i for i in range(n)}, cfg.runtime)


class BalancedJudgeTransport:
    """A `Post` for `GenRMJudge` (its url argument is ignored): tokenises the prompt with
    the judge tokenizer, leases a replica from the balancer (waiting for one: the judge's
    per-call timeout bounds it), generates, detokenises. A replica a call failed on (or
    timed out on) is probed and, when it does not answer, removed and, with a
    `replacement`, replaced (`FixedReplicas`); `settle()` waits until a replica serves or
    none is on its way (the judge awaits it before a retry)."""

    def __init__(self, servers: Mapping[str, Any], tokenizer: Any, cfg: GenRMConfig, *,
                 replacement: Any = None, health_timeout_s: float = 30.0) -> None:  # fmt: skip
        from offbeat.balancer.aio import AsyncLoadBalancer
        from offbeat.core.trainer.fixed_replicas import FixedReplicas

        self.balancer = AsyncLoadBalancer(dict(servers))
        self.replicas = FixedReplicas(
            servers, self.balancer, replacement=replacement,
            health_timeout_s=health_timeout_s, kind="judge",
        )  # fmt: skip
        self.handles = self.replicas.servers  # the live ones, replacements included
        self.tokenizer, self.cfg = tokenizer, cfg
        self._ids = itertools.count()
        self._checks: set[asyncio.Task] = set()
        self.served: dict[str, int] = {}  # replica -> calls it answered

    @property
    def removed(self) -> list[str]:
        return list(self.replicas.removed)

    @property
    def replaced(self) -> dict[str, str]:
        return dict(self.replicas.replaced)

    async def __call__(self, url: str, payload: dict, timeout: float) -> dict:
        rid = f"judge-{next(self._ids)}"
        prompt_ids = self.tokenizer.encode(payload["prompt"], add_special_tokens=False)
        params = {"max_tokens": payload["max_tokens"], "temperature": 0.0}
        lease = await self.balancer.acquire(rid)
        sid = lease.server_id
        try:
            generate = self.handles[sid].generate
            if hasattr(generate, "remote"):  # a Ray actor handle
                out = await generate.remote(rid, prompt_ids, params)
            else:
                out = await generate(rid, prompt_ids, params)
        except asyncio.CancelledError:  # the judge's timeout: is the replica still there?
            task = asyncio.ensure_future(self.replicas.failed(sid, TimeoutError(rid)))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)
            raise
        except Exception as e:  # a dead replica, or this call's own error: the probe says
            await self.replicas.failed(sid, e)
            raise
        finally:
            self.balancer.release(lease)
        self.served[sid] = self.served.get(sid, 0) + 1
        text = self.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
        return {"choices": [{"text": text}]}

    async def settle(self) -> bool:
        """Until a replica serves or none is being started; True when one serves."""
        return await self.replicas.wait_available()

    async def close(self) -> None:
        for t in list(self._checks):
            t.cancel()
        await self.replicas.close()


def judge_tokenizer(cfg: JobConfig) -> Any:
    """The judge's tokenizer (its chat template renders the prompt), or None without a
    resolved `reward.genrm.model_path`. Blocking: call it off the event loop."""
    path = str(dict(cfg.reward.genrm or {}).get("model_path") or "")
    if not path or not Path(path).is_dir():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def setup_judge(cfg: JobConfig, servers: Mapping[str, Any] | None = None, *, post: Any = None,
                tokenizer: Any = None, replacement: Any = None) -> Any:  # fmt: skip
    """On the job's event loop (`start_judge`, from `GenRMExtension.setup`): build the
    `GenRMJudge` that `reward.genrm` describes (over `servers` from `start_judges`, dead
    ones replaced by `replacement`, else the url), install it for the registry's `genrm`
    scorer and return it (`GenRMStepHook` calls `judge.new_step()` per step and logs
    `judge.metrics()`). None unless reward.name=genrm."""
    from offbeat.core.rewards import genrm

    if cfg.reward.name != "genrm":
        return None
    gcfg = genrm.from_config(cfg.reward.genrm or {})
    if servers:
        transport = BalancedJudgeTransport(servers, tokenizer, gcfg, replacement=replacement)
        judge = genrm.GenRMJudge(gcfg, post=transport, tokenizer=tokenizer, urls=["balancer"])
    else:
        judge = genrm.GenRMJudge(gcfg, post=post or genrm.aiohttp_post, tokenizer=tokenizer)
    genrm.install(judge)
    return judge


class GenRMStepHook:
    """A trainer step hook: each step logs the judge's metrics of the responses scored
    since the last step (plus run totals) and starts the judge's next step (its cache);
    at the end the judge is uninstalled."""

    COUNTS = ("judgments", "parse_failures", "cache_hits", "errors")

    def __init__(self, judge: Any) -> None:
        self.judge = judge
        self.totals = dict.fromkeys(self.COUNTS, 0)

    def after_step(self, step: int, groups: list[Any], batch: Any, metrics: dict) -> None:
        m = self.judge.metrics()
        for k in self.COUNTS:
            self.totals[k] += int(m[f"genrm/{k}"])
            m[f"genrm/{k}_total"] = float(self.totals[k])
        m["genrm/replicas_removed"] = float(len(self.judge.removed_replicas))
        m["genrm/replicas_replaced"] = float(len(self.judge.replaced_replicas))
        metrics.update(m)
        self.judge.new_step()

    async def close(self) -> None:
        """Uninstall the judge and stop the replacements being started. Idempotent. The
        ones started are `replacements()`: the job shuts them down after its extensions
        close (`JobExtension.replacements`), as it does the judges it started."""
        from offbeat.core.rewards import genrm

        genrm.install(None)
        transport = self.judge._post
        if isinstance(transport, BalancedJudgeTransport):
            await transport.close()

    def replacements(self) -> dict[str, Any]:
        """{server_id: replica} started in place of dead judges."""
        transport = self.judge._post
        if isinstance(transport, BalancedJudgeTransport):
            return dict(transport.replicas.started)
        return {}

    def summary(self) -> dict[str, Any]:
        return {**self.totals, "removed_replicas": self.judge.removed_replicas,
                "replaced_replicas": self.judge.replaced_replicas,
                "served_by_replica": dict(getattr(self.judge._post, "served", {}))}  # fmt: skip


async def start_judge(cfg: RunConfig, judges: dict[str, Any], pools: Any = None) -> Any:
    """For `reward.name=genrm`: the judge over `judges` (else `reward.genrm.url`), installed
    for the `genrm` scorer, as the trainer step hook that logs its metrics; else None. A
    dead judge replica is replaced in its bundle of `pools` (`judge_replacement`)."""
    if cfg.reward.name != "genrm":
        return None
    tokenizer = await asyncio.to_thread(judge_tokenizer, cfg)
    await asyncio.gather(*(j.refresh() for j in judges.values() if hasattr(j, "refresh")))
    replacement = judge_replacement(cfg, pools) if judges else None
    return GenRMStepHook(setup_judge(cfg, judges, tokenizer=tokenizer, replacement=replacement))


def validation_agent(cfg: JobConfig, agent: Any) -> Any:
    """The agent validation samples with: `agent` itself, or with `reward.genrm.val_reward
    = task` one that scores each row by its data_source's rule (not the judge): a router
    (`build_agent`) over copies of its loops, or a copy of a single loop."""
    if cfg.reward.name != "genrm" or (cfg.reward.genrm or {}).get("val_reward") != "task":
        return agent
    import copy

    from offbeat.core.rewards import RewardRegistry

    rule = RewardRegistry(
        cfg.reward.functions, kwargs=cfg.reward.kwargs, timeout_s=cfg.reward.timeout_s
    )

    def by_rule(loop: Any) -> Any:
        out = copy.copy(loop)  # shares the client, tokenizer and scoring threads
        out.rewards = rule
        return out

    if not hasattr(agent, "loop"):
        return by_rule(agent)
    from offbeat.core.agent.loops import AgentLoopRouter

    return AgentLoopRouter(lambda name: by_rule(agent.loop(name)), agent.default, key=agent.key)
