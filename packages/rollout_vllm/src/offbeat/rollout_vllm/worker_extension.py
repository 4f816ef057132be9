"""The piece of offbeat that runs inside vLLM's worker process: receiving weights.

vLLM mixes this class into its Worker when the engine is started with
`worker_extension_cls="offbeat.rollout_vllm.worker_extension.WeightSyncExtension"`;
`AsyncLLM.collective_rpc("offbeat_receive_weights", args=(spec, version))` then runs the
method in every worker. It knows nothing about how the bytes travel (the checkpoint
engine's `receive` does) nor about request scheduling (the server pauses first).

Why layerwise reload: on some platforms vLLM repacks weights after loading (on CPU each
linear layer's weight is packed for oneDNN and the plain tensor freed), so calling
`model.load_weights` on a loaded model would not reach the kernels. vLLM's layerwise
reload restores the checkpoint-format parameters, buffers what `load_weights` is given, and
re-runs each layer's post-load processing as soon as all of its weights have arrived.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from offbeat.rollout_vllm.compat import (
    LAYERWISE_RELOAD_LOGGER,
    layerwise_reload,
    set_current_vllm_config,
)

__all__ = ["WeightSyncExtension"]

logger = logging.getLogger(__name__)


class _WeightlessLayerFilter(logging.Filter):
    """vLLM's layerwise reload warns "Failed to load weights" for layers that hold only
    buffers no checkpoint carries (RotaryEmbedding's cos/sin cache); it keeps them as they
    were, which is right, so the warning would only repeat on every sync."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "RotaryEmbedding: Failed to load weights"


logging.getLogger(LAYERWISE_RELOAD_LOGGER).addFilter(_WeightlessLayerFilter())


class WeightSyncExtension:
    """Worker mixin; `self` is vLLM's Worker (it has `model_runner` and `vllm_config`)."""

    model_runner: Any
    vllm_config: Any

    def offbeat_receive_weights(self, spec: Any, current_version: int) -> dict[str, Any]:
        """Run the checkpoint engine's receiver for `spec` (a `ReceiveSpec` or its fields
        as a dict, which is how vLLM's RPC delivers it), loading every (name, tensor)
        through the model's own `load_weights`.

        Returns {"version": the version now held, "receive_s": time in the receiver
        (waiting for buckets, copying, `load_weights`, per-layer post-processing), of which
        "load_weights_s" inside `load_weights` (copy + per-layer post-processing), and
        "finalize_s": the post-processing left for the end (attention layers)}.
        """
        from offbeat.ckpt_engine import ReceiveSpec, receive

        if isinstance(spec, dict):
            spec = ReceiveSpec(**spec)

        model = self.model_runner.get_model()
        initialize, finalize = layerwise_reload()
        t0 = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            load_s = [0.0]

            def load_weights(named_tensors):
                # Layerwise reload keeps a reference to each tensor until its layer is
                # complete, which may be a later bucket; the receiver's tensors are only
                # valid during this call (their buffer is refilled), so hand over copies.
                t = time.perf_counter()
                try:
                    return model.load_weights((n, t.clone()) for n, t in named_tensors)
                finally:
                    load_s[0] += time.perf_counter() - t

            initialize(model)
            t1 = time.perf_counter()
            try:
                version = receive(spec, load_weights=load_weights, current_version=current_version)
            finally:
                t2 = time.perf_counter()
                # Also on failure: put every layer back into a runnable state (the server
                # then marks itself broken and serves nothing until a sync succeeds).
                finalize(model, self.vllm_config.model_config)
        return {
            "version": version,
            "receive_s": t2 - t0,
            "finalize_s": time.perf_counter() - t2,
            "initialize_s": t1 - t0,
            "load_weights_s": load_s[0],
        }

    def offbeat_device_memory(self) -> tuple[int, int] | None:
        """(free, total) bytes of this worker's CUDA device as its driver counts them:
        the device as a whole, every process on it; None on another device (CPU)."""
        import torch

        device = getattr(self, "device", None)
        if getattr(device, "type", None) != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)

    def offbeat_weight_checksum(self) -> float:
        """Sum of all parameters as float64: a cheap fingerprint for tests and debugging."""
        import torch

        model = self.model_runner.get_model()
        with torch.no_grad():
            return float(sum(p.double().sum().item() for p in model.parameters()))
