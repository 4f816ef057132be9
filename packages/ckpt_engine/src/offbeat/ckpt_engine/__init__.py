"""offbeat.ckpt_engine: stream a trainer's weights to inference replicas, bucketed,
versioned, never reported as applied unless every bucket arrived intact.

Depends on torch (and numpy) only: no offbeat.core, no vLLM, no Megatron.
"""

from offbeat.ckpt_engine.bucket import ALIGN, Entry, Reassembler, plan_buckets
from offbeat.ckpt_engine.errors import (
    CheckpointEngineError,
    ChecksumError,
    PeerError,
    StaleVersionError,
    SyncTimeoutError,
)
from offbeat.ckpt_engine.loader import copy_into
from offbeat.ckpt_engine.manager import (
    DEFAULT_BUCKET_BYTES,
    PHASES,
    CheckpointEngineManager,
    SyncResult,
)
from offbeat.ckpt_engine.receive import receive
from offbeat.ckpt_engine.registry import (
    Backend,
    Sender,
    SendReport,
    backends,
    get_backend,
    register_backend,
)
from offbeat.ckpt_engine.target import LoadWeightsFn, ReceiveSpec, SyncTarget

# The two sides: receive + ReceiveSpec/SyncTarget/LoadWeightsFn (where the model lives),
# copy_into (a fused loader for plain models), CheckpointEngineManager/SyncResult/PHASES
# (the trainer); backends: Backend, Sender,
# SendReport, backends, get_backend, register_backend; bucketing shared by every backend:
# ALIGN, Entry, Reassembler, plan_buckets; errors: *Error.
__all__ = [
    "ALIGN",
    "DEFAULT_BUCKET_BYTES",
    "PHASES",
    "Backend",
    "CheckpointEngineError",
    "CheckpointEngineManager",
    "ChecksumError",
    "Entry",
    "LoadWeightsFn",
    "PeerError",
    "Reassembler",
    "ReceiveSpec",
    "SendReport",
    "Sender",
    "StaleVersionError",
    "SyncResult",
    "SyncTarget",
    "SyncTimeoutError",
    "backends",
    "copy_into",
    "get_backend",
    "plan_buckets",
    "receive",
    "register_backend",
]
