"""What needs no server: the update plan, sampling names, launch flags, the package's
imports and its registration."""

from __future__ import annotations

import subprocess
import sys

import pytest

from offbeat.ckpt_engine.target import ReceiveSpec
from offbeat.rollout_sglang._process import server_args_to_cli
from offbeat.rollout_sglang._sampling import to_sglang_sampling
from offbeat.rollout_sglang._weights import update_plan


def test_plan_names_what_a_broadcast_channel_lacks():
    with pytest.raises(ValueError, match=r"lacks \['names', 'dtypes', 'shapes'\]"):
        update_plan(
            ReceiveSpec("broadcast", 1, {"master_address": "h", "master_port": 1, "world_size": 2}),
            session=True,
        )


def test_plan_refuses_offbeat_disk_buckets_and_unknown_backends():
    with pytest.raises(ValueError, match="names no 'model_path'"):
        update_plan(ReceiveSpec("disk", 1, {"directory": "/tmp/buckets"}), session=True)
    with pytest.raises(ValueError, match=r"use one of \['broadcast', 'cuda_ipc', 'disk'\]"):
        update_plan(ReceiveSpec("naive", 1, {}), session=True)


def test_plan_wraps_tensor_updates_only_when_asked():
    spec = ReceiveSpec("cuda_ipc", 4, {"serialized_named_tensors": ["x"]})
    assert [e for e, _ in update_plan(spec, session=False)] == ["/update_weights_from_tensor"]
    assert [e for e, _ in update_plan(spec, session=True)] == [
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/end_weight_update",
    ]


def test_sampling_renames_and_refuses_clashes():
    params = {"max_tokens": 8, "seed": 1, "min_tokens": 2, "top_p": 0.9, "stop": None}
    assert to_sglang_sampling(params) == {
        "max_new_tokens": 8,
        "sampling_seed": 1,
        "min_new_tokens": 2,
        "top_p": 0.9,
    }
    assert params["max_tokens"] == 8
    with pytest.raises(ValueError, match="max_new_tokens=9"):
        to_sglang_sampling({"max_tokens": 8, "max_new_tokens": 9})
    with pytest.raises(ValueError, match="n=2"):
        to_sglang_sampling({"n": 2})
    with pytest.raises(ValueError, match="max_tokens=0"):
        to_sglang_sampling({"max_tokens": 0})


def test_server_args_become_launch_flags():
    assert server_args_to_cli(
        {"tp_size": 2, "enable_memory_saver": True, "disable_radix_cache": False, "x": None}
    ) == ["--tp-size", "2", "--enable-memory-saver"]


CHECK = """
import sys
import offbeat.rollout_sglang, offbeat.core.rollout, offbeat.core.config
from offbeat.core.registry import ROLLOUT_ENGINES
from offbeat.rollout_sglang.replica import sglang_replica
assert ROLLOUT_ENGINES.get("sglang") is sglang_replica, ROLLOUT_ENGINES.names()
bad = sorted(m for m in sys.modules if m.split(".")[0] in {"sglang", "sgl_kernel", "vllm"})
print(",".join(bad) or "ok")
"""


def test_registered_as_sglang_without_importing_sglang():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_rollout_engine_sglang_passes_check():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "offbeat.core.cli",
            "check",
            "separate_async",
            "rollout.engine=sglang",
            # the recipe's vLLM arguments, dropped (validation names them otherwise)
            "rollout.engine_kwargs.max_model_len=null",
            "rollout.engine_kwargs.enforce_eager=null",
            "rollout.engine_kwargs.max_num_seqs=null",
            "rollout.engine_kwargs.seed=null",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "is valid" in out.stdout


def test_the_job_owns_dtype_parallelism_and_tokenizer():
    from types import SimpleNamespace

    from offbeat.rollout_sglang.replica import server_args_of

    job = SimpleNamespace(
        model=SimpleNamespace(
            dtype="bfloat16",
            trust_remote_code=False,
            override_config={"rope_theta": 1e6},
            tokenizer_path="/tok",
        ),
        rollout=SimpleNamespace(tensor_parallel_size=2, engine_kwargs={"mem_fraction_static": 0.6}),
    )
    assert server_args_of(job) == {
        "dtype": "bfloat16",
        "tp_size": 2,
        "trust_remote_code": False,
        "json_model_override_args": '{"rope_theta": 1000000.0}',
        "tokenizer_path": "/tok",
        "mem_fraction_static": 0.6,
    }


def test_vllm_engine_kwargs_are_named_with_their_sglang_names():
    from types import SimpleNamespace

    from offbeat.rollout_sglang.replica import server_args_of

    job = SimpleNamespace(
        rollout=SimpleNamespace(engine_kwargs={"max_model_len": 128, "enforce_eager": True})
    )
    with pytest.raises(ValueError) as e:
        server_args_of(job)
    assert "rollout.engine_kwargs.enforce_eager=True is vLLM's" in str(e.value)
    assert "SGLang's is disable_cuda_graph" in str(e.value)
    assert "rollout.engine_kwargs.max_model_len=128 is vLLM's" in str(e.value)
    assert "SGLang's is context_length" in str(e.value)


def test_the_recipes_vllm_engine_kwargs_fail_validation_and_null_drops_them():
    """Before anything starts (`offbeat check`): each vLLM key of the recipe's YAML is named
    with SGLang's; set to null, it is left out of the launch flags."""
    from offbeat.core.cli import load_recipe_config
    from offbeat.core.config.validation import ConfigError
    from offbeat.rollout_sglang.replica import server_args_of

    with pytest.raises(ConfigError) as e:
        load_recipe_config("separate_async", ["rollout.engine=sglang"])
    text = str(e.value)
    for k, theirs in [("max_model_len", "context_length"), ("enforce_eager", "disable_cuda_graph")]:
        assert f"rollout.engine_kwargs.{k}" in text and f"SGLang's is {theirs}" in text
    drop = ["max_model_len", "enforce_eager", "max_num_seqs", "seed"]
    _, cfg = load_recipe_config(
        "separate_async",
        ["rollout.engine=sglang", "rollout.engine_kwargs.context_length=128"]
        + [f"rollout.engine_kwargs.{k}=null" for k in drop],
    )
    args = server_args_of(cfg)
    assert args["context_length"] == 128 and not set(drop) & set(args)
