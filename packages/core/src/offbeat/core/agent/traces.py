"""Tool-use traces for a supervised warm start: token ids laid out exactly as the tool
agent loop lays out a trajectory, with a label mask on the policy's turns only.

Knows nothing about RL or engines: a trace is a prompt, assistant turns (text) and the
observations between them; `TurnTemplate` turns it into ids (assistant turns encoded and
closed with the end-of-turn token, observations from the template's delta). Only the
assistant turns are learnt, as only they are trained by RL. `calculator_traces` writes
the built-in example's traces: call the calculator on the row's expression, then answer
with its result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from offbeat.core.agent.tools import CALCULATOR, calculate
from offbeat.core.agent.turns import TurnTemplate
from offbeat.core.tasks.rows import row_extra_info, row_messages

__all__ = ["calculator_call", "calculator_traces", "trace_ids", "warm_start_on_traces"]

logger = logging.getLogger(__name__)


def trace_ids(
    template: TurnTemplate,
    messages: Sequence[Mapping[str, Any]],
    turns: Sequence[tuple[str, Sequence[str]]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    role: str = "tool",
) -> tuple[list[int], list[int]]:
    """(ids, labels mask) of a conversation: `turns` are (assistant text, observations
    that follow it); the mask is 1 on assistant tokens and their end-of-turn token."""
    ids = template.prompt_ids(messages, tools)
    mask = [0] * len(ids)
    tok = template.tokenizer
    for k, (text, observations) in enumerate(turns):
        with template.lock:
            sampled = [*tok.encode(text, add_special_tokens=False), template.end_of_turn_id]
        ids += sampled
        mask += [1] * len(sampled)
        if k + 1 < len(turns):
            rest = list(template.separator) + template.observation_ids(
                [{"role": role, "content": o} for o in observations]
            )
            ids += rest
            mask += [0] * len(rest)
    return ids, mask


def calculator_call(expression: str) -> str:
    """The Hermes-style call of the calculator on `expression`."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>{body}</tool_call>"


def calculator_traces(
    template: TurnTemplate, rows: Sequence[Mapping[str, Any]], prompt_key: str = "prompt"
) -> list[tuple[list[int], list[int]]]:
    """Two-turn traces for rows whose `extra_info.expression` the calculator evaluates:
    the call, then the result as the answer. The prompt shows the calculator's schema,
    as the loop's prompt does."""
    tools = [CALCULATOR.schema()]
    out = []
    for row in rows:
        expression = row_extra_info(row).get("expression")
        if not expression:
            continue
        result = calculate(expression)
        turns = [(calculator_call(expression), [result]), (result, [])]
        out.append(trace_ids(template, row_messages(row, prompt_key), turns, tools=tools))
    if not out:
        raise ValueError("calculator traces: no row has an extra_info.expression")
    return out


def warm_start_on_traces(
    model_dir: str | Path,
    traces: Sequence[tuple[list[int], list[int]]],
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    cache_dir: str | Path,
) -> Path:
    """Fine-tune `model_dir` on `traces` (cross-entropy on the masked-in tokens) for
    `steps` steps; return the new model's directory, cached under a hash of the inputs."""
    model_dir = Path(model_dir)
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    h.update(json.dumps([list(traces[:4096]), steps, batch_size, lr, seed]).encode())
    out = Path(cache_dir) / f"traces-{h.hexdigest()[:16]}"
    if (out / "config.json").exists():
        return out
    from transformers import AutoTokenizer

    from offbeat.core.models.hf import load_causal_lm

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_causal_lm(model_dir, dtype=torch.float32)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss_val = float("nan")
    for _ in range(steps):
        batch = [traces[i] for i in torch.randint(len(traces), (batch_size,), generator=gen)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (seq, mask) in enumerate(batch):
            t = torch.tensor(seq)
            ids[i, : len(seq)] = t
            attn[i, : len(seq)] = 1
            labels[i, : len(seq)] = torch.where(torch.tensor(mask).bool(), t, -100)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = float(loss.detach())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if (model_dir / "generation_config.json").exists():
            shutil.copy(model_dir / "generation_config.json", tmp / "generation_config.json")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "tool-trace warm start: %d steps in %.1fs, final loss %.3f -> %s",
        steps, time.perf_counter() - t0, loss_val, out,
    )  # fmt: skip
    return out
