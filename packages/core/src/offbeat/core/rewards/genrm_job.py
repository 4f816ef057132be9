"""What the genrm recipe builds around the job: its config, its task, its judge, its plot.

`prepare_genrm(cfg, cache)` writes the synthetic task with each row's question in
`extra_info` (what the `genrm` scorer reads), trains the tiny judge (`judge_sft`, cached)
and points `reward.genrm.model_path` at it; `plot_genrm` draws the judge's score against
the rule reward per step. The recipe's runner (recipes/genrm/main.py) calls them from its
`JobExtension`; the judge replicas themselves are `genrm_extension`'s. Knows nothing of
engines or the trainer's insides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offbeat.core.config.run import RunConfig
from offbeat.core.rewards.genrm import from_config
from offbeat.core.rewards.genrm_sft import JudgeSFTConfig, build_judge
from offbeat.core.tasks.synthetic import SyntheticTaskConfig

__all__ = ["GenRMRunConfig", "plot_genrm", "prepare_genrm", "write_judged_task_files"]


@dataclass
class GenRMRunConfig(RunConfig):
    """A separate_async job config plus how its tiny judge is trained."""

    judge_sft: JudgeSFTConfig = field(default_factory=JudgeSFTConfig)


def write_judged_task_files(t: SyntheticTaskConfig, cache_dir: str | Path) -> tuple[str, str]:
    """train/val parquet of the synthetic task `t`, each row's question (its last user
    message) in `extra_info.question`; existing files reused."""
    from offbeat.core.tasks.synthetic import make_rows, write_parquet

    d = Path(cache_dir) / f"judged-{t.name}-{t.seed}-{t.min_len}-{t.max_len}-{t.n_train}-{t.n_val}"
    out = []
    for name, n, seed in (("train", t.n_train, t.seed), ("val", t.n_val, t.seed + 1_000_003)):
        path = d / f"{name}.parquet"
        if not path.exists():
            rows = make_rows(t.name, n, seed=seed, min_len=t.min_len, max_len=t.max_len)
            for r in rows:
                r["extra_info"] = {"question": r["prompt"][-1]["content"]}
            write_parquet(rows, path)
        out.append(str(path))
    return out[0], out[1]


def plot_genrm(history: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Judge score and rule reward of the trained responses per step, and the greedy
    validation reward; None when no step logged them."""
    rows = [r for r in history if "genrm/score_mean" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["genrm/score_mean"] for r in rows], label="judge score (trained on)")
    rule = [r.get("genrm/rule_reward_mean", float("nan")) for r in rows]
    ax.plot(steps, rule, label="rule reward (logged only)")
    val = [r for r in history if "val/reward" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val/reward"] for r in val], "o--",
                label="validation reward (greedy)")  # fmt: skip
    ax.set_xlabel("global step")
    ax.set_ylabel("mean over responses")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("GenRM: judge score vs rule reward")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def prepare_genrm(cfg: GenRMRunConfig, cache: Path) -> GenRMRunConfig:
    """`cfg` with the judged task files and the trained judge's directory filled in
    (blocking: builds and trains on first use)."""
    from offbeat.core.models.resolve import resolve_model

    if not cfg.data.train_files:
        train, val = write_judged_task_files(cfg.task, cache / "tasks")
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, train_files=[train], val_files=[val])
        )
    raw = dict(cfg.reward.genrm or {})
    if raw.get("replicas") and raw.get("model_path"):
        base = resolve_model(str(raw["model_path"]), cache / "models")
        raw["model_path"] = str(build_judge(cfg.judge_sft, from_config(raw), base, cache))
        cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, genrm=raw))
    return cfg
