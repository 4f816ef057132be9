"""Building a Megatron-Core decoder from a HF config, and filling it from HF safetensors.

Knows nothing about losses, optimizers or batches: `build_model` turns a Qwen2/Llama HF
config into this pipeline stage's Megatron model (the local layer spec, attention through
torch's scaled_dot_product_attention, causal only: the engine packs each row's real
tokens to the left, so no mask is ever needed), and `load_hf_weights` copies each of its
parameters from the HF files, one full tensor at a time.

Which model class: `GPTModel` on every installed megatron-core. From 0.19 GPTModel logs a
deprecation in favour of `HybridModel` (pattern ``*-`` per decoder layer), but 0.19's
HybridStack builds its final norm with Transformer Engine's `TENorm` whatever the spec
says, so without Transformer Engine (our CPUs, and GPU hosts without it) HybridModel
cannot be built at all. `model_class()` is the one place that choice lives; the
conversion table already knows the hybrid layout.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from offbeat.backend_megatron.convert import (
    DecoderSpec,
    global_name,
    hf_to_megatron,
    split_tp_shard,
    tp_split_dim,
)

__all__ = ["build_model", "hf_config", "layer_offset", "load_hf_weights", "model_class"]


def hf_config(path: str, trust_remote_code: bool = False, override: dict | None = None) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    for key, value in (override or {}).items():
        if not hasattr(config, key):
            raise ValueError(f"model.override_config.{key}: the HF config has no such key")
        setattr(config, key, value)
    scaling = getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(
            f"rope_scaling={scaling!r}: the Megatron engine builds plain RoPE only "
            "(rope_type 'default')"
        )
    return config


def model_class() -> str:
    """'gpt' (see the module docstring for why not 'hybrid' yet)."""
    return "gpt"


def _sdpa_attention_class() -> type:
    from megatron.core.transformer.module import MegatronModule

    class SDPAttention(MegatronModule):
        """Megatron's core-attention slot filled by torch's SDPA, causal only (flash or
        memory-efficient kernels on GPUs; no [s, s] scores kept). Heads arrive TP-local."""

        def __init__(self, config, layer_number, attn_mask_type, *args, **kwargs) -> None:
            super().__init__(config=config)
            self.softmax_scale = kwargs.get("softmax_scale")

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            if attention_mask is not None:
                raise ValueError("SDPAttention is causal only: pack rows instead of masking")
            # [s, b, heads, d] -> [b, heads, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            if k.shape[1] != q.shape[1]:  # GQA: each KV head serves heads/groups queries
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SDPAttention


def transformer_config(
    config: Any,
    *,
    tp: int,
    pp: int,
    dtype: torch.dtype,
    sequence_parallel: bool,
    on_cpu: bool,
) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec = DecoderSpec.from_hf_config(config)
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        perform_initialization=False,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # dense: unused, but allgather refuses variable lengths
    )


def build_model(hf: Any, tconfig: Any, spec: DecoderSpec) -> torch.nn.Module:
    """This pipeline stage's GPTModel (vocabulary padded to `spec.padded_vocab_size`),
    parameters uninitialised: `load_hf_weights` fills them."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    layer_spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class()
    return GPTModel(
        config=tconfig,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.padded_vocab_size,
        max_sequence_length=int(getattr(hf, "max_position_embeddings", 4096)),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tied,
        position_embedding_type="rope",
        rotary_base=int(getattr(hf, "rope_theta", 10000)),
        rotary_percent=1.0,
        parallel_output=True,
    )


def keep_rope_on_cpu(model: torch.nn.Module) -> None:
    """Megatron's RoPE moves its frequencies to ``torch.cuda.current_device()`` on the first
    forward whenever they are on the CPU; a CPU model computes them where they are (the
    same formula: non-interleaved halves, as HF's rotate_half)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def get_emb(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        if self.rotary_interleaved:
            raise ValueError("interleaved RoPE is not what HF Qwen2/Llama use")
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.get_emb = types.MethodType(get_emb, module)


def checkpoint_layers(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in backward (torch's non-reentrant checkpoint: no CUDA
    RNG bookkeeping, which Megatron's own recompute needs and a CPU has not; our dropout
    is 0, so nothing random is replayed)."""
    from torch.utils.checkpoint import checkpoint

    for layer in model.decoder.layers:
        forward = layer.forward

        def recomputed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = recomputed


def layer_offset(model: torch.nn.Module) -> int:
    """The global index of this stage's first decoder layer (layer_number is 1-based and
    global in Megatron)."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    return int(layers[0].layer_number) - 1 if layers is not None and len(layers) else 0


def _safetensors_reader(path: str) -> Callable[[str], torch.Tensor]:
    """A function name -> tensor over the HF checkpoint in `path` (sharded or not); each
    call reads that one tensor."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            where = json.load(f)["weight_map"]
    else:
        files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        if len(files) != 1:
            raise FileNotFoundError(f"{path!r}: expected one .safetensors file or an index")
        where = None
        single = files[0]

    def read(name: str) -> torch.Tensor:
        file = where.get(name) if where is not None else single
        if file is None:
            raise KeyError(f"{name!r} is not in the HF checkpoint at {path!r}")
        with safe_open(os.path.join(path, file), framework="pt") as f:
            return f.get_tensor(name)

    return read


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module, spec: DecoderSpec, path: str, tp_rank: int, tp_size: int
) -> int:
    """Copy every parameter of this stage from the HF checkpoint at `path` (fused and cut
    to this TP rank's shard); returns how many were filled. A tied output layer on the last
    stage is filled from the embedding."""
    read = _safetensors_reader(path)
    offset = layer_offset(model)
    filled = 0
    for local, param in model.named_parameters():
        name = global_name(local, offset)
        if name == "output_layer.weight" and spec.tied:
            name = "embedding.word_embeddings.weight"
        full = hf_to_megatron(spec, name, read)
        shard = split_tp_shard(spec, name, full, tp_rank, tp_size)
        if shard.shape != param.shape:
            raise ValueError(
                f"{name}: HF gives {tuple(shard.shape)}, the model has {tuple(param.shape)}"
            )
        param.copy_(shard.to(param.dtype))
        dim = tp_split_dim(spec, name)
        if dim is not None and tp_size > 1:
            # Megatron marks TP-split weights only when it initialises them itself; the grad
            # norm (ours and Megatron's optimizer's) counts a parameter without the mark once,
            # as if every TP rank held the same copy.
            param.tensor_model_parallel, param.partition_dim = True, dim
            param.partition_stride = getattr(param, "partition_stride", 1)
        filled += 1
    return filled
