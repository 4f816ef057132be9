"""What a job starts from `resources`: its resource pools, and the trainer on them.

`start_pools` reserves the trainer pool (one bundle per rank) and the rollout pool (one
bundle per replica), plus any named pools a recipe declares. `start_trainer` returns the
`TrainerGroup` the loop drives and the `GroupCheckpointEngine` that syncs its weights
from rank 0. One trainer shape: with the trainer in the driver (one rank on a local Ray,
the cheapest path) the group is one rank in this process (`TrainerGroup.start_local`: no
actor, no pool bundle); otherwise `resources.trainer_devices` rank actors on the trainer
pool. When the job has a critic and/or a reference policy placed with the actor
(`critic.placement=actor`, `ref.placement=actor`), the group's ranks build them too, and
the side carries their engine-shaped proxies (`engines.py`). Placed `separate`, each is a
`TrainerGroup` of its own (ranks of that one role, their own process group) on the pool
named after its role.

Knows the job config's resource and runtime keys, the pools and the group; nothing of
the rollout engines or the training loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from offbeat.core.runtime.engines import GroupCriticEngine, GroupReferenceEngine
from offbeat.core.runtime.group import TrainerGroup
from offbeat.core.runtime.pools import DEVICE_RESOURCES, PoolSpec, ResourcePools, pool_specs

if TYPE_CHECKING:
    from offbeat.core.config.run import RunConfig
    from offbeat.core.config.schema import JobConfig, TrainerConfig

__all__ = [
    "HYBRID_DEVICE_SHARE",
    "TrainerSide",
    "call_timeout_s",
    "group_roles",
    "hybrid_options",
    "hybrid_replicas",
    "replica_options",
    "start_pools",
    "start_trainer",
    "start_trainer_side",
    "trainer_in_driver",
]


def trainer_in_driver(cfg: RunConfig) -> bool:
    """`runtime.trainer_in_driver`, or when null: one trainer rank on a local one-node Ray
    runs in the driver (no actor, no pool bundle) unless hybrid replicas need the trainer
    pool or a critic / reference model runs in a worker group of its own; anything else
    is a worker group."""
    from offbeat.core.config.support import separate_groups

    rt, r = cfg.runtime, cfg.resources
    if rt.trainer_in_driver is not None:
        return bool(rt.trainer_in_driver)
    if hybrid_replicas(cfg) or separate_groups(cfg):
        return False
    return r.trainer_devices == 1 and r.num_nodes == 1 and not rt.ray_address


def hybrid_replicas(cfg: JobConfig) -> bool:
    """Whether the job runs hybrid replicas (`trainer.validate_on_trainer_devices`)."""
    return bool(getattr(getattr(cfg, "trainer", None), "validate_on_trainer_devices", False))


def group_roles(cfg: JobConfig) -> tuple[str, ...]:
    """The engines each rank of the trainer's worker group builds: the actor, plus the
    critic when the advantage estimator needs one and the reference policy when a KL term
    reads it, each when placed with the actor (`critic.placement`, `ref.placement`)."""
    from offbeat.core.config.support import needs_critic, needs_reference

    roles = ["actor"]
    if needs_critic(cfg.algorithm.adv_estimator) and cfg.critic.placement == "actor":
        roles.append("critic")
    if needs_reference(cfg.algorithm) and cfg.ref.placement == "actor":
        roles.append("reference")
    return tuple(roles)


# The part of a trainer bundle's device its hybrid replica is given (Ray hands both the
# rank and the replica the same device); the rank takes the rest.
HYBRID_DEVICE_SHARE = 0.25


async def start_pools(
    cfg: RunConfig, extra: Sequence[PoolSpec] = (), *, rollout: bool = True
) -> ResourcePools:
    """Reserve the job's pools (awaited): the trainer's unless it runs in the driver, the
    rollout's unless `rollout=False`, then `extra` (a recipe's named pools), in order."""
    specs = pool_specs(cfg, trainer=not trainer_in_driver(cfg))
    if not rollout:
        specs = [s for s in specs if s.name != "rollout"]
    return await ResourcePools.create([*specs, *extra], timeout_s=cfg.runtime.placement_timeout_s)


def replica_options(pools: ResourcePools | None, index: int) -> dict[str, Any]:
    """Ray options that put rollout replica `index` into its bundle of the rollout pool;
    a bundle holding a part of one GPU (`runtime.share_trainer_gpu` with a trainer pool)
    gives the replica that part."""
    if pools is None or "rollout" not in pools.groups:
        return {}
    out: dict[str, Any] = {"scheduling_strategy": pools.strategy("rollout", index)}
    gpus = pools.specs["rollout"].bundle.get("GPU")
    if gpus is not None and gpus < 1:
        out["num_gpus"] = gpus
    return out


def _bundle_device(cfg: JobConfig, pools: ResourcePools, pool: str) -> float:
    """The devices one bundle of `pool` holds: 1, or a part of one GPU when shared."""
    return float(pools.specs[pool].bundle.get(DEVICE_RESOURCES.get(cfg.resources.device, ""), 1))


def _device_ask(device: str, share: float) -> dict[str, Any]:
    if DEVICE_RESOURCES.get(device) == "GPU":
        return {"num_gpus": share}
    if device in DEVICE_RESOURCES:
        return {"resources": {DEVICE_RESOURCES[device]: share}}
    return {}


def _rank_options(cfg: RunConfig, pools: ResourcePools, pool: str = "trainer") -> list[dict]:
    rt, device = cfg.runtime, cfg.resources.device
    order = pools.bundle_order(pool)
    share = 1.0 - HYBRID_DEVICE_SHARE if pool == "trainer" and hybrid_replicas(cfg) else 1
    share *= _bundle_device(cfg, pools, pool)
    return [
        {
            "num_cpus": rt.trainer_num_cpus,
            "scheduling_strategy": pools.strategy(pool, order[r]),
            **_device_ask(device, share),
        }
        for r in range(pools.specs[pool].bundles)
    ]


def hybrid_options(cfg: RunConfig, pools: ResourcePools, rank: int) -> dict[str, Any]:
    """Ray options that put trainer rank `rank`'s hybrid replica into the rank's bundle:
    `runtime.rollout_num_cpus` CPUs and `HYBRID_DEVICE_SHARE` of its device."""
    order = pools.bundle_order("trainer")
    share = HYBRID_DEVICE_SHARE * _bundle_device(cfg, pools, "trainer")
    return {
        "num_cpus": cfg.runtime.rollout_num_cpus,
        "num_gpus": 0,
        "scheduling_strategy": pools.strategy("trainer", order[rank]),
        **_device_ask(cfg.resources.device, share),
    }


@dataclass
class TrainerSide:
    """The trainer's group (the loop's engine), the checkpoint engine that syncs it, and
    the critic's and the reference's engines when the job has them (None otherwise)."""

    group: TrainerGroup
    manager: Any
    critic_engine: Any = None
    reference_engine: Any = None

    @property
    def engine(self) -> TrainerGroup:
        """What the training loop drives: the group."""
        return self.group

    def hybrid_manager(self, cfg: RunConfig) -> Any:
        """A checkpoint engine of its own for the hybrid replicas: a host-side backend
        (`shm`) opened on rank 0 beside the rollout replicas' one."""
        from offbeat.core.runtime.weight_sync import GroupCheckpointEngine

        manager = GroupCheckpointEngine(
            self.group, "shm", phase_timeout_s=cfg.runtime.sync_timeout_s, slot="hybrid"
        )
        self.extra_managers.append(manager)
        return manager

    extra_managers: list[Any] = field(default_factory=list)
    # The critic's / reference's worker groups of their own (placement=separate).
    separate: dict[str, TrainerGroup] = field(default_factory=dict)

    async def close(self) -> None:
        """Close the checkpoint engines (on rank 0: their shm files or store go with
        them), then stop the ranks."""
        for g in self.separate.values():
            g.shutdown()
        for m in [self.manager, *self.extra_managers]:
            await m.aclose()
        self.group.shutdown()


def call_timeout_s(trainer: TrainerConfig) -> float | None:
    """A trainer group's call timeout: twice `trainer.stall_timeout_s` (None when off).
    Inside the training loop the stall watchdog names a call that hangs first; outside
    it (a resume's load, the last checkpoint) this bounds every call."""
    stall = trainer.stall_timeout_s
    return 2.0 * stall if stall else None


async def start_trainer(cfg: RunConfig, pools: ResourcePools | None) -> TrainerSide:
    """The trainer of `cfg` (a prepared RunConfig) and its checkpoint engine; the group's
    ranks go into `pools`' trainer pool, which must exist unless the trainer runs in the
    driver (then its one rank runs in this process)."""
    from offbeat.core.config.support import separate_groups
    from offbeat.core.runtime.weight_sync import GroupCheckpointEngine, group_backend_options

    rt = cfg.runtime
    roles = group_roles(cfg)
    group = await _start_actor_group(cfg, pools, roles)
    group.call_timeout_s = call_timeout_s(cfg.trainer)
    separate: dict[str, TrainerGroup] = {}
    try:
        manager = GroupCheckpointEngine(
            group, rt.ckpt_backend, phase_timeout_s=rt.sync_timeout_s,
            release_kv=rt.sync_release_kv,
            backend_options=group_backend_options(rt.ckpt_backend, group, cfg.resources.device),
        )  # fmt: skip
        for role in separate_groups(cfg):
            separate[role] = await _start_separate(cfg, pools, role)
            group.linked.append(separate[role])  # its errors name the actor's global step
        owner = {r: group for r in roles} | separate
        critic = GroupCriticEngine(owner["critic"]) if "critic" in owner else None
        reference = GroupReferenceEngine(owner["reference"]) if "reference" in owner else None
    except BaseException:
        for g in [group, *separate.values()]:
            g.shutdown()
        raise
    return TrainerSide(group, manager, critic, reference, separate=separate)


async def start_trainer_side(
    cfg: RunConfig, pools: ResourcePools | None
) -> tuple[TrainerSide, ResourcePools | None, ResourcePools | None]:
    """`start_trainer` for a run whose pools may lack a trainer pool (the replicas were
    started first): a worker group that needs one gets a trainer pool of its own, reserved
    here. Returns (side, the pools the trainer is in, the pool reserved here or None: the
    caller removes it after `side.close()`)."""
    own = None
    if not trainer_in_driver(cfg) and (pools is None or "trainer" not in pools.groups):
        pools = own = await start_pools(cfg, rollout=False)
    try:  # the train engine builds while the replicas start
        return await start_trainer(cfg, pools), pools, own
    except BaseException:
        if own is not None:
            own.remove()
        raise


async def _start_actor_group(
    cfg: RunConfig, pools: ResourcePools | None, roles: tuple[str, ...]
) -> TrainerGroup:
    """The actor's group: one rank here with the trainer in the driver (this process is
    already pinned and threaded: `pin_trainer`), else rank actors on the trainer pool."""
    from offbeat.core.cpus import share_of

    rt = cfg.runtime
    if trainer_in_driver(cfg):
        return await TrainerGroup.start_local(cfg, threads=rt.trainer_threads, roles=roles)
    if pools is None or "trainer" not in pools.groups:
        raise ValueError("start_trainer: the trainer runs as a worker group and needs its pool")
    n = cfg.resources.trainer_devices
    cpus = [share_of(rt.trainer_cpus, n, r) if rt.trainer_cpus else [] for r in range(n)]
    return await TrainerGroup.start(
        cfg, n, options=_rank_options(cfg, pools), cpus=cpus, seed=cfg.trainer.seed,
        threads=rt.trainer_threads, roles=roles,
    )  # fmt: skip


async def _start_separate(cfg: RunConfig, pools: ResourcePools, role: str) -> TrainerGroup:
    """The worker group of `role` alone ("critic", "reference") on its pool. Its ranks
    share `runtime.trainer_cpus` with the actor's (they run at other moments of a step:
    values and ref log-probs before the actor's updates, the critic's after them)."""
    from offbeat.core.cpus import share_of

    rt = cfg.runtime
    if role not in pools.groups:
        raise ValueError(f"start_trainer: the {role} runs in a worker group of its own and "
                         f"needs its pool {role!r}; pools: {sorted(pools.groups)}")  # fmt: skip
    n = pools.specs[role].bundles
    cpus = [share_of(rt.trainer_cpus, n, r) if rt.trainer_cpus else [] for r in range(n)]
    group = await TrainerGroup.start(
        cfg, n, options=_rank_options(cfg, pools, role), cpus=cpus, seed=cfg.trainer.seed,
        threads=rt.trainer_threads, roles=(role,),
    )  # fmt: skip
    group.call_timeout_s = call_timeout_s(cfg.trainer)
    return group
