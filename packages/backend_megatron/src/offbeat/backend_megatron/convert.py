"""HF <-> Megatron-Core weight conversion for the dense Qwen2 / Llama family: one table of
names, how HF tensors fuse into a Megatron tensor, and along which dimension tensor
parallelism splits it.

Knows nothing about models, processes or megatron itself (plain torch tensors in and
out): the engine asks it for the HF names of one Megatron parameter, fuses or splits one
parameter at a time, and cuts or joins its TP shards. Layouts it handles:

- ``linear_qkv``: Megatron fuses Q, K and V grouped by KV head (GQA): for each of the
  ``num_query_groups`` groups, its ``heads / groups`` query heads, then its key head, then
  its value head. TP splits whole groups (dim 0), so the groups must divide by TP.
- ``linear_fc1``: gate and up fused, each TP rank holding ``[gate_r; up_r]``: the full
  tensor here is ``[gate; up]`` and a rank's shard takes its rows of each.
- vocabulary rows (embedding, output layer) are padded to a multiple of the TP size and
  split along dim 0; the padding never reaches HF.
- row-parallel weights (``linear_proj``, ``linear_fc2``) split along dim 1; norms are whole.

Two layer layouts name the same weights: ``gpt`` (GPTModel: layer i holds attention and
MLP) and ``hybrid`` (HybridModel with the pattern ``*-`` per decoder layer: layer 2i is
the attention layer, 2i+1 the MLP layer).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "DecoderSpec",
    "hf_names_of",
    "hf_to_megatron",
    "join_tp_shards",
    "megatron_names",
    "megatron_to_hf",
    "split_tp_shard",
    "tp_split_dim",
]

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
LAYOUTS = ("gpt", "hybrid")


@dataclass(frozen=True)
class DecoderSpec:
    """The shape facts conversion needs, read from a HF config (`from_hf_config`)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    layout: str = "gpt"
    # The vocabulary rows of the Megatron tensors are padded to a multiple of this (the TP
    # size: each rank must hold the same number of rows).
    vocab_multiple: int = 1

    @classmethod
    def from_hf_config(
        cls, config: Any, layout: str = "gpt", vocab_multiple: int = 1
    ) -> DecoderSpec:
        """From a `transformers` config of a supported model type; anything this table
        cannot represent (biases outside QKV, another model type) is refused by name."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r}: the Megatron engine converts {SUPPORTED_MODEL_TYPES}"
            )
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}: must be one of {LAYOUTS}")
        for key in ("mlp_bias",) + (("attention_bias",) if model_type == "llama" else ()):
            if getattr(config, key, False):
                raise ValueError(f"{model_type} with {key}=True: not in the conversion table")
        heads = int(config.num_attention_heads)
        groups = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=int(head_dim),
            ffn_hidden_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            layout=layout,
            vocab_multiple=int(vocab_multiple),
        )

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_multiple
        return -(-self.vocab_size // m) * m

    def attention_layer(self, layer: int) -> int:
        """The Megatron layer index that holds HF layer `layer`'s attention."""
        return 2 * layer if self.layout == "hybrid" else layer

    def mlp_layer(self, layer: int) -> int:
        return 2 * layer + 1 if self.layout == "hybrid" else layer

    @property
    def final_norm(self) -> str:
        return (
            "decoder.final_norm.weight"
            if self.layout == "hybrid"
            else "decoder.final_layernorm.weight"
        )


# kind: how HF tensors fuse. tp: the TP split dimension (None: every rank holds it all).
@dataclass(frozen=True)
class _Rule:
    megatron: str  # name with {a} (attention layer) / {m} (MLP layer) placeholders
    hf: tuple[str, ...]  # names with {i} (HF layer)
    kind: str  # "copy" | "qkv" | "gate_up" | "vocab"
    tp: int | None


_LAYER_RULES = (
    _Rule("decoder.layers.{a}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "copy", None),
    _Rule(
        "decoder.layers.{a}.self_attention.linear_qkv.weight",
        tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"),
        "qkv", 0,
    ),
    _Rule(
        "decoder.layers.{a}.self_attention.linear_qkv.bias",
        tuple(f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"),
        "qkv", 0,
    ),
    _Rule("decoder.layers.{a}.self_attention.linear_proj.weight", ("model.layers.{i}.self_attn.o_proj.weight",), "copy", 1),
    _Rule("decoder.layers.{m}.pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",), "copy", None),
    _Rule(
        "decoder.layers.{m}.mlp.linear_fc1.weight",
        ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
        "gate_up", 0,
    ),
    _Rule("decoder.layers.{m}.mlp.linear_fc2.weight", ("model.layers.{i}.mlp.down_proj.weight",), "copy", 1),
)  # fmt: skip


def _rules(spec: DecoderSpec) -> Iterator[tuple[str, tuple[str, ...], str, int | None]]:
    """(Megatron name, HF names, kind, TP dim) of every parameter, in model order."""
    yield "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0
    for i in range(spec.num_layers):
        for r in _LAYER_RULES:
            if r.megatron.endswith("linear_qkv.bias") and not spec.qkv_bias:
                continue
            name = r.megatron.format(a=spec.attention_layer(i), m=spec.mlp_layer(i))
            yield name, tuple(h.format(i=i) for h in r.hf), r.kind, r.tp
    yield spec.final_norm, ("model.norm.weight",), "copy", None
    if not spec.tied:
        yield "output_layer.weight", ("lm_head.weight",), "vocab", 0


_TABLES: dict[DecoderSpec, dict[str, tuple[tuple[str, ...], str, int | None]]] = {}


def _table(spec: DecoderSpec) -> dict[str, tuple[tuple[str, ...], str, int | None]]:
    if spec not in _TABLES:
        _TABLES[spec] = {name: (hf, kind, tp) for name, hf, kind, tp in _rules(spec)}
    return _TABLES[spec]


def _rule(spec: DecoderSpec, name: str) -> tuple[tuple[str, ...], str, int | None]:
    table = _table(spec)
    if name not in table:
        raise KeyError(f"{name!r} is not a Megatron parameter of this {spec.layout} model")
    return table[name]


def megatron_names(spec: DecoderSpec) -> list[str]:
    """Every Megatron parameter name of the model, in model order."""
    return list(_table(spec))


def hf_names_of(spec: DecoderSpec, name: str) -> tuple[str, ...]:
    """The HF names that Megatron parameter `name` is made of."""
    return _rule(spec, name)[0]


def tp_split_dim(spec: DecoderSpec, name: str) -> int | None:
    """The dimension TP splits `name` along (None: replicated on every TP rank)."""
    return _rule(spec, name)[2]


# ------------------------------------------------------------------ fuse / split
def _fuse_qkv(spec: DecoderSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, d = spec.num_query_groups, spec.head_dim
    per = spec.num_attention_heads // g
    rest = q.shape[1:]
    grouped = torch.cat(
        [q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1
    )
    return grouped.reshape(g * (per + 2) * d, *rest)


def _split_qkv(spec: DecoderSpec, fused: torch.Tensor) -> list[torch.Tensor]:
    g, d = spec.num_query_groups, spec.head_dim
    per = spec.num_attention_heads // g
    rest = fused.shape[1:]
    grouped = fused.reshape(g, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def _pad_vocab(spec: DecoderSpec, t: torch.Tensor) -> torch.Tensor:
    extra = spec.padded_vocab_size - t.shape[0]
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


def hf_to_megatron(
    spec: DecoderSpec, name: str, get: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The full (unsharded) Megatron tensor `name`, made from the HF tensors that `get`
    returns by name (a mapping, or a function such as a safetensors reader)."""
    fetch = get.__getitem__ if isinstance(get, Mapping) else get
    hf, kind, _ = _rule(spec, name)
    parts = [fetch(h) for h in hf]
    if kind == "qkv":
        return _fuse_qkv(spec, *parts)
    if kind == "gate_up":
        return torch.cat(parts, dim=0)
    if kind == "vocab":
        return _pad_vocab(spec, parts[0])
    return parts[0]


def megatron_to_hf(
    spec: DecoderSpec, name: str, full: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of the full Megatron tensor `name` (vocab padding dropped)."""
    hf, kind, _ = _rule(spec, name)
    if kind == "qkv":
        parts = _split_qkv(spec, full)
    elif kind == "gate_up":
        parts = [t.contiguous() for t in torch.chunk(full, 2, dim=0)]
    elif kind == "vocab":
        parts = [full[: spec.vocab_size].contiguous()]
    else:
        parts = [full]
    return list(zip(hf, parts, strict=True))


def split_tp_shard(
    spec: DecoderSpec, name: str, full: torch.Tensor, rank: int, size: int
) -> torch.Tensor:
    """TP rank `rank`'s shard (of `size`) of the full Megatron tensor `name`."""
    _, kind, dim = _rule(spec, name)
    if dim is None or size == 1:
        return full
    if kind == "gate_up":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]]).contiguous()
    if full.shape[dim] % size:
        raise ValueError(f"{name}: dim {dim} of {tuple(full.shape)} does not split over TP={size}")
    return full.chunk(size, dim=dim)[rank].contiguous()


def join_tp_shards(spec: DecoderSpec, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor `name` from its TP shards in rank order."""
    _, kind, dim = _rule(spec, name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if kind == "gate_up":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def global_name(local: str, offset: int) -> str:
    """A pipeline stage's parameter name with its layer index moved by the stage's first
    Megatron layer `offset` (stage-local names count from 0)."""
    m = _LAYER.match(local)
    return f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else local
