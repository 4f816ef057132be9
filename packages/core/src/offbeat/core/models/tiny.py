"""Build a small Qwen2-architecture causal LM with random weights, offline, in about a second.

Knows nothing about engines or training: it writes an ordinary Hugging Face directory
(config.json, model.safetensors, generation_config.json and a character-level tokenizer
with a ChatML chat template) that `transformers` and vLLM both load. Weights are drawn
straight into tensors named as `Qwen2ForCausalLM` names them (no model object is built),
so even the ~100M preset takes seconds, and a build is cached under a hash of its
arguments: a repeated call returns at once.

Random weights with the usual init (std 0.02) make greedy decoding repeat one token;
`initializer_range=0.3` gives varied, deterministic greedy continuations.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from offbeat.core.models.tokenizer import SPECIAL_TOKENS, char_vocab, save_char_tokenizer

__all__ = [
    "TINY_MODEL_PRESETS",
    "TINY_PREFIX",
    "TinyModelSpec",
    "atomic_build",
    "build_tiny_model",
    "cache_root",
    "default_cache_dir",
    "tiny_model_num_parameters",
]

# Bump when the files written change, so stale cached builds are not reused.
_BUILDER_VERSION = 2
_MARKER = "offbeat_tiny_model.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TinyModelSpec:
    """The architecture knobs of one preset (Qwen2: GQA attention with q/k/v biases,
    SwiGLU MLP, RMSNorm, RoPE)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


# Named sizes; the comment is the parameter count with the 260-token byte vocabulary.
TINY_MODEL_PRESETS: dict[str, TinyModelSpec] = {
    # ~1.0M: the default for tests and the embedded job.
    "tiny": TinyModelSpec(128, 4, 4, 2, 512),
    # ~9.5M
    "small": TinyModelSpec(384, 6, 6, 2, 1024),
    # ~38M
    "medium": TinyModelSpec(512, 12, 8, 4, 1536),
    # ~101M: the size used to measure weight-sync bandwidth.
    "large": TinyModelSpec(768, 16, 12, 4, 2048),
}


@contextlib.contextmanager
def atomic_build(out: Path, marker: str) -> Iterator[Path]:
    """A fresh directory beside `out` to build in; on success it is renamed into place
    (an older build there is swapped out first), so a concurrent caller (another test
    worker) never sees a half-written directory. When someone else renamed the same build
    into place first (`out/marker` exists), theirs is kept: it is identical."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        theirs, ours = out / marker, tmp / marker
        if theirs.is_file() and ours.is_file() and theirs.read_bytes() == ours.read_bytes():
            # Someone else renamed the identical build into place while we built: keep
            # theirs. Swapping it out would leave a moment with nothing at `out` (a
            # concurrent builder loading it failed there) and delete files in use.
            return
        if out.exists():  # an older build (another spec): replaced
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / "d")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cache_root() -> Path:
    """offbeat's build cache (models, warm starts, task files, teachers, judges):
    $OFFBEAT_CACHE_DIR, else ~/.cache/offbeat. The only place that default is written."""
    root = os.environ.get("OFFBEAT_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "offbeat"


def default_cache_dir() -> Path:
    """Where builds go when no `out_dir` is given: `cache_root()/tiny_models`."""
    return cache_root() / "tiny_models"


def _resolve_spec(size: str, overrides: dict[str, Any]) -> TinyModelSpec:
    if size not in TINY_MODEL_PRESETS:
        raise ValueError(
            f"build_tiny_model: size={size!r} is not a preset; valid sizes: "
            f"{sorted(TINY_MODEL_PRESETS)}"
        )
    spec = TINY_MODEL_PRESETS[size]
    valid = set(asdict(spec))
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(
            f"build_tiny_model: unknown override(s) {unknown}; valid keys: {sorted(valid)}"
        )
    spec = replace(spec, **overrides)
    if spec.hidden_size % spec.num_attention_heads:
        raise ValueError(
            f"build_tiny_model: hidden_size={spec.hidden_size} is not divisible by "
            f"num_attention_heads={spec.num_attention_heads}"
        )
    if spec.num_attention_heads % spec.num_key_value_heads:
        raise ValueError(
            f"build_tiny_model: num_attention_heads={spec.num_attention_heads} is not "
            f"divisible by num_key_value_heads={spec.num_key_value_heads}"
        )
    return spec


def _weight_shapes(spec: TinyModelSpec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Qwen2ForCausalLM's state-dict names and shapes, in load order."""
    h, inter = spec.hidden_size, spec.intermediate_size
    head_dim = h // spec.num_attention_heads
    kv = spec.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.q_proj.bias": (h,),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, h),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab_size, h)
    return shapes


def tiny_model_num_parameters(size: str = "tiny", **overrides: Any) -> int:
    """Parameter count of a preset (with `overrides`), without building it."""
    spec = _resolve_spec(size, overrides)
    total = 0
    for shape in _weight_shapes(spec, len(char_vocab())).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def _random_weights(
    spec: TinyModelSpec, vocab_size: int, seed: int, std: float, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    # transformers' Qwen2 init: normal(0, initializer_range) for linear and embedding
    # weights, zero biases, unit RMSNorm scales.
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in _weight_shapes(spec, vocab_size).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.empty(shape).normal_(0.0, std, generator=gen)
        out[name] = t.to(dtype).contiguous()
    return out


def _write_configs(out: Path, spec: TinyModelSpec, vocab_size: int, std: float, dtype: str):
    from transformers import GenerationConfig, Qwen2Config

    vocab = char_vocab()
    eos = [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    pad = vocab["<|pad|>"]
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=std,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=eos[0],
        pad_token_id=pad,
        dtype=dtype,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=None, eos_token_id=eos, pad_token_id=pad).save_pretrained(out)


def _build_key(spec: TinyModelSpec, seed: int, std: float, dtype: str) -> dict[str, Any]:
    return {
        "builder_version": _BUILDER_VERSION,
        "spec": asdict(spec),
        "special_tokens": list(SPECIAL_TOKENS),
        "seed": seed,
        "initializer_range": std,
        "dtype": dtype,
    }


def _dtype_name(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        for name, d in _DTYPES.items():
            if d == dtype:
                return name
    elif dtype in _DTYPES:
        return dtype
    raise ValueError(f"build_tiny_model: dtype={dtype!r}; valid dtypes: {sorted(_DTYPES)}")


def build_tiny_model(
    out_dir: str | Path | None = None,
    size: str = "tiny",
    *,
    seed: int = 0,
    initializer_range: float = 0.3,
    dtype: str | torch.dtype = "float32",
    **overrides: Any,
) -> Path:
    """Write a random Qwen2 causal LM + character tokenizer into `out_dir`; return its path.

    `size` is a key of `TINY_MODEL_PRESETS`; `overrides` replace fields of its
    `TinyModelSpec` (e.g. `num_hidden_layers=2`). With `out_dir=None` the model goes to
    `default_cache_dir()/<hash>`. If `out_dir` already holds a build of the same
    arguments nothing is written; a directory that holds something else is refused
    rather than overwritten, unless it is an older offbeat tiny-model build.
    """
    dtype_name = _dtype_name(dtype)
    spec = _resolve_spec(size, overrides)
    key = _build_key(spec, seed, float(initializer_range), dtype_name)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(out_dir) if out_dir is not None else default_cache_dir() / f"{size}-{digest}"

    marker = out / _MARKER
    if marker.is_file():
        with contextlib.suppress(OSError, ValueError):
            if json.loads(marker.read_text()).get("hash") == digest:
                return out
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"build_tiny_model: out_dir={str(out)!r} exists and is not an offbeat tiny-model "
            "build; pass an empty or new directory"
        )

    with atomic_build(out, _MARKER) as tmp:
        vocab_size = save_char_tokenizer(tmp, model_max_length=spec.max_position_embeddings)
        weights = _random_weights(
            spec, vocab_size, seed, float(initializer_range), _DTYPES[dtype_name]
        )
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_configs(tmp, spec, vocab_size, float(initializer_range), dtype_name)
        n_params = sum(t.numel() for t in weights.values())
        (tmp / _MARKER).write_text(
            json.dumps({"hash": digest, "num_parameters": n_params, **key}, indent=2) + "\n"
        )
    return out


# A model path `offbeat-tiny:<size>` names one of these, built locally on first use.
TINY_PREFIX = "offbeat-tiny:"
