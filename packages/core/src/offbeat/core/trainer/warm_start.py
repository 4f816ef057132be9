"""A brief supervised warm start: teach a freshly built model the task's answer format.

Knows nothing about RL or engines: it fine-tunes a HF causal LM on (chat prompt -> ground
truth answer + end-of-turn) pairs with cross-entropy on the answer tokens only, for a
fixed number of steps, and saves an ordinary HF directory. A vision-language model (one
with an image processor) reads a row's images through its processor, as the agent loop
does. Results are cached under a
hash of everything that determines them, so a second run reuses the first's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from offbeat.core.data.vision import encode_vision_prompt, load_processor, vision_model_kwargs
from offbeat.core.tasks.bad_rows import row_problem
from offbeat.core.tasks.images import content_parts, decode_image, row_images
from offbeat.core.tasks.rows import row_ground_truth, row_messages
from offbeat.core.trainer.agent_loop import encode_prompt

logger = logging.getLogger(__name__)


@dataclass
class WarmStartConfig:
    """`steps=0` disables the warm start. `enabled`: None (auto) warm-starts only the tiny
    models offbeat builds itself (`model.path=offbeat-tiny:<size>`: random weights that
    do not know the answer format yet); true also warm-starts any other model (on the
    dataset's `ground_truth`); false never does."""

    enabled: bool | None = None
    steps: int = 0
    batch_size: int = 32
    lr: float = 3e-3
    seed: int = 0


def _key(model_dir: Path, rows_digest: str, cfg: WarmStartConfig) -> str:
    marker = model_dir / "config.json"
    h = hashlib.sha256()
    h.update(str(model_dir.resolve()).encode())
    h.update(marker.read_bytes() if marker.exists() else b"")
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    h.update(rows_digest.encode())
    what = {k: v for k, v in asdict(cfg).items() if k != "enabled"}  # whether, not what
    h.update(json.dumps(what, sort_keys=True).encode())
    return h.hexdigest()[:16]


def warm_start(
    model_dir: str | Path,
    rows: Sequence[dict[str, Any]],
    cfg: WarmStartConfig,
    *,
    cache_dir: str | Path,
    prompt_key: str = "prompt",
    override_config: dict[str, Any] | None = None,
) -> Path:
    """Fine-tune `model_dir` (its HF config with `override_config` applied, as the trainer
    and the engines will apply it) on `rows` for `cfg.steps` steps; return the new model's
    directory (or `model_dir` itself when `cfg.steps == 0`)."""
    model_dir = Path(model_dir)
    if cfg.steps <= 0:
        return model_dir
    overrides = dict(override_config or {})
    digest = hashlib.sha256(json.dumps(list(rows)[:4096], sort_keys=True, default=str).encode())
    if overrides:
        digest.update(json.dumps(overrides, sort_keys=True, default=str).encode())
    out = Path(cache_dir) / f"warm-{_key(model_dir, digest.hexdigest(), cfg)}"
    if (out / "config.json").exists():
        return out
    from transformers import AutoConfig, AutoTokenizer

    from offbeat.core.models.hf import load_causal_lm

    t0 = time.perf_counter()
    processor = load_processor(model_dir)
    tok = processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    config.update(overrides)
    model = load_causal_lm(model_dir, config=config, dtype=torch.float32)
    end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    examples = []
    for row in rows:
        if row_problem(row, prompt_key, needs_ground_truth=False) is not None:
            continue  # a bad row (offbeat.core.tasks.bad_rows): the run counts it failed
        if (truth := row_ground_truth(row)) is None:
            continue  # nothing to imitate
        messages = row_messages(row, prompt_key)
        vision = None
        if processor is not None and (images := row_images(row)):
            vp = encode_vision_prompt(
                processor, content_parts(messages), [decode_image(im) for im in images]
            )
            prompt, vision = vp.prompt_ids, vp.model_inputs
        else:
            prompt = encode_prompt(tok, messages)
        answer = list(tok.encode(str(truth), add_special_tokens=False))
        if end is not None:
            answer.append(end)
        examples.append((prompt, answer, vision))
    if not examples:
        raise ValueError("warm start: no dataset row has a ground truth to imitate")
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    loss_val = float("nan")
    for _ in range(cfg.steps):
        idx = torch.randint(len(examples), (cfg.batch_size,), generator=gen).tolist()
        batch = [examples[i] for i in idx]
        width = max(len(p) + len(a) for p, a, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, a, _) in enumerate(batch):
            seq = p + a
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
            labels[i, len(p) : len(seq)] = torch.tensor(a)
        vision = vision_model_kwargs(
            [v for _, _, v in batch], ids, getattr(config, "image_token_id", None)
        )
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, **vision).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = float(loss.detach())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        (processor or tok).save_pretrained(tmp)
        for extra in ("generation_config.json",):
            if (model_dir / extra).exists() and not (tmp / extra).exists():
                shutil.copy(model_dir / extra, tmp / extra)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "warm start: %d steps in %.1fs, final loss %.3f -> %s",
        cfg.steps,
        time.perf_counter() - t0,
        loss_val,
        out,
    )
    return out
