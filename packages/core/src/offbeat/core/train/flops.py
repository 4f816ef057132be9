"""FLOPs of a training step of a dense decoder LM (Qwen2 / Llama family), and model FLOPs
utilisation (MFU) against a table of device peaks.

The count follows verl's `flops_counter` for Qwen2/Llama, so our MFU reads like theirs:
6 x N x tokens for the matrix multiplies (N = attention + SwiGLU MLP weights of every
layer, plus vocab x hidden twice: the embedding and the LM head, tied or not; biases and
norms are left out), plus 6 x sum(seqlen^2) x head_dim x heads x layers for attention
(causal: half of the full QK^T and AV products, forward and backward).

Knows nothing about engines, clocks or sharding: a config with HF attribute names and the
token counts of the sequences in, FLOPs out; seconds and a device name in, TFLOP/s and MFU
out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PEAK_TFLOPS",
    "DecoderShape",
    "DevicePeak",
    "decoder_shape_of",
    "device_name",
    "peak_tflops",
    "perf_metrics",
    "training_flops",
]


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a dense decoder that the FLOPs count needs."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, config: Any) -> DecoderShape:
        """From a HF `PretrainedConfig` (or anything with its attribute names; a
        multimodal config's `text_config` is used when present). A config without the
        attributes of a dense decoder raises ValueError naming the missing ones."""
        config = getattr(config, "text_config", None) or config
        needed = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        missing = [k for k in needed if getattr(config, k, None) is None]
        if missing:
            raise ValueError(
                f"cannot count FLOPs of {type(config).__name__}: it has no {missing} "
                "(a dense decoder config of the Qwen2/Llama family is needed)"
            )
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        return cls(
            hidden_size=int(config.hidden_size),
            num_hidden_layers=int(config.num_hidden_layers),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
        )

    @property
    def matmul_params(self) -> int:
        """N of the 6 x N x tokens term: q, k, v, o and gate, up, down of every layer, plus
        vocab x hidden for the embedding and again for the LM head (as verl counts them)."""
        h, d = self.hidden_size, self.head_dim
        q = o = self.num_attention_heads * d
        kv = 2 * self.num_key_value_heads * d
        attn = h * (q + kv + o)
        mlp = 3 * h * self.intermediate_size
        return (attn + mlp) * self.num_hidden_layers + 2 * self.vocab_size * h


def decoder_shape_of(model: Any) -> DecoderShape | None:
    """The sizes of a HF model's config; None for a model that is no dense decoder."""
    try:
        return DecoderShape.from_hf_config(getattr(model, "config", None))
    except ValueError:
        return None


def training_flops(shape: DecoderShape, seqlens: Iterable[int]) -> float:
    """FLOPs of forward + backward over sequences of these token counts (a forward alone
    is a third of it)."""
    lengths = [int(s) for s in seqlens]
    tokens = sum(lengths)
    squares = sum(s * s for s in lengths)
    dense = 6 * shape.matmul_params * tokens
    attention = 6 * squares * shape.head_dim * shape.num_attention_heads * shape.num_hidden_layers
    return float(dense + attention)


@dataclass(frozen=True)
class DevicePeak:
    """Dense matrix-multiply peaks of one device, TFLOP/s by compute dtype: the vendor's
    datasheet figure, and where we measured one, a large matmul's in our own run."""

    vendor: Mapping[str, float]
    measured: Mapping[str, float] | None = None
    how_measured: str = ""


# Keys match a substring of torch.cuda.get_device_name() (longest key first, so "H200" is
# not taken for "H20"). Vendor figures are dense (no sparsity), SXM parts. float32 means
# what our engines run in float32 (TF32 off): the plain FP32 rate.
PEAK_TFLOPS: dict[str, DevicePeak] = {
    "H200": DevicePeak(
        vendor={"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
        # benchmarks/train_mfu.py: torch.matmul of two random 8192x8192 bf16 matrices,
        # median of 20 after 5 warm-ups, on the 2xH200 machine of benchmarks/results/
        # train_mfu.txt (765; an earlier run on another such machine gave 778).
        measured={"bfloat16": 765.0},
        how_measured="8192^3 bf16 torch.matmul on random data (benchmarks/train_mfu.py)",
    ),
    "H100": DevicePeak(vendor={"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    "H800": DevicePeak(vendor={"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    "H20": DevicePeak(vendor={"bfloat16": 148.0, "float16": 148.0}),
    "A100": DevicePeak(vendor={"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    "A800": DevicePeak(vendor={"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    "L40S": DevicePeak(vendor={"bfloat16": 362.05, "float16": 362.05}),
    "B200": DevicePeak(vendor={"bfloat16": 2250.0, "float16": 2250.0}),
    "MI300X": DevicePeak(vendor={"bfloat16": 1307.4, "float16": 1307.4}),
}


def peak_tflops(device_name: str, dtype: str = "bfloat16", measured: bool = False) -> float | None:
    """The peak TFLOP/s of `device_name` in `dtype` (vendor's, or our measured one with
    `measured=True`); None for a device or dtype the table does not know (CPUs)."""
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in device_name:
            peak = PEAK_TFLOPS[key]
            table = peak.measured if measured else peak.vendor
            return None if table is None else table.get(dtype)
    return None


def device_name(device: Any) -> str:
    """What the peak table matches a `torch.device` by: its accelerator's name, or "cpu"."""
    if device.type == "cpu":
        return "cpu"
    import torch

    get_name = getattr(torch.get_device_module(device.type), "get_device_name", None)
    return get_name(device) if callable(get_name) else device.type


def perf_metrics(
    flops: float, seconds: float, num_devices: int, peak: float | None
) -> dict[str, float]:
    """`perf/tflops_per_device` (achieved model FLOPs per second per device, in TFLOP/s)
    and, when the device's `peak` TFLOP/s is known, `perf/mfu` (that over the peak)."""
    if seconds <= 0 or num_devices < 1:
        return {}
    tflops = flops / seconds / num_devices / 1e12
    out = {"perf/tflops_per_device": tflops}
    if peak:
        out["perf/mfu"] = tflops / peak
    return out
