"""Resource pools: the job's devices as Ray placement groups, one per role.

A pool is N bundles of the same shape, packed onto as few nodes as possible (Ray's PACK
strategy): the trainer pool has one bundle per data-parallel rank, the rollout pool one
per replica (its tensor-parallel devices together, since a replica's engine is one
process tree on one node), a critic or reference model in a worker group of its own has
a pool named after its role, and a recipe may declare named pools of its own (teachers,
judges). On CPU a bundle is CPUs; on an accelerator it is devices plus CPUs.

Before anything is reserved, `check_fit` packs every pool's bundles onto the nodes the
cluster reports; when they do not fit, `PlacementError` says what was asked, pool by
pool, and what the cluster has, node by node. Knows nothing about what runs in a bundle.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offbeat.core.config.run import RunConfig

__all__ = [
    "DEVICE_RESOURCES",
    "SHARED_DEVICE_BUNDLE",
    "PlacementError",
    "PoolSpec",
    "ResourcePools",
    "check_fit",
    "cluster_nodes",
    "pool_specs",
]

# The Ray resource name of each device type (CPU-only jobs ask for CPUs alone).
DEVICE_RESOURCES = {"cuda": "GPU", "npu": "NPU"}

# `runtime.share_trainer_gpu` with the trainer as a worker group (hybrid replicas on one
# GPU): the part of that GPU the trainer bundle and the rollout bundle each reserve.
SHARED_DEVICE_BUNDLE = 0.5


class PlacementError(RuntimeError):
    """The cluster cannot hold the pools that were asked for."""


@dataclass(frozen=True)
class PoolSpec:
    """`bundles` bundles of `bundle` (Ray resource name -> amount) each."""

    name: str
    bundles: int
    bundle: Mapping[str, float]

    def total(self) -> dict[str, float]:
        return {k: v * self.bundles for k, v in self.bundle.items()}

    def describe(self) -> str:
        return f"{self.name} {self.bundles} × {_fmt(self.bundle)}"


def _fmt(resources: Mapping[str, float]) -> str:
    items = ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items()) if v)
    return "{" + items + "}"


def _bundle(device: str, devices: float, cpus: float, extra: Mapping[str, float]) -> dict:
    out: dict[str, float] = {"CPU": float(cpus)}
    if device in DEVICE_RESOURCES:
        out[DEVICE_RESOURCES[device]] = float(devices)
    out.update({k: float(v) for k, v in extra.items()})
    return {k: v for k, v in out.items() if v}


def pool_specs(cfg: RunConfig, *, trainer: bool = True) -> list[PoolSpec]:
    """The trainer and rollout pools of a RunConfig: `resources.trainer_devices` bundles
    of one device + `runtime.trainer_num_cpus` CPUs (+ `runtime.rollout_num_cpus` for the
    rank's hybrid replica with `trainer.validate_on_trainer_devices`), and one bundle per rollout replica
    (`rollout.tensor_parallel_size` devices + `runtime.rollout_num_cpus` CPUs), each with
    the pool's extra Ray resources; then, for a critic / reference model in a worker group
    of its own (`critic.placement=separate`), a pool named after its role ("critic",
    "reference") of `critic.devices` / `ref.devices` bundles shaped as the trainer's
    (one device + `runtime.trainer_num_cpus` CPUs). `trainer=False`: the trainer runs in
    the driver and reserves nothing. With a trainer pool and `runtime.share_trainer_gpu`
    (one rank and one replica on one GPU; the config checks say when) the trainer bundle
    and the rollout bundle each hold `SHARED_DEVICE_BUNDLE` of that GPU."""
    r, rt = cfg.resources, cfg.runtime
    out = []
    device = SHARED_DEVICE_BUNDLE if trainer and getattr(rt, "share_trainer_gpu", False) else 1
    if trainer:
        cpus = rt.trainer_num_cpus
        if getattr(cfg.trainer, "validate_on_trainer_devices", False):
            cpus += rt.rollout_num_cpus  # the rank's hybrid replica shares its bundle
        shape = _bundle(r.device, device, cpus, rt.trainer_resources)
        out.append(PoolSpec("trainer", r.trainer_devices, shape))
    from offbeat.core.config.support import replica_devices, separate_groups

    per_replica = replica_devices(cfg.rollout)  # tp, or a prefill-decode replica's engines x tp
    shape = _bundle(r.device, per_replica * device, rt.rollout_num_cpus, rt.rollout_resources)
    out.append(PoolSpec("rollout", r.rollout_devices // per_replica, shape))

    for role, devices in separate_groups(cfg).items():  # "critic", "reference"
        shape = _bundle(r.device, 1, rt.trainer_num_cpus, rt.trainer_resources)
        out.append(PoolSpec(role, devices, shape))
    return out


def check_fit(pools: Sequence[PoolSpec], nodes: Mapping[str, Mapping[str, float]]) -> None:
    """Raise PlacementError unless every bundle of `pools` fits on `nodes` (node ->
    resources it has). Pools are placed in order, each packed: its bundles go to the node
    that already holds most of them when they fit there (first fit otherwise)."""
    free = {n: dict(res) for n, res in nodes.items()}
    for pool in pools:
        placed: dict[str, int] = {}
        for i in range(pool.bundles):
            order = sorted(free, key=lambda n: (-placed.get(n, 0), list(free).index(n)))
            node = next((n for n in order if _fits(pool.bundle, free[n])), None)
            if node is None:
                raise PlacementError(_fit_message(pools, nodes, pool, i))
            for k, v in pool.bundle.items():
                free[node][k] = free[node].get(k, 0.0) - v
            placed[node] = placed.get(node, 0) + 1


def _fits(bundle: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def _fit_message(
    pools: Sequence[PoolSpec], nodes: Mapping[str, Mapping[str, float]], pool: PoolSpec, i: int
) -> str:
    asked: dict[str, float] = {}
    for p in pools:
        for k, v in p.total().items():
            asked[k] = asked.get(k, 0.0) + v
    have: dict[str, float] = {}
    for res in nodes.values():
        for k, v in res.items():
            if k in asked:
                have[k] = have.get(k, 0.0) + v
    per_node = "; ".join(
        f"{n}: {_fmt({k: v for k, v in res.items() if k in asked})}" for n, res in nodes.items()
    )
    return (
        f"the resource pools do not fit the Ray cluster: asked "
        f"{', '.join(p.describe() for p in pools)} = {_fmt(asked)} in all; the cluster has "
        f"{_fmt(have)} on {len(nodes)} node(s) ({per_node or 'none'}); bundle {i} of pool "
        f"{pool.name!r} ({_fmt(pool.bundle)}) has no node left that holds it. Change "
        f"resources.* / runtime.*_num_cpus, or give Ray more (runtime.ray_num_cpus for a "
        f"local Ray, more nodes for a cluster)"
    )


def cluster_nodes() -> dict[str, dict[str, float]]:
    """node (IP and short id) -> total resources, for every live node of the Ray cluster
    this process is connected to (not counting `node:` and memory pseudo-resources)."""
    import ray

    out = {}
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = {
            k: float(v)
            for k, v in n.get("Resources", {}).items()
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")
        }
        out[f"{n['NodeManagerAddress']}/{n['NodeID'][:8]}"] = res
    return out


@dataclass
class ResourcePools:
    """Placement groups by pool name, each ready. `strategy(pool, i)` is the Ray
    scheduling strategy that puts an actor into bundle `i` of `pool`; `bundle_order(pool)`
    lists its bundles sorted by (node, index), so rank order is stable across runs."""

    specs: dict[str, PoolSpec]
    groups: dict[str, Any] = field(default_factory=dict)
    bundle_nodes: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    async def create(
        cls,
        specs: Sequence[PoolSpec],
        *,
        timeout_s: float = 120.0,
        nodes: Mapping[str, Mapping[str, float]] | None = None,
    ) -> ResourcePools:
        """Check the pools fit, then reserve them (awaited, never blocking the loop)."""
        import ray
        from ray.util import placement_group, remove_placement_group

        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"resource pools need distinct names, got {names}")
        specs = [s for s in specs if s.bundles > 0]
        nodes = await asyncio.to_thread(cluster_nodes) if nodes is None else nodes
        check_fit(specs, nodes)
        pools = cls({s.name: s for s in specs})
        try:
            for s in specs:  # in order: the trainer pool packs first
                pg = placement_group([dict(s.bundle)] * s.bundles, strategy="PACK")
                pools.groups[s.name] = pg
                try:
                    await asyncio.wait_for(pg.ready(), timeout_s)
                except TimeoutError:
                    free = await asyncio.to_thread(ray.available_resources)
                    raise PlacementError(
                        f"resource pool {s.describe()} was not placed within {timeout_s:.0f}s "
                        f"(runtime.placement_timeout_s): the cluster has "
                        f"{_fmt({k: v for k, v in free.items() if k in s.bundle})} free "
                        f"(other jobs or pools hold the rest)"
                    ) from None
            table = await asyncio.to_thread(ray.util.placement_group_table)
            for name, pg in pools.groups.items():
                mapping = table.get(pg.id.hex(), {}).get("bundles_to_node_id", {})
                pools.bundle_nodes[name] = [
                    mapping.get(i, "") for i in range(pools.specs[name].bundles)
                ]
        except BaseException:
            for pg in pools.groups.values():
                remove_placement_group(pg)
            raise
        return pools

    def bundle_order(self, pool: str) -> list[int]:
        nodes = self.bundle_nodes.get(pool) or [""] * self.specs[pool].bundles
        return sorted(range(len(nodes)), key=lambda i: (nodes[i], i))

    def strategy(self, pool: str, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if pool not in self.groups:
            raise KeyError(f"no resource pool {pool!r}; pools: {sorted(self.groups)}")
        return PlacementGroupSchedulingStrategy(
            placement_group=self.groups[pool],
            placement_group_bundle_index=index,
            placement_group_capture_child_tasks=False,
        )

    def remove(self) -> None:
        from ray.util import remove_placement_group

        for pg in self.groups.values():
            with contextlib.suppress(Exception):  # Ray shut down: nothing is reserved now
                remove_placement_group(pg)
        self.groups.clear()
