"""MegatronTrainEngine on CPU (TP = PP = 1, the `torch` optimizer path): its log-probs are
transformers' on the same HF weights, one PPO update is the FSDP2 engine's, a save -> load
gives the identical next update, and the export is the HF checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from engine_helpers import (
    EPS,
    LOSSES,
    LR,
    TIMED,
    fsdp2,
    hf_grads,
    make_batch,
    megatron,
    params,
    tiny_model_dir,
    with_old_log_probs,
)

from offbeat.backend_megatron import MegatronConfig


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {tied: tiny_model_dir(root, tied) for tied in (False, True)}


@pytest.fixture(scope="module", autouse=True)
def _own_groups():
    """The engine starts a private 1-process group and Megatron's groups when none exist;
    leave none behind."""
    existed = dist.is_initialized()
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if not existed and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_transformers_on_the_same_weights(model_dirs, tied, temperature):
    from transformers import AutoModelForCausalLM

    from offbeat.core.train._batch import position_ids_of, token_log_probs

    engine = megatron(model_dirs[tied], micro_batch_size=3)
    batch = make_batch(7)
    got = engine.compute_log_probs(batch, temperature=temperature)
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[tied], torch_dtype=torch.float32).eval()
    width = batch["response_mask"].shape[1]
    with torch.no_grad():
        logits = hf(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=position_ids_of(batch),
        ).logits[:, -(width + 1) : -1]
    want = token_log_probs(logits / temperature, batch["input_ids"][:, -width:])
    want = want * batch["response_mask"]
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_export_before_any_update_is_the_hf_checkpoint(model_dirs):
    from safetensors.torch import load_file

    for tied, path in model_dirs.items():
        engine = megatron(path)
        got = params(engine)
        want = load_file(str(path / "model.safetensors"))
        want = {k: v for k, v in want.items() if not (tied and k == "lm_head.weight")}
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_one_ppo_update_matches_the_fsdp2_engine(model_dirs, loss):
    batch = make_batch(6, seed=3)
    engines = {
        "megatron": megatron(model_dirs[False], loss=LOSSES[loss]),
        "fsdp2": fsdp2(model_dirs[False], loss=LOSSES[loss]),
    }
    # One batch for both: proximal log-probs from one engine, the behaviour policy off by noise.
    data = with_old_log_probs(engines["megatron"], batch)
    if loss == "bypass":
        data.pop("old_log_probs")
    results = {}
    for name, engine in engines.items():
        metrics = engine.update(data)
        grads = (
            hf_grads(engine)
            if name == "megatron"
            else {n: p.grad.full_tensor() for n, p in engine.model.named_parameters()}
        )
        results[name] = (params(engine), grads, metrics)
    (m_params, m_grads, m_metrics), (f_params, f_grads, f_metrics) = results.values()
    assert sorted(m_params) == sorted(f_params) == sorted(m_grads)
    for name in f_params:
        scale = float(f_grads[name].abs().max()) or 1.0
        torch.testing.assert_close(
            m_grads[name], f_grads[name], atol=1e-5 * scale, rtol=1e-4, msg=name
        )
        # Adam's first step moves a parameter by lr * g / (|g| + eps): a gradient difference
        # dg moves it by at most lr * |dg| / eps.
        dg = float((m_grads[name] - f_grads[name]).abs().max())
        atol = 1e-6 + 2 * LR * dg / EPS
        torch.testing.assert_close(m_params[name], f_params[name], atol=atol, rtol=0, msg=name)
    assert set(m_metrics) - set(TIMED) == set(f_metrics) - set(TIMED)
    for key in set(f_metrics) - set(TIMED):
        assert m_metrics[key] == pytest.approx(f_metrics[key], rel=1e-4, abs=1e-6), key


def test_save_then_load_gives_the_identical_next_update(model_dirs, tmp_path):
    first, second = make_batch(4, seed=1), make_batch(4, seed=2)
    a = megatron(model_dirs[True], loss=LOSSES["decoupled_entropy"])
    a.update(with_old_log_probs(a, first))
    a.save(str(tmp_path / "ckpt"))
    want_metrics = a.update(with_old_log_probs(a, second))
    want = params(a)

    b = megatron(model_dirs[True], loss=LOSSES["decoupled_entropy"])
    b.load(str(tmp_path / "ckpt"))
    assert b.global_update_count == 1 and b.lr == a.lr
    got_metrics = b.update(with_old_log_probs(b, second))
    got = params(b)
    assert b.global_update_count == a.global_update_count == 2
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    for key in set(want_metrics) - set(TIMED):
        assert got_metrics[key] == want_metrics[key], key


def test_save_before_any_update_restores_the_weights_only(model_dirs, tmp_path):
    a = megatron(model_dirs[False])
    a.save(str(tmp_path / "fresh"))
    b = megatron(model_dirs[False])
    b.update(with_old_log_probs(b, make_batch(4)))
    with pytest.raises(ValueError, match="saved before any update"):
        b.load(str(tmp_path / "fresh"))
    with pytest.raises(FileNotFoundError, match="no complete train-engine checkpoint"):
        b.load(str(tmp_path / "missing"))


def test_config_errors_name_the_key_and_the_choices(model_dirs):
    with pytest.raises(ValueError, match=r"optimizer='sgd': must be one of"):
        MegatronConfig(optimizer="sgd").validate()
    with pytest.raises(ValueError, match="sequence_parallel=True: needs tensor_model_parallel"):
        MegatronConfig(sequence_parallel=True).validate()
    with pytest.raises(ValueError, match="optimizer=megatron: needs CUDA"):
        megatron(model_dirs[False], optimizer="megatron")
    with pytest.raises(ValueError, match="param_dtype='bfloat16' with optimizer=torch"):
        megatron(model_dirs[False], param_dtype="bfloat16")


class _Replica:
    """An in-process SyncTarget: copies what the checkpoint engine delivers."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.weight_version = 0

    async def abort_all(self) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def resume(self) -> None: ...

    def _load(self, pairs) -> None:
        for name, t in pairs:
            self.weights[name] = t.clone()

    async def update_weights(self, spec) -> int:
        import asyncio

        from offbeat.ckpt_engine import receive

        self.weight_version = await asyncio.to_thread(
            receive, spec, self._load, self.weight_version
        )
        return self.weight_version


@pytest.mark.parametrize("backend", ["naive", "shm"])
def test_export_feeds_the_checkpoint_engine_unchanged(model_dirs, backend):
    import asyncio

    from offbeat.ckpt_engine import CheckpointEngineManager

    engine = megatron(model_dirs[False])
    engine.update(with_old_log_probs(engine, make_batch(4)))
    replica = _Replica()
    manager = CheckpointEngineManager(backend, bucket_bytes=1 << 14, phase_timeout_s=60)
    result = asyncio.run(manager.sync(engine.export_weights, 1, targets={"r": replica}))
    assert result.succeeded == ["r"], result.failed
    want = params(engine)
    assert sorted(replica.weights) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(replica.weights[name], tensor), name


class _NoStateOptimizer:
    """Stands in for the `megatron` optimizer path (CUDA only) before its first step."""

    kind, has_state = "megatron", False

    def __init__(self) -> None:
        self.reloaded = 0
        self.optimizer = self

    def reload_model_params(self) -> None:
        self.reloaded += 1


def test_megatron_dist_checkpoint_round_trips_the_model(
    model_dirs, tmp_path, megatron_cuda_calls_on_cpu
):
    """The CUDA path's checkpoint format (Megatron dist-checkpointing of the model's sharded
    state dict), written and read back on CPU; the master weights are refreshed after."""
    from offbeat.backend_megatron import _checkpoint

    engine = megatron(model_dirs[True])
    want = params(engine)
    opt = _NoStateOptimizer()
    _checkpoint.save(str(tmp_path / "c"), engine.model, opt, {"global_update_count": 3})
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["dist", "engine_state.pt"]
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    extra = _checkpoint.load(str(tmp_path / "c"), engine.model, opt)
    assert extra == {"global_update_count": 3} and opt.reloaded == 1
    got = params(engine)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_gradient_checkpointing_gives_the_same_update(model_dirs):
    batch = make_batch(5, seed=4)
    runs = []
    for recompute in (False, True):
        engine = megatron(model_dirs[False], gradient_checkpointing=recompute)
        metrics = engine.update(with_old_log_probs(engine, batch))
        runs.append((params(engine), metrics["actor/loss"], metrics["actor/grad_norm"]))
    (p0, loss0, norm0), (p1, loss1, norm1) = runs
    assert (loss0, norm0) == (loss1, norm1)
    for name, tensor in p0.items():
        assert torch.equal(p1[name], tensor), name
