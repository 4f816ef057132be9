"""offbeat.planner: profile a job on the machine at hand, simulate its pipeline, plan the
cluster split.

`offbeat profile` writes a `Profile` (JSON); `simulate` runs a `SimConfig` on it, event by
event, with the real replay buffer's staleness rules; `plan` sweeps device splits,
replicas x TP, staleness and mode and ranks them. Knows no engine: the measuring side
(`offbeat.planner.measure`) drives the job's own engines and is imported only there.
"""

from offbeat.planner.plan import Candidate, PlanRequest, plan, predict, sim_config_from_job
from offbeat.planner.profile import (
    SCALING_ASSUMPTIONS,
    SCHEMA,
    Profile,
    RolloutProfile,
    SyncProfile,
    TrainerPoint,
    TrainerProfile,
    ValidationProfile,
)
from offbeat.planner.simulator import MODES, SimConfig, SimResult, StepRecord, simulate

__all__ = [  # the profile, the simulator, the planner
    "MODES",
    "SCALING_ASSUMPTIONS",
    "SCHEMA",
    "Candidate",
    "PlanRequest",
    "Profile",
    "RolloutProfile",
    "SimConfig",
    "SimResult",
    "StepRecord",
    "SyncProfile",
    "TrainerPoint",
    "TrainerProfile",
    "ValidationProfile",
    "plan",
    "predict",
    "sim_config_from_job",
    "simulate",
]
