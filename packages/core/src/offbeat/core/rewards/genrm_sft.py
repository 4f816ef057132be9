"""The embedded default's judge: a tiny model supervised (SFT, cached) to grade answers to a
synthetic task with a short verdict ending in a score, as the rule reward would grade them.

Knows the judge's training data (questions of the task, responses right and wrong in the
shapes a policy writes, each labelled by the task's own rule scorer and rendered through
`reward.genrm`'s template) and how its agreement with the rule is measured. Knows nothing
of engines or RL: an HF model directory in, a fine-tuned one out (cached by
`warm_start`, keyed by everything that determines it, so a second run reuses it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offbeat.core.rewards.genrm import GenRMConfig, parse_score, render_prompt

__all__ = [
    "JudgeSFTConfig",
    "build_judge",
    "judge_agreement",
    "judge_rows",
    "judge_scores",
    "verdict",
]

_JUNK = "0123456789+-=: abcdef"


@dataclass
class JudgeSFTConfig:
    """`judge_sft.*`: how the tiny judge is trained (steps=0: serve the model as it is)."""

    task: str = "add"  # a synthetic task (offbeat.core.tasks.synthetic.TASKS)
    min_len: int = 1
    max_len: int = 1
    n_train: int = 6000  # judged (question, response) examples
    steps: int = 400
    batch_size: int = 64
    lr: float = 1.0e-3  # at 3e-3 the tiny judge copies worse: 88% agreement, not 96%
    seed: int = 0


def verdict(right: bool, cfg: GenRMConfig, answer: str | None = None, ref: str = "") -> str:
    """The judge's target text: the final answer it read and the reference (a tiny model
    compares two numbers it has just written far more easily than across the prompt),
    a one-word verdict, then the score: `7 vs 7: right, 1`."""
    seen = f"{answer if answer is not None else '-'} vs {ref}: " if ref else ""
    return seen + (f"right, {cfg.score_max}" if right else f"wrong, {cfg.score_min}")


def _wrong_number(rng: random.Random, truth: str) -> str:
    """A number that is mostly not the answer, in the shapes a policy's wrong answers take:
    a near miss (off by 1-3), the answer with one digit changed ("11" for 12), or any
    number up to twice the answer's magnitude. Without the first two a judge learns to
    tell numbers apart by length and passes a policy's near misses ("11 vs 12: right")."""
    kind = rng.random()
    if kind < 0.4 and truth.isdigit():
        return str(max(0, int(truth) + rng.choice((-3, -2, -1, 1, 2, 3))))
    if kind < 0.7 and truth.isdigit():
        i = rng.randrange(len(truth))
        return truth[:i] + rng.choice("0123456789") + truth[i + 1 :]
    return str(rng.randint(0, 10 ** len(truth) * 2))


def _response(rng: random.Random, truth: str, max_chars: int) -> str:
    """A response in one of the shapes a policy writes: the answer, a wrong number (near
    misses among them), the answer with a stray character before or after, or junk."""
    kind = rng.random()
    if kind < 0.35:
        return truth
    if kind < 0.7:
        return _wrong_number(rng, truth)
    c = rng.choice(_JUNK)
    if kind < 0.78:
        return (truth + c)[:max_chars]
    if kind < 0.86:
        return (c + truth)[:max_chars]
    return "".join(rng.choice(_JUNK) for _ in range(rng.randint(1, max_chars)))


def judge_rows(s: JudgeSFTConfig, g: GenRMConfig, *, seed_offset: int = 0,
               max_chars: int = 4) -> list[dict[str, Any]]:  # fmt: skip
    """`s.n_train` SFT rows (`prompt`: the judge prompt as one user message,
    `ground_truth`: the verdict), labelled by the task's rule scorer; plus `rule` (0/1) and
    the `question`, `response` and `reference` the prompt was rendered from."""
    from offbeat.core.registry import REWARD_FUNCTIONS
    from offbeat.core.rewards.registry import call_reward_fn
    from offbeat.core.rewards.scorers import extract_answer
    from offbeat.core.tasks.synthetic import make_rows

    seed = s.seed + 7 + seed_offset
    tasks = make_rows(s.task, s.n_train, seed=seed, min_len=s.min_len, max_len=s.max_len)
    rng = random.Random(seed)
    rows = []
    for t in tasks:
        question, truth = t["prompt"][-1]["content"], str(t["ground_truth"])
        response = _response(rng, truth, max_chars)
        rule = float(call_reward_fn(REWARD_FUNCTIONS.get(t["data_source"]), response, truth))
        body = render_prompt(g, question, response, truth)
        target = verdict(rule >= 0.5, g, extract_answer(response), truth)
        rows.append({"prompt": [{"role": "user", "content": body}],
                     "ground_truth": target, "rule": rule,
                     "question": question, "response": response, "reference": truth})  # fmt: skip
    return rows


def build_judge(s: JudgeSFTConfig, g: GenRMConfig, model_dir: str | Path,
                cache_dir: str | Path) -> Path:  # fmt: skip
    """`model_dir` fine-tuned for `s.steps` steps on `judge_rows` (cached)."""
    from offbeat.core.trainer.warm_start import WarmStartConfig, warm_start

    if s.steps <= 0:
        return Path(model_dir)
    rows = [{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in judge_rows(s, g)]
    ws = WarmStartConfig(enabled=True, steps=s.steps, batch_size=s.batch_size, lr=s.lr, seed=s.seed)
    return warm_start(model_dir, rows, ws, cache_dir=Path(cache_dir) / "judges")


def judge_scores(model_dir: str | Path, g: GenRMConfig,
                 prompts: list[list[dict[str, str]]]) -> list[float | None]:  # fmt: skip
    """The judge's greedy scores (transformers, this process) of chat `prompts`; None where
    its verdict holds no score."""
    import torch
    from transformers import AutoTokenizer

    from offbeat.core.models.hf import load_causal_lm

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_causal_lm(model_dir, dtype=torch.float32).eval()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out_scores = []
    with torch.no_grad():
        for prompt in prompts:
            text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
            out = model.generate(ids, max_new_tokens=g.max_tokens, do_sample=False,
                                 eos_token_id=end, pad_token_id=end)  # fmt: skip
            verdict = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            out_scores.append(parse_score(verdict, g))
    return out_scores


def judge_agreement(model_dir: str | Path, g: GenRMConfig, rows: list[dict[str, Any]]) -> dict:
    """Greedy verdicts of the judge in `model_dir` on `rows` of `judge_rows`: agreement
    with the rule on right and on wrong answers, parse failures."""
    hits = {True: [0, 0], False: [0, 0]}  # rule right? -> [agree, total]
    failures = 0
    for r, score in zip(rows, judge_scores(model_dir, g, [r["prompt"] for r in rows]), strict=True):
        right = r["rule"] >= 0.5
        failures += score is None
        hits[right][0] += score is not None and (score >= 0.5) == right
        hits[right][1] += 1
    n = len(rows)
    return {
        "agreement": (hits[True][0] + hits[False][0]) / max(n, 1),
        "agreement_right": hits[True][0] / max(hits[True][1], 1),
        "agreement_wrong": hits[False][0] / max(hits[False][1], 1),
        "n_right": hits[True][1],
        "n_wrong": hits[False][1],
        "parse_failures": failures,
    }
