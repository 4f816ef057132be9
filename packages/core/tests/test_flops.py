"""The FLOPs estimator against counts worked out by hand, the peak table, and MFU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from offbeat.core.train.flops import (
    PEAK_TFLOPS,
    DecoderShape,
    decoder_shape_of,
    device_name,
    peak_tflops,
    perf_metrics,
    training_flops,
)

# A toy decoder small enough to count on paper.
TOY = DecoderShape(
    hidden_size=4,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=2,
    intermediate_size=8,
    vocab_size=10,
)

# Qwen2-7B's config.json values.
QWEN2_7B = SimpleNamespace(
    model_type="qwen2",
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
)


def test_toy_matmul_params_by_hand():
    # per layer: attention 4 x (q 4 + k 2 + v 2 + o 4) = 48, MLP 3 x 4 x 8 = 96 -> 144;
    # 2 layers = 288; embedding + LM head 2 x 10 x 4 = 80.
    assert TOY.matmul_params == 288 + 80


def test_toy_training_flops_by_hand():
    # dense: 6 x 368 x (3 + 5) = 17664; attention: 6 x (9 + 25) x head_dim 2 x heads 2 x
    # layers 2 = 1632.
    assert training_flops(TOY, [3, 5]) == 17664 + 1632


def test_attention_term_grows_with_the_square_of_each_sequence():
    one_long = training_flops(TOY, [8])
    two_short = training_flops(TOY, [4, 4])
    # Same tokens (same dense part); attention 6 x (64 - 32) x 2 x 2 x 2 more.
    assert one_long - two_short == 6 * (64 - 32) * 2 * 2 * 2


def test_qwen2_7b_from_its_hf_config():
    shape = DecoderShape.from_hf_config(QWEN2_7B)
    assert shape.head_dim == 128
    # per layer: 3584 x (3584 + 2 x 4 x 128 + 3584) = 29,360,128 attention and
    # 3 x 3584 x 18944 = 203,685,888 MLP; x 28 + 2 x 152064 x 3584 = 7,615,283,200.
    assert shape.matmul_params == 7_615_283_200
    # one 4096-token sequence: 6 x N x 4096 + 6 x 4096^2 x 128 x 28 x 28
    assert training_flops(shape, [4096]) == 197_254_963_003_392
    assert training_flops(shape, [1000, 3000]) == 188_787_916_800_000


def test_head_dim_given_in_the_config_wins():
    cfg = SimpleNamespace(**{**vars(QWEN2_7B), "head_dim": 64})
    assert DecoderShape.from_hf_config(cfg).head_dim == 64


def test_text_config_of_a_multimodal_config_is_used():
    shape = DecoderShape.from_hf_config(SimpleNamespace(text_config=QWEN2_7B))
    assert shape.vocab_size == 152064


def test_config_without_decoder_sizes_names_what_is_missing():
    with pytest.raises(ValueError, match="intermediate_size"):
        DecoderShape.from_hf_config(SimpleNamespace(hidden_size=8, num_hidden_layers=1))


def test_decoder_shape_of_a_model_or_none():
    assert decoder_shape_of(SimpleNamespace(config=QWEN2_7B)).num_hidden_layers == 28
    assert decoder_shape_of(SimpleNamespace()) is None  # no config: no FLOPs count
    assert decoder_shape_of(SimpleNamespace(config=SimpleNamespace(hidden_size=8))) is None


def test_device_name_of_a_cpu_has_no_peak():
    import torch

    assert peak_tflops(device_name(torch.device("cpu"))) is None


def test_peak_table_vendor_and_measured_h200():
    assert peak_tflops("NVIDIA H200", "bfloat16") == 989.0
    measured = peak_tflops("NVIDIA H200", "bfloat16", measured=True)
    assert measured is not None and 0 < measured < 989.0
    assert PEAK_TFLOPS["H200"].how_measured


def test_peak_lookup_prefers_the_longest_key():
    assert peak_tflops("NVIDIA H20", "bfloat16") == 148.0
    assert peak_tflops("NVIDIA H200", "bfloat16") == 989.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0


def test_unknown_device_or_dtype_has_no_peak():
    assert peak_tflops("cpu", "float32") is None
    assert peak_tflops("NVIDIA H20", "float32") is None
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bfloat16", measured=True) is None


def test_perf_metrics_per_device_and_mfu():
    # 989e12 x 2 devices x 0.5 s of FLOPs at half the time: 50% of the peak.
    out = perf_metrics(flops=989e12, seconds=1.0, num_devices=2, peak=989.0)
    assert out["perf/tflops_per_device"] == pytest.approx(494.5)
    assert out["perf/mfu"] == pytest.approx(0.5)


def test_perf_metrics_without_a_peak_or_time():
    assert perf_metrics(1e12, 2.0, 1, None) == {"perf/tflops_per_device": 0.5}
    assert perf_metrics(1e12, 0.0, 1, 989.0) == {}
