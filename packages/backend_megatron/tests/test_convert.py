"""HF <-> Megatron conversion: a round trip through TP shards is bit-exact, and the fused
layouts are Megatron's (QKV grouped by KV head, gate/up halves per TP rank)."""

from __future__ import annotations

import pytest
import torch

from offbeat.backend_megatron.convert import (
    DecoderSpec,
    hf_names_of,
    hf_to_megatron,
    join_tp_shards,
    megatron_names,
    megatron_to_hf,
    split_tp_shard,
    tp_split_dim,
)


def hf_config(model_type: str = "qwen2", tied: bool = False, vocab: int = 259, **kw):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[model_type]
    args = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    return cls(**{**args, **kw})


def hf_state(config) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


CASES = [
    ("qwen2", False),  # QKV bias, untied
    ("qwen2", True),  # tied embeddings: no output layer
    ("llama", False),  # no QKV bias
]


@pytest.mark.parametrize("layout", ["gpt", "hybrid"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(("model_type", "tied"), CASES)
def test_round_trip_through_tp_shards_is_bit_exact(model_type, tied, tp, layout):
    config = hf_config(model_type, tied)
    hf = hf_state(config)
    spec = DecoderSpec.from_hf_config(config, layout=layout, vocab_multiple=tp)
    back: dict[str, torch.Tensor] = {}
    for name in megatron_names(spec):
        full = hf_to_megatron(spec, name, hf)
        shards = [split_tp_shard(spec, name, full, r, tp) for r in range(tp)]
        if tp > 1 and tp_split_dim(spec, name) is not None:
            assert all(s.numel() * tp == full.numel() for s in shards), name
        joined = join_tp_shards(spec, name, shards)
        assert torch.equal(joined, full), name
        for hf_name, tensor in megatron_to_hf(spec, name, joined):
            assert hf_name not in back, f"{hf_name} exported twice"
            back[hf_name] = tensor
    expected = {k for k in hf if not (tied and k == "lm_head.weight")}
    assert set(back) == expected
    for k in expected:
        assert back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]), k


def test_qkv_is_grouped_by_kv_head():
    config = hf_config("qwen2")
    hf = hf_state(config)
    spec = DecoderSpec.from_hf_config(config)
    g, d, h, per = 2, 4, 32, 4  # groups, head dim, hidden, query heads per group
    fused = hf_to_megatron(spec, "decoder.layers.1.self_attention.linear_qkv.weight", hf)
    grouped = fused.reshape(g, per + 2, d, h)
    q = hf["model.layers.1.self_attn.q_proj.weight"].reshape(g * per, d, h)
    k = hf["model.layers.1.self_attn.k_proj.weight"].reshape(g, d, h)
    v = hf["model.layers.1.self_attn.v_proj.weight"].reshape(g, d, h)
    for group in range(g):
        for j in range(per):
            assert torch.equal(grouped[group, j], q[group * per + j])
        assert torch.equal(grouped[group, per], k[group])
        assert torch.equal(grouped[group, per + 1], v[group])


def test_tp_shard_of_fc1_holds_its_rows_of_gate_and_of_up():
    config = hf_config("llama")
    hf = hf_state(config)
    spec = DecoderSpec.from_hf_config(config)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    full = hf_to_megatron(spec, name, hf)
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    shard = split_tp_shard(spec, name, full, 1, 2)
    assert torch.equal(shard, torch.cat([gate[24:], up[24:]]))
    # QKV: rank 1 of 2 holds the second KV group whole (4 query heads, k, v).
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(
        split_tp_shard(spec, qkv, hf_to_megatron(spec, qkv, hf), 1, 2),
        hf_to_megatron(spec, qkv, hf).reshape(2, -1, 32)[1],
    )


def test_vocab_rows_are_padded_to_the_tp_size_and_the_padding_never_reaches_hf():
    config = hf_config("qwen2", vocab=259)
    hf = hf_state(config)
    spec = DecoderSpec.from_hf_config(config, vocab_multiple=4)
    full = hf_to_megatron(spec, "output_layer.weight", hf)
    assert full.shape[0] == spec.padded_vocab_size == 260
    assert torch.equal(full[259], torch.zeros(32))
    [(name, back)] = megatron_to_hf(spec, "output_layer.weight", full)
    assert name == "lm_head.weight" and torch.equal(back, hf["lm_head.weight"])


def test_hybrid_layout_puts_attention_and_mlp_on_alternate_layers():
    spec = DecoderSpec.from_hf_config(hf_config("qwen2"), layout="hybrid")
    assert hf_names_of(spec, "decoder.layers.2.self_attention.linear_proj.weight") == (
        "model.layers.1.self_attn.o_proj.weight",
    )
    assert hf_names_of(spec, "decoder.layers.3.mlp.linear_fc2.weight") == (
        "model.layers.1.mlp.down_proj.weight",
    )


def test_unsupported_configs_are_named():
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        DecoderSpec.from_hf_config(type("C", (), {"model_type": "gpt2"})())
    with pytest.raises(ValueError, match="attention_bias=True"):
        DecoderSpec.from_hf_config(hf_config("llama", attention_bias=True))
    spec = DecoderSpec.from_hf_config(hf_config("qwen2"))
    with pytest.raises(KeyError, match="not a Megatron parameter"):
        hf_names_of(spec, "decoder.layers.9.mlp.linear_fc2.weight")
