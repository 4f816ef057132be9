"""FSDP2TrainEngine on a tiny random Qwen2, CPU + gloo: log-probs, PPO updates with
gradient accumulation, multi-process equivalence, weight export, save/load.

Run as a script under torchrun (`--worker`), this file is also the 2-process worker.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from offbeat.core.models import build_tiny_model
from offbeat.core.train import (
    FSDP2Config,
    FSDP2TrainEngine,
    OptimConfig,
    PPOLoss,
    PPOLossConfig,
    build_train_engine,
)

VOCAB = 260  # the character tokenizer's vocabulary


def tiny_model_dir(root: Path, tied: bool = False) -> Path:
    return build_tiny_model(
        root / ("tied" if tied else "untied"),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=tied,
        initializer_range=0.1,
    )


def make_batch(rows: int, prompt: int = 6, response: int = 7, seed: int = 0) -> dict:
    """Left-padded prompts, right-padded responses of varied lengths, PPO fields."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (rows, prompt + response), generator=g)
    attention_mask = torch.ones(rows, prompt + response, dtype=torch.long)
    response_mask = torch.zeros(rows, response)
    for i in range(rows):
        p_len = int(torch.randint(1, prompt + 1, (1,), generator=g))
        r_len = int(torch.randint(1, response + 1, (1,), generator=g))
        attention_mask[i, : prompt - p_len] = 0
        attention_mask[i, prompt + r_len :] = 0
        response_mask[i, :r_len] = 1
    input_ids = input_ids * attention_mask
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, response) * response_mask,
        # Off-policy: the behaviour log-probs differ from the current policy's.
        "old_log_probs_noise": torch.randn(rows, response, generator=g) * 0.1,
    }


def rows_of(batch: dict, start: int, stop: int) -> dict:
    return {k: v[start:stop] for k, v in batch.items()}


def make_engine(
    model_dir: Path,
    micro_batch_size: int = 4,
    loss: PPOLossConfig | None = None,
    device: str = "cpu",
    engine: dict | None = None,
    **optim,
) -> FSDP2TrainEngine:
    defaults = {"lr": 1e-2, "weight_decay": 0.01, "grad_clip": 1.0}
    config = FSDP2Config(
        model_path=str(model_dir),
        device=device,
        micro_batch_size=micro_batch_size,
        optim=OptimConfig(**{**defaults, **optim}),
        **(engine or {}),
    )
    return FSDP2TrainEngine(config, loss_fn=PPOLoss(loss or PPOLossConfig()))


def with_old_log_probs(engine: FSDP2TrainEngine, batch: dict) -> dict:
    """Decoupled PPO: proximal = the engine's start-of-step log-probs; the behaviour policy
    (the rollout's) is off by some noise."""
    proximal = engine.compute_log_probs(batch)
    behaviour = proximal + batch["old_log_probs_noise"] * batch["response_mask"]
    return {**batch, "old_log_probs": proximal, "rollout_log_probs": behaviour}


def params_of(engine: FSDP2TrainEngine) -> dict[str, torch.Tensor]:
    return {name: t.cpu().clone() for name, t in engine.export_weights()}


def grads_of(engine: FSDP2TrainEngine) -> dict[str, torch.Tensor]:
    """The last update's gradients (collective under FSDP: every rank calls it)."""
    return {n: p.grad.full_tensor().cpu() for n, p in engine.model.named_parameters()}


EPS = 1e-3
LR = 1e-2  # the accumulation tests' learning rate
# Metrics that measure the machine (memory, speed), not the update.
TIMED = ("actor/max_memory_gb", "perf/tflops_per_device", "perf/mfu")


def assert_same_update(got: tuple, want: tuple) -> None:
    """Gradients equal up to float rounding, and so are the updated parameters (the
    engines use AdamW with eps=EPS, so a rounding difference in a near-zero gradient cannot
    flip the sign of Adam's first, sign-like step). Adam's first step moves a parameter by
    lr * g / (|g| + eps), so a gradient difference dg moves it by at most lr * |dg| / eps:
    the parameters are held to that bound (lr = LR) plus float rounding."""
    (got_params, got_grads), (want_params, want_grads) = got, want
    assert sorted(got_params) == sorted(want_params)
    for name in want_params:
        scale = float(want_grads[name].abs().max()) or 1.0
        torch.testing.assert_close(
            got_grads[name], want_grads[name], atol=1e-5 * scale, rtol=1e-4, msg=name
        )
        dg = float((got_grads[name] - want_grads[name]).abs().max())
        atol = 1e-6 + 2 * LR * dg / EPS
        torch.testing.assert_close(got_params[name], want_params[name], atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", autouse=True)
def _own_process_group():
    """The engine starts a private 1-process group when none exists; leave none behind."""
    existed = dist.is_initialized()
    yield
    if not existed and dist.is_initialized():
        dist.destroy_process_group()


def test_log_probs_match_unsharded_model(model_dir):
    from transformers import AutoModelForCausalLM

    engine = make_engine(model_dir, micro_batch_size=2)
    batch = make_batch(5)
    temperature = 0.7
    got = engine.compute_log_probs(batch, temperature=temperature)

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mask = batch["attention_mask"]
    with torch.no_grad():
        logits = plain(
            input_ids=batch["input_ids"],
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        ).logits
    width = batch["response_mask"].shape[1]
    logp = torch.log_softmax(logits[:, -width - 1 : -1] / temperature, dim=-1)
    want = logp.gather(-1, batch["input_ids"][:, -width:, None]).squeeze(-1)
    want = want * batch["response_mask"]
    assert got.shape == (5, width)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got[batch["response_mask"] == 0] == 0).all()


def test_update_reduces_loss_on_fixed_batch(model_dir):
    engine = make_engine(model_dir, lr=3e-3)
    batch = with_old_log_probs(engine, make_batch(8, seed=1))
    losses = [engine.update(batch)["actor/loss"] for _ in range(4)]
    assert losses[-1] < losses[0], losses
    assert engine.global_update_count == 4


def test_micro_batches_and_optimizer_step_are_spans_of_the_active_trace(model_dir):
    from offbeat.core import trace

    engine = make_engine(model_dir, micro_batch_size=3)
    batch = with_old_log_probs(engine, make_batch(8, seed=1))
    tracer = trace.Tracer(None)
    token = trace.activate(tracer)
    try:
        with trace.span("mini-batch", "trainer/steps"):
            engine.update(batch)
        engine.compute_log_probs(batch)
    finally:
        trace.deactivate(token)
    events = [e for e in tracer.events() if e["ph"] == "X"]
    names = [e["name"] for e in events]
    # 8 rows in micro-batches of 3: 3 forward/backward passes, then one optimizer step
    assert (
        names
        == ["micro-batch"] * 3 + ["optimizer_step", "mini-batch"] + ["log_prob micro-batch"] * 3
    )
    assert [e["args"]["rows"] for e in events[:3]] == [3, 3, 2]
    assert {(e["pid"], e["tid"]) for e in events} == {tracer.track("trainer/steps")}
    assert trace.nesting_problems(events) == []
    engine.compute_log_probs(batch)  # no active tracer: nothing recorded, nothing fails


LOSSES = {
    "token-mean": PPOLossConfig(),
    "token-sum+kl": PPOLossConfig(loss_agg_mode="token-sum", use_kl_loss=True, kl_loss_coef=0.1),
    "seq-mean-token-sum+entropy": PPOLossConfig(
        loss_agg_mode="seq-mean-token-sum", entropy_coeff=0.01
    ),
    "seq-mean-token-sum-norm": PPOLossConfig(loss_agg_mode="seq-mean-token-sum-norm", horizon=9),
    "seq-mean-token-mean+masked-IS": PPOLossConfig(
        loss_agg_mode="seq-mean-token-mean",
        rollout_is_level="token",
        rollout_is_mode="mask",
        rollout_is_threshold=1.1,
    ),
}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_gradient_accumulation_matches_one_big_micro_batch(model_dir, loss):
    """Same mini-batch, micro-batches of 8 (one), 3 and 1 rows: with the global normaliser
    the accumulated gradient, hence the update, is the same for every aggregation mode."""
    batch = make_batch(8, seed=2)
    batch["ref_log_probs"] = -torch.rand(batch["response_mask"].shape) * batch["response_mask"]
    results = []
    for micro in (8, 3, 1):
        engine = make_engine(model_dir, micro, LOSSES[loss], grad_clip=0.0, eps=EPS)
        mb = with_old_log_probs(engine, batch)
        metrics = engine.update(mb)
        results.append(((params_of(engine), grads_of(engine)), metrics))
    (ref, ref_metrics), others = results[0], results[1:]
    for update, metrics in others:
        assert_same_update(update, ref)
        assert metrics["actor/loss"] == pytest.approx(ref_metrics["actor/loss"], rel=1e-5)
        assert metrics["actor/grad_norm"] == pytest.approx(ref_metrics["actor/grad_norm"], rel=1e-4)
        assert sorted(metrics) == sorted(ref_metrics)
        for name, value in ref_metrics.items():
            if name in TIMED:
                continue
            assert metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    if "masked-IS" in loss:  # the mask mode removed tokens from the normaliser
        assert ref_metrics["actor/num_tokens"] < batch["response_mask"].sum()
        assert ref_metrics["rollout_is/outside_frac"] > 0


def test_gradient_checkpointing_gives_the_same_update(model_dir):
    batch = make_batch(6, seed=3)
    results = []
    for checkpointing in (False, True):
        config = FSDP2Config(
            model_path=str(model_dir), device="cpu", micro_batch_size=4,
            gradient_checkpointing=checkpointing, optim=OptimConfig(lr=LR, eps=EPS),
        )  # fmt: skip
        engine = FSDP2TrainEngine(config)
        assert engine.model.is_gradient_checkpointing == checkpointing
        engine.update(with_old_log_probs(engine, batch))
        results.append((params_of(engine), grads_of(engine)))
    assert_same_update(results[1], results[0])  # and the exported names are still HF's


@pytest.mark.parametrize("tied", [False, True])
def test_export_yields_each_hf_parameter_once_one_at_a_time(tmp_path, monkeypatch, tied):
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir(tmp_path, tied=tied)
    engine = make_engine(model_dir)
    want = dict(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters()
    )

    gathered: list[weakref.ref] = []
    original = DTensor.full_tensor

    def watched(self, *args, **kwargs):
        alive = [r for r in gathered if r() is not None]
        assert not alive, "a previously exported full parameter is still referenced"
        out = original(self, *args, **kwargs)
        gathered.append(weakref.ref(out))
        return out

    monkeypatch.setattr(DTensor, "full_tensor", watched)
    seen = []
    for name, tensor in engine.export_weights():
        assert tensor.is_contiguous() and not tensor.requires_grad
        assert name in want, name
        torch.testing.assert_close(tensor, want[name].detach(), atol=0, rtol=0, msg=name)
        seen.append(name)
        del tensor  # a consumer that keeps nothing: the engine must keep nothing either
    assert sorted(seen) == sorted(want)  # every name, exactly once
    assert len(gathered) == len(want)
    assert ("lm_head.weight" in seen) == (not tied)


def test_export_dtype_casts(model_dir):
    config = FSDP2Config(model_path=str(model_dir), device="cpu", export_dtype="bfloat16")
    engine = FSDP2TrainEngine(config)
    name, tensor = next(iter(engine.export_weights()))
    assert tensor.dtype == torch.bfloat16 and name == "model.embed_tokens.weight"


def test_save_load_restores_model_optimizer_and_schedule(model_dir, tmp_path):
    optim = {"lr_schedule": "cosine", "warmup_updates": 1, "total_updates": 6, "lr": 5e-3}
    b1, b2, b3 = (make_batch(6, seed=s) for s in (10, 11, 12))
    a = make_engine(model_dir, **optim)
    a.update(with_old_log_probs(a, b1))
    a.update(with_old_log_probs(a, b2))
    ckpt = tmp_path / "ckpt"
    a.save(str(ckpt))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp dir left
    saved_lr = a.lr
    after_a = a.update(with_old_log_probs(a, b3))

    b = make_engine(model_dir, **optim)
    assert b.lr != saved_lr
    b.load(str(ckpt))
    assert b.global_update_count == 2 and b.lr == saved_lr
    after_b = b.update(with_old_log_probs(b, b3))
    for name in TIMED:
        after_a.pop(name, None), after_b.pop(name, None)
    assert after_b == after_a  # same loss, grad norm, LR: bit for bit
    for (name, x), (_, y) in zip(a.export_weights(), b.export_weights(), strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0, msg=name)

    # Saving again over an existing checkpoint replaces it.
    b.save(str(ckpt))
    c = make_engine(model_dir, **optim)
    c.load(str(ckpt))
    assert c.global_update_count == 3


def test_save_load_restores_the_ranks_rng_states(model_dir, tmp_path):
    """Each rank's torch, Python and NumPy RNG states go with the engine's checkpoint (one
    file per rank): draws after a load repeat the draws after the save."""
    import random

    import numpy as np

    a = make_engine(model_dir)
    a.save(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "rng_rank0.pt").is_file()
    after_save = (torch.rand(3), random.random(), np.random.rand())
    for _ in range(5):  # move every generator on
        torch.rand(7), random.random(), np.random.rand()
    make_engine(model_dir).load(str(tmp_path / "ckpt"))
    after_load = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(after_load[0], after_save[0])
    assert after_load[1:] == after_save[1:]


def test_save_before_any_update_changes_nothing(model_dir, tmp_path):
    """A checkpoint of an engine that never stepped: saving leaves its next update as it
    was, and a fresh engine that loads it makes the same update."""
    batch = make_batch(4, seed=30)
    never_saved = make_engine(model_dir)
    want = never_saved.update(with_old_log_probs(never_saved, batch))
    saved = make_engine(model_dir)
    saved.save(str(tmp_path / "ckpt"))
    loaded = make_engine(model_dir)
    loaded.load(str(tmp_path / "ckpt"))
    for engine in (saved, loaded):
        got = engine.update(with_old_log_probs(engine, batch))
        assert got["actor/loss"] == want["actor/loss"]
        assert got["actor/grad_norm"] == want["actor/grad_norm"]
        for (name, x), (_, y) in zip(
            engine.export_weights(), never_saved.export_weights(), strict=True
        ):
            torch.testing.assert_close(x, y, atol=0, rtol=0, msg=name)
    with pytest.raises(ValueError, match="saved before any update"):
        saved.load(str(tmp_path / "ckpt"))


def test_load_of_incomplete_checkpoint_fails_clearly(model_dir, tmp_path):
    engine = make_engine(model_dir)
    (tmp_path / "half").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete train-engine checkpoint"):
        engine.load(str(tmp_path / "half"))


def test_registry_builds_fsdp2_and_names_choices(model_dir):
    engine = build_train_engine("fsdp2", FSDP2Config(model_path=str(model_dir), device="cpu"))
    assert isinstance(engine, FSDP2TrainEngine) and engine.dp_size == 1
    with pytest.raises((KeyError, ValueError), match="fsdp2"):
        build_train_engine("nope", FSDP2Config(model_path=str(model_dir)))


def test_update_without_response_tokens_is_refused(model_dir):
    engine = make_engine(model_dir)
    batch = with_old_log_probs(engine, make_batch(2))
    with pytest.raises(KeyError, match="advantages"):
        engine.update({k: v for k, v in batch.items() if k != "advantages"})
    with pytest.raises(ValueError, match="no response tokens"):
        engine.update({**batch, "response_mask": torch.zeros_like(batch["response_mask"])})


def test_fused_log_probs_give_the_plain_paths_log_probs_and_update(model_dir):
    """The fused LM head (log-probs from hidden states and the head weight) against the
    plain logits -> log_softmax path: the same log-probs, loss, entropy and update."""
    loss = PPOLossConfig(entropy_coeff=0.01)  # the entropy's gradient path too
    runs = {}
    for fused in (True, False):
        engine = make_engine(model_dir, 3, loss, engine={"fused_log_probs": fused}, eps=EPS)
        assert (engine._head is not None) is fused
        batch = with_old_log_probs(engine, make_batch(ROWS, seed=4))
        metrics = engine.update(batch)
        runs[fused] = (batch["old_log_probs"], metrics, (params_of(engine), grads_of(engine)))
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=1e-5, rtol=1e-5)
    for key in ("actor/loss", "actor/entropy", "actor/grad_norm"):
        assert runs[True][1][key] == pytest.approx(runs[False][1][key], rel=1e-4), key
    assert_same_update(runs[True][2], runs[False][2])


class _Clock:
    """time.perf_counter for the engine: 10.0 at an update's start, 12.0 after."""

    def __init__(self) -> None:
        self.calls = 0

    def perf_counter(self) -> float:
        self.calls += 1
        return 10.0 if self.calls == 1 else 12.0


def test_update_reports_model_tflops_per_device_and_mfu(model_dir, monkeypatch):
    from offbeat.core.train import _rank, fsdp2
    from offbeat.core.train.flops import DecoderShape, training_flops

    def clock(monkeypatch):  # one clock for the update's start (`_rank`) and its end
        c = _Clock()
        monkeypatch.setattr(fsdp2, "time", c)
        monkeypatch.setattr(_rank, "time", c)

    batch = make_batch(6, seed=2)
    cpu = make_engine(model_dir, 4)
    with_peak = make_engine(model_dir, 4, engine={"peak_tflops": 1e-6})
    data = with_old_log_probs(cpu, batch)
    shape = DecoderShape.from_hf_config(cpu.model.config)
    flops = training_flops(shape, batch["attention_mask"].sum(-1).tolist())

    clock(monkeypatch)
    got = cpu.update(data)
    assert got["perf/tflops_per_device"] == pytest.approx(flops / 2.0 / 1e12)
    assert "perf/mfu" not in got  # no peak known for a CPU

    clock(monkeypatch)
    got = with_peak.update(data)
    assert got["perf/mfu"] == pytest.approx(flops / 2.0 / 1e12 / 1e-6)


def test_gather_weights_on_one_rank_equals_export(model_dir):
    engine = make_engine(model_dir)
    exported = params_of(engine)
    for prefetch in (0, 4096, 1 << 30):  # one parameter at a time, a few, all
        gathered = {n: t.clone() for n, t in engine.gather_weights(0, prefetch)}
        assert list(gathered) == list(exported)
        for name, tensor in exported.items():
            assert torch.equal(gathered[name], tensor), name
    with pytest.raises(ValueError, match="dst=1"):
        list(engine.gather_weights(1))


def test_peak_tflops_must_be_positive(model_dir):
    with pytest.raises(ValueError, match=r"train_engine.peak_tflops=0"):
        FSDP2Config(model_path=str(model_dir), peak_tflops=0).validate()


# ------------------------------------------------------------------ two processes
ROWS, SEED = 8, 21


def _reference_update(model_dir: Path, device: str = "cpu") -> tuple[tuple[dict, dict], dict]:
    engine = make_engine(model_dir, micro_batch_size=3, device=device, eps=EPS)
    batch = with_old_log_probs(engine, make_batch(ROWS, seed=SEED))
    metrics = engine.update(batch)
    return (params_of(engine), grads_of(engine)), metrics


def _worker(model_dir: str, out: str, device: str) -> None:
    """One rank of the 2-process run: its half of the same mini-batch. The engine joins
    the group torchrun describes (gloo on CPU; gloo + nccl on CUDA, one GPU per rank)."""
    engine = make_engine(Path(model_dir), micro_batch_size=3, device=device, eps=EPS)
    rank, world = dist.get_rank(), dist.get_world_size()
    full = make_batch(ROWS, seed=SEED)
    # Uneven shards (3 and 5 rows) make the ranks run different micro-batch counts.
    cut = 3
    mine = rows_of(full, 0, cut) if rank == 0 else rows_of(full, cut, ROWS)
    metrics = engine.update(with_old_log_probs(engine, mine))
    update = (params_of(engine), grads_of(engine))  # every rank: gathering is collective
    # Only rank 1 (the destination) gets full tensors; rank 0 sends its shards.
    gathered = {n: t.cpu().clone() for n, t in engine.gather_weights(dst=1, prefetch_bytes=4096)}
    assert rank == 1 or not gathered
    engine.save(os.path.join(out, "ckpt"))
    if rank == 1:
        torch.save(gathered, os.path.join(out, "gathered.pt"))
    if rank == 0:
        torch.save(
            {"update": update, "metrics": metrics, "world": world}, os.path.join(out, "r.pt")
        )
    dist.destroy_process_group()


def _run_two_ranks(model_dir: Path, out: Path, device: str) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        __file__, "--worker", str(model_dir), str(out), "--device", device,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(out / "r.pt")
    assert got["world"] == 2
    return got


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_nccl_ranks_match_one_rank(model_dir, tmp_path):
    got = _run_two_ranks(model_dir, tmp_path, "cuda")
    if dist.is_initialized():  # a CPU-only group from the tests above cannot run nccl
        dist.destroy_process_group()
    want_update, want_metrics = _reference_update(model_dir, device="cuda")
    assert_same_update(got["update"], want_update)
    assert got["metrics"]["actor/loss"] == pytest.approx(want_metrics["actor/loss"], rel=1e-5)


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(model_dir, tmp_path):
    got = _run_two_ranks(model_dir, tmp_path, "cpu")
    want_update, want_metrics = _reference_update(model_dir)
    assert_same_update(got["update"], want_update)
    assert got["metrics"]["actor/loss"] == pytest.approx(want_metrics["actor/loss"], rel=1e-5)
    gathered = torch.load(tmp_path / "gathered.pt")  # gather_weights onto rank 1 alone
    assert list(gathered) == list(got["update"][0])
    for name, tensor in got["update"][0].items():
        assert torch.equal(gathered[name], tensor), name

    # The 2-rank sharded checkpoint loads into 1 rank (DCP reshards).
    engine = make_engine(model_dir, micro_batch_size=3)
    engine.load(str(tmp_path / "ckpt"))
    assert engine.global_update_count == 1
    for name, tensor in engine.export_weights():
        torch.testing.assert_close(tensor, got["update"][0][name], atol=0, rtol=0, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_engine_trains_exports_and_restores(model_dir, tmp_path):
    """On CUDA (nccl): bf16 compute over float32 master weights, log-probs close to the
    float32 reference, a falling loss, bf16 export, exact save/load."""

    def engine():
        config = FSDP2Config(
            model_path=str(model_dir), device="cuda", param_dtype="bfloat16",
            export_dtype="bfloat16", micro_batch_size=3, optim=OptimConfig(lr=3e-3),
        )  # fmt: skip
        return FSDP2TrainEngine(config)

    if dist.is_initialized():  # a CPU-only group from the tests above cannot run nccl
        dist.destroy_process_group()
    a = engine()
    assert "nccl" in dist.get_backend()
    batch = make_batch(8, seed=5)
    reference = make_engine(model_dir)  # float32 on CPU
    want = reference.compute_log_probs(batch)
    got = a.compute_log_probs(batch)
    assert got.device.type == "cpu" and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
    data = with_old_log_probs(a, batch)
    losses = [a.update(data)["actor/loss"] for _ in range(3)]
    assert losses[-1] < losses[0], losses
    exported = dict(a.export_weights())
    assert all(t.dtype == torch.bfloat16 and t.is_cuda for t in exported.values())
    a.save(str(tmp_path / "ckpt"))
    b = engine()
    b.load(str(tmp_path / "ckpt"))
    assert b.global_update_count == 3 and b.lr == a.lr
    next_a, next_b = a.update(data), b.update(data)
    assert next_a["actor/loss"] == next_b["actor/loss"]
    for (name, x), (_, y) in zip(a.export_weights(), b.export_weights(), strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0, msg=name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "OUT"), required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    _worker(*args.worker, args.device)


def test_topk_forward_kl_term_is_the_teachers_renormalised_top_k_and_is_learnt(model_dir):
    # On-policy distillation's top-k mode: zero advantages, so only the forward-KL term to
    # the teacher's top-k moves the policy; the first update reports the KL the plain
    # model gives, and repeated updates pull the policy onto the teacher's tokens.
    from transformers import AutoModelForCausalLM

    from offbeat.core.train.loss import TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROBS

    rows, k = 6, 3
    batch = make_batch(rows, seed=4)
    width = batch["response_mask"].shape[1]
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(VOCAB - 1, generator=g)[:k] + 1 for _ in range(rows * width)])
    teacher = torch.log_softmax(torch.tensor([3.0, 1.0, 0.0]), -1).expand(rows, width, k)
    batch = {
        **batch,
        "advantages": torch.zeros(rows, width),
        TEACHER_TOPK_IDS: ids.view(rows, width, k),
        TEACHER_TOPK_LOG_PROBS: teacher - 0.5,  # not normalised: the loss renormalises
    }
    engine = make_engine(model_dir, lr=1e-2, loss=PPOLossConfig(topk_kl_coef=1.0))
    batch = with_old_log_probs(engine, batch)

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mask = batch["attention_mask"]
    with torch.no_grad():
        logits = plain(
            input_ids=batch["input_ids"], attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        ).logits[:, -width - 1 : -1]  # fmt: skip
    student = torch.log_softmax(logits, -1).gather(-1, batch[TEACHER_TOPK_IDS])
    q = torch.softmax(teacher, -1)
    per_token = (q * (q.log() - student)).sum(-1)
    rmask = batch["response_mask"]
    want = float((per_token * rmask).sum() / rmask.sum())

    first = engine.update(batch)
    assert first["actor/topk_forward_kl"] == pytest.approx(want, rel=1e-4)
    for _ in range(15):
        last = engine.update(batch)
    assert last["actor/topk_forward_kl"] < 0.5 * first["actor/topk_forward_kl"]


def test_a_top_k_loss_without_the_teachers_fields_is_refused(model_dir):
    engine = make_engine(model_dir, loss=PPOLossConfig(topk_kl_coef=1.0))
    batch = with_old_log_probs(engine, make_batch(4, seed=6))
    with pytest.raises(KeyError, match="teacher_topk_ids"):
        engine.update(batch)
