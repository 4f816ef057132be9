"""A job's model settings reach vLLM as the trainer applies them: dtype, HF config
overrides (`hf_overrides`), tokenizer and remote-code switch, tensor parallelism."""

from __future__ import annotations

import pytest

from offbeat.core.config.run import RunConfig
from offbeat.core.models import build_tiny_model
from offbeat.rollout_vllm.replica import engine_kwargs_of


def test_engine_kwargs_carry_what_the_job_owns():
    cfg = RunConfig()
    cfg.model.dtype = "bfloat16"
    cfg.model.override_config = {"rope_theta": 500000.0}
    cfg.model.tokenizer_path = "/models/tok"
    cfg.model.trust_remote_code = True
    cfg.rollout.tensor_parallel_size = 2
    cfg.rollout.engine_kwargs = {"max_model_len": 64}
    assert engine_kwargs_of(cfg) == {
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "trust_remote_code": True,
        "hf_overrides": {"rope_theta": 500000.0},
        "tokenizer": "/models/tok",
        "max_model_len": 64,
    }
    plain = engine_kwargs_of(RunConfig())
    assert "hf_overrides" not in plain and "tokenizer" not in plain


@pytest.mark.slow
def test_vllm_applies_the_overrides_to_the_model_config(tmp_path):
    from offbeat.rollout_vllm.compat import AsyncEngineArgs  # imports vLLM; starts no engine

    model = build_tiny_model(
        tmp_path / "m", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64,
    )  # fmt: skip
    cfg = RunConfig()
    cfg.model.override_config = {"rms_norm_eps": 0.5, "attention_dropout": 0.25}
    cfg.rollout.engine_kwargs = {"max_model_len": 64}
    hf = AsyncEngineArgs(model=str(model), **engine_kwargs_of(cfg)).create_model_config().hf_config
    assert (hf.rms_norm_eps, hf.attention_dropout) == (0.5, 0.25)
