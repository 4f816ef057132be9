"""Which SGLang endpoints one weight update calls, in order, for each checkpoint-engine
backend.

A `ReceiveSpec` (offbeat.ckpt_engine) becomes a list of (endpoint, JSON body):

- `broadcast` (NCCL): `/init_weights_update_group` once per group (the trainer is rank 0,
  the server's ranks start at `rank_offset`), then `/update_weights_from_distributed` with
  the tensors' names, dtypes and shapes in the order the sender broadcasts them;
- `cuda_ipc` (same GPU): `/update_weights_from_tensor` with the serialized named tensors
  (one base64 string per tensor-parallel rank, as SGLang's `MultiprocessingSerializer` makes);
- `disk`: `/update_weights_from_disk` with `channel["model_path"]`, a checkpoint directory
  SGLang's loader reads (HF layout). offbeat's own disk backend writes bucket files, which
  SGLang cannot load: its `directory` is not accepted here.

Servers from SGLang 0.5.21 on refuse tensor and NCCL updates outside a session, so those
calls are wrapped in `/begin_weight_update` ... `/end_weight_update` when `session` is set.
Knows nothing about HTTP or the server's state: it only builds the plan.
"""

from __future__ import annotations

from typing import Any

from offbeat.ckpt_engine.target import ReceiveSpec

__all__ = ["SUPPORTED_BACKENDS", "group_key", "update_plan"]

SUPPORTED_BACKENDS = ("broadcast", "cuda_ipc", "disk")

_BROADCAST_KEYS = ("master_address", "master_port", "world_size", "names", "dtypes", "shapes")


def _need(spec: ReceiveSpec, keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in spec.channel]
    if missing:
        raise ValueError(
            f"weight update to version {spec.version} over {spec.backend!r}: the spec's "
            f"channel lacks {missing} (has {sorted(spec.channel)}); SGLang needs {list(keys)}"
        )


def group_key(spec: ReceiveSpec) -> tuple[Any, ...]:
    """What identifies the NCCL group a broadcast spec joins (built once, then reused)."""
    ch = spec.channel
    return (
        ch.get("group_name", "weight_update_group"),
        ch["master_address"],
        int(ch["master_port"]),
        int(ch["world_size"]),
    )


def update_plan(
    spec: ReceiveSpec,
    *,
    session: bool,
    joined_groups: set[tuple[Any, ...]] | frozenset = frozenset(),
) -> list[tuple[str, dict[str, Any]]]:
    """The calls that load `spec.version`, in order. Raises ValueError for a backend SGLang
    cannot receive from or a channel that lacks what SGLang needs."""
    version = str(spec.version)
    ch = spec.channel
    calls: list[tuple[str, dict[str, Any]]] = []
    if spec.backend == "broadcast":
        _need(spec, _BROADCAST_KEYS)
        group = ch.get("group_name", "weight_update_group")
        if group_key(spec) not in joined_groups:
            calls.append(
                (
                    "/init_weights_update_group",
                    {
                        "master_address": ch["master_address"],
                        "master_port": int(ch["master_port"]),
                        "rank_offset": int(ch.get("rank_offset", 1 + spec.rank)),
                        "world_size": int(ch["world_size"]),
                        "group_name": group,
                        "backend": ch.get("nccl_backend", "nccl"),
                    },
                )
            )
        update = (
            "/update_weights_from_distributed",
            {
                "names": list(ch["names"]),
                "dtypes": [str(d).removeprefix("torch.") for d in ch["dtypes"]],
                "shapes": [list(map(int, s)) for s in ch["shapes"]],
                "group_name": group,
                "flush_cache": True,
                "weight_version": version,
                **({"load_format": ch["load_format"]} if ch.get("load_format") else {}),
            },
        )
    elif spec.backend == "cuda_ipc":
        _need(spec, ("serialized_named_tensors",))
        update = (
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": list(ch["serialized_named_tensors"]),
                "flush_cache": True,
                "weight_version": version,
                **({"load_format": ch["load_format"]} if ch.get("load_format") else {}),
            },
        )
    elif spec.backend == "disk":
        path = ch.get("model_path")
        if not path:
            raise ValueError(
                f"weight update to version {spec.version} over 'disk': the spec's channel "
                f"names no 'model_path' (has {sorted(ch)}); SGLang loads a checkpoint "
                "directory in HF layout, not offbeat's bucket files"
            )
        # Loading from disk needs no session: SGLang's loader handles its own packing.
        return [
            (
                "/update_weights_from_disk",
                {
                    "model_path": str(path),
                    "flush_cache": True,
                    "weight_version": version,
                    **({"load_format": ch["load_format"]} if ch.get("load_format") else {}),
                },
            )
        ]
    else:
        raise ValueError(
            f"weight update to version {spec.version}: backend {spec.backend!r} cannot reach "
            f"an SGLang server; use one of {list(SUPPORTED_BACKENDS)}"
        )
    if session:
        return [*calls, ("/begin_weight_update", {}), update, ("/end_weight_update", {})]
    return [*calls, update]
