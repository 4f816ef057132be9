"""The separate_async / sync trainer: agent loop, rollout driver, replica pool, training
loop, critic and reference model, checkpoints and metrics, and the job's one seam for
recipes (`JobExtension`)."""

from offbeat.core.trainer.agent_loop import GroupFailed, SingleTurnAgentLoop, encode_prompt
from offbeat.core.trainer.checkpoint import CheckpointManager, rng_state, set_rng_state
from offbeat.core.trainer.critic import Critic
from offbeat.core.trainer.extension import JobExtension
from offbeat.core.trainer.hybrid import CYCLE_PHASES, HybridReplicas
from offbeat.core.trainer.ppo import CriticAndReference
from offbeat.core.trainer.reference import Reference
from offbeat.core.trainer.replicas import NoReplicasLeft, Replacement, ReplicaPool
from offbeat.core.trainer.rollout import BusyClock, RolloutDriver, RolloutFailing
from offbeat.core.trainer.tracking import LOGGERS, MetricsTracker
from offbeat.core.trainer.trainer import MODES, Trainer, build_train_batch
from offbeat.core.trainer.validation import Validator

__all__ = [  # noqa: RUF022 (grouped by concept)
    # the one seam a recipe or a reward extends the job through (run_job's extensions)
    "JobExtension",
    # the loop
    "MODES",
    "Trainer",
    "build_train_batch",
    # critic and reference model (PPO with GAE, KL loss, KL in the reward)
    "Critic",
    "CriticAndReference",
    "Reference",
    # rollout side
    "BusyClock",
    "GroupFailed",
    "NoReplicasLeft",
    "Replacement",
    "ReplicaPool",
    "RolloutDriver",
    "RolloutFailing",
    "SingleTurnAgentLoop",
    "Validator",
    "encode_prompt",
    # elastic replicas: validation on the trainer's devices
    "CYCLE_PHASES",
    "HybridReplicas",
    # checkpoints and metrics
    "CheckpointManager",
    "LOGGERS",
    "MetricsTracker",
    "rng_state",
    "set_rng_state",
]
