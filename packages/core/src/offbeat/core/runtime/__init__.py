"""The distributed runtime: resource pools on Ray placement groups, the trainer as a
worker group of data-parallel rank actors (with the critic and the reference policy on
the same ranks when the job has them) or of one rank in the driver, and weight sync
from that group."""

from offbeat.core.runtime.engines import GroupCriticEngine, GroupReferenceEngine
from offbeat.core.runtime.group import (
    TrainerGroup,
    TrainerRankFailed,
    gather_rows,
    merge_rank_metrics,
    split_by_tokens,
)
from offbeat.core.runtime.launch import (
    HYBRID_DEVICE_SHARE,
    TrainerSide,
    group_roles,
    hybrid_options,
    hybrid_replicas,
    replica_options,
    start_pools,
    start_trainer,
    trainer_in_driver,
)
from offbeat.core.runtime.local import LocalRank, LocalRef
from offbeat.core.runtime.pools import (
    DEVICE_RESOURCES,
    PlacementError,
    PoolSpec,
    ResourcePools,
    check_fit,
    pool_specs,
)
from offbeat.core.runtime.rank import ROLES, TrainerRank
from offbeat.core.runtime.weight_sync import (
    GroupCheckpointEngine,
    GroupSenderBackend,
    group_backend_options,
)

__all__ = [  # noqa: RUF022 (grouped by concept)
    # resource pools
    "DEVICE_RESOURCES",
    "PlacementError",
    "PoolSpec",
    "ResourcePools",
    "check_fit",
    "pool_specs",
    # the trainer worker group
    "TrainerGroup",
    "TrainerRank",
    "TrainerRankFailed",
    "ROLES",
    "LocalRank",
    "LocalRef",
    "gather_rows",
    "merge_rank_metrics",
    "split_by_tokens",
    # the critic and the reference policy on the group's ranks
    "GroupCriticEngine",
    "GroupReferenceEngine",
    # weight sync from the group
    "GroupCheckpointEngine",
    "GroupSenderBackend",
    "group_backend_options",
    # what a job starts
    "HYBRID_DEVICE_SHARE",
    "TrainerSide",
    "group_roles",
    "hybrid_options",
    "hybrid_replicas",
    "replica_options",
    "start_pools",
    "start_trainer",
    "trainer_in_driver",
]
