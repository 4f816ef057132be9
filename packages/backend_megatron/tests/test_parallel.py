"""The engine over several processes equals the engine in one: tensor parallelism (TP
shards gathered on export, vocabulary-parallel log-probs and their gradient, the grad norm
over TP shards) and data parallelism on CPU with gloo; TP, PP and bf16 against FSDP2 on
GPUs (`gpu`). Each run is `parallel_worker.py` under torch.distributed.run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import LR, TIMED, tiny_model_dir

WORKER = str(Path(__file__).with_name("parallel_worker.py"))


def run(model_dir: Path, out: Path, nproc: int, *, tp: int = 1, pp: int = 1, **kw) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", WORKER, str(model_dir), str(out), f"--tp={tp}", f"--pp={pp}",
    ] + [f"--{k}={v}" for k, v in kw.items()]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = torch.load(out / "r.pt")
    assert got["world"] == nproc
    return got


def assert_same_run(got: dict, want: dict, atol_lp: float = 1e-5, rel: float = 1e-4) -> None:
    """Same weights before (bit for bit), same log-probs, and an update that moves every
    parameter to the same place up to Adam's bound for float-rounding gradient noise."""
    assert sorted(got["before"]) == sorted(want["before"])
    for name, tensor in want["before"].items():
        assert torch.equal(got["before"][name], tensor), name
    torch.testing.assert_close(got["log_probs"], want["log_probs"], atol=atol_lp, rtol=0)
    for name, tensor in want["after"].items():
        # lr * g / (|g| + eps) moves at most lr per step; rounding in g moves it far less.
        torch.testing.assert_close(got["after"][name], tensor, atol=LR * 1e-2, rtol=0, msg=name)
    for key in set(want["metrics"]) - set(TIMED):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=rel, abs=1e-6), key


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"), tied=False)


@pytest.fixture(scope="module")
def one_process(model_dir, tmp_path_factory) -> dict:
    return run(model_dir, tmp_path_factory.mktemp("tp1"), 1)


@pytest.mark.slow
def test_tensor_parallel_2_equals_one_process_on_cpu(model_dir, one_process, tmp_path):
    from safetensors.torch import load_file

    got = run(model_dir, tmp_path, 2, tp=2)
    assert got["optimizer"] == "torch"
    assert_same_run(got, one_process)
    hf = load_file(str(model_dir / "model.safetensors"))  # the TP export is the HF checkpoint
    assert sorted(hf) == sorted(got["before"])
    assert all(torch.equal(got["before"][k], v) for k, v in hf.items())


@pytest.mark.slow
def test_data_parallel_2_equals_one_process_on_cpu(model_dir, one_process, tmp_path):
    got = run(model_dir, tmp_path, 2)
    assert_same_run(got, one_process)


gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_2_gpus = pytest.mark.skipif(gpus < 2, reason="needs 2 CUDA devices")


@pytest.mark.gpu
@needs_2_gpus
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_tp2_and_pp2_equal_one_gpu(model_dir, tmp_path, tp, pp):
    want = run(model_dir, tmp_path / "one", 1, device="cuda")
    got = run(model_dir, tmp_path / "two", 2, tp=tp, pp=pp, device="cuda")
    assert want["optimizer"] == got["optimizer"] == "megatron"
    # GPU matmuls (TF32 off by default, but other reduction orders) round differently.
    assert_same_run(got, want, atol_lp=1e-4, rel=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(gpus < 1, reason="needs a CUDA device")
def test_bf16_update_matches_fsdp2_within_bf16_tolerance(model_dir, tmp_path):
    """bf16 compute on both sides (float32 master weights): the log-probs agree to bf16
    precision and the two updates point the same way (cosine of the weight deltas)."""
    import engine_helpers as h
    from safetensors.torch import load_file

    got = run(model_dir, tmp_path / "megatron", 1, device="cuda", dtype="bfloat16")
    engine = h.fsdp2(model_dir, loss=h.LOSSES["decoupled_entropy"], device="cuda",
                     param_dtype="bfloat16", export_dtype="float32")  # fmt: skip
    engine.config.micro_batch_size = 3  # the worker's micro-batches
    batch = h.make_batch(8, seed=5)
    torch.testing.assert_close(got["log_probs"], engine.compute_log_probs(batch), atol=5e-2, rtol=0)
    metrics = engine.update(h.with_old_log_probs(engine, batch))
    start = load_file(str(model_dir / "model.safetensors"))
    after = h.params(engine)
    for name, tensor in after.items():
        mine = (got["after"][name].float() - start[name]).flatten()
        theirs = (tensor.float() - start[name]).flatten()
        cos = torch.nn.functional.cosine_similarity(mine, theirs, dim=0)
        assert cos > 0.9, (name, float(cos))
    assert got["metrics"]["actor/loss"] == pytest.approx(metrics["actor/loss"], abs=5e-2)
