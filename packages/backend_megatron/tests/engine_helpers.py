"""Shared by the engine tests and the multi-process worker: a tiny HF model, a PPO batch
with padding on both sides, engine builders and what a test reads back from an engine."""

from __future__ import annotations

from pathlib import Path

import torch

from offbeat.backend_megatron import MegatronConfig, MegatronTrainEngine
from offbeat.backend_megatron.convert import megatron_to_hf
from offbeat.core.models import build_tiny_model
from offbeat.core.train import FSDP2Config, FSDP2TrainEngine, OptimConfig, PPOLoss, PPOLossConfig

VOCAB = 260  # the character tokenizer's vocabulary
LR, EPS = 1e-2, 1e-3
TIMED = ("actor/max_memory_gb", "perf/tflops_per_device", "perf/mfu")


def tiny_model_dir(root: Path, tied: bool) -> Path:
    return build_tiny_model(
        root / ("tied" if tied else "untied"),
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, tie_word_embeddings=tied, initializer_range=0.1,
    )  # fmt: skip


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
    advantages = torch.randn(rows, 1, generator=g).expand(rows, response) * response_mask
    noise = torch.randn(rows, response, generator=g) * 0.1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "advantages": advantages,
        "noise": noise,
    }


def with_old_log_probs(engine, batch: dict) -> dict:
    proximal = engine.compute_log_probs(batch)
    behaviour = proximal + batch["noise"] * batch["response_mask"]
    return {**batch, "old_log_probs": proximal, "rollout_log_probs": behaviour}


def optim() -> OptimConfig:
    return OptimConfig(lr=LR, eps=EPS, weight_decay=0.01, grad_clip=1.0)


def megatron(
    model_dir: Path, loss: PPOLossConfig | None = None, device: str = "cpu", **kw
) -> MegatronTrainEngine:
    config = MegatronConfig(model_path=str(model_dir), device=device, optim=optim(), **kw)
    return MegatronTrainEngine(config, loss_fn=PPOLoss(loss or PPOLossConfig()))


def fsdp2(
    model_dir: Path, loss: PPOLossConfig | None = None, device: str = "cpu", **kw
) -> FSDP2TrainEngine:
    config = FSDP2Config(
        model_path=str(model_dir), device=device, micro_batch_size=4, optim=optim(), **kw
    )
    return FSDP2TrainEngine(config, loss_fn=PPOLoss(loss or PPOLossConfig()))


def hf_grads(engine: MegatronTrainEngine) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.model.named_parameters():
        out.update(megatron_to_hf(engine.spec, name, p.grad.detach().clone()))
    return out


LOSSES = {
    "bypass": PPOLossConfig(),
    "decoupled_entropy": PPOLossConfig(rollout_is_level="token", entropy_coeff=0.01),
}


def rows_of(batch: dict, start: int, stop: int) -> dict:
    return {k: v[start:stop] for k, v in batch.items()}


def params(engine) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().clone() for name, t in engine.export_weights()}
