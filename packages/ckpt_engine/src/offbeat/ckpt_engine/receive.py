"""The one function a receiving process calls: `receive(spec, load_weights, current_version)`.

Runs wherever the model lives (for vLLM, inside the worker). Knows nothing about the
engine: it feeds `load_weights` (name, tensor) pairs bucket by bucket and returns the new
version only when every bucket arrived intact; otherwise it raises.
"""

from __future__ import annotations

from offbeat.ckpt_engine.registry import get_backend
from offbeat.ckpt_engine.target import LoadWeightsFn, ReceiveSpec

__all__ = ["receive"]


def receive(
    spec: ReceiveSpec, load_weights: LoadWeightsFn, current_version: int | None = None
) -> int:
    """Block until the sync described by `spec` is received; return `spec.version`.

    `load_weights` gets lists of (name, tensor); each tensor is valid only until it returns
    (it may be a view of a buffer that is then refilled), so it must copy, queue any device
    copies on the current stream, and leave the tensors' metadata alone. Raises
    StaleVersionError when `spec.version < current_version`, ChecksumError on corruption,
    PeerError when the sender goes away, SyncTimeoutError (a TimeoutError) when a wait
    runs past `spec.timeout_s`. On any error the model may hold a mix of old and new
    weights and must not be reported or served as `spec.version`.
    """
    return get_backend(spec.backend).receive(spec, load_weights, current_version)
