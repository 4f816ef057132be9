"""genrm: separate_async trained on an LLM judge's scores (generative reward model).

    offbeat run genrm [key=value ...]

The policy samples; each finished group's responses go to the judge (vLLM replicas of
`reward.genrm.model_path` behind a LoadBalancer of their own, never weight-synced), which
reads question, response and reference through `reward.genrm.template` and writes a short
verdict ending in a score; the parsed score, normalised to [0, 1], is the reward. The
rule reward is logged beside it (`genrm/rule_reward_mean`), never trained on. By default
the judge is a tiny model SFT-trained (cached) to grade the synthetic task's answers.

The runner is this file's `run_genrm`: the separate_async job (`run_job`) extended by
`JudgeBuild` (the judged task files and the SFT-trained judge before Ray starts; the
judge-vs-rule plot at the end). `reward.name=genrm` brings the rest through the job
extension that reward declares (`offbeat.core.rewards.genrm_extension`): the judge
replicas in their own pool, their balancer, the step hook, the summary's "genrm". The
pieces live in offbeat.core.rewards (genrm, genrm_replicas, genrm_extension, genrm_sft,
genrm_job).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from offbeat.core.rewards.genrm_job import GenRMRunConfig, plot_genrm, prepare_genrm
from offbeat.core.trainer.extension import JobExtension
from offbeat.core.trainer.job import run_job
from offbeat.core.trainer.restart import run_with_restarts

CONFIG = GenRMRunConfig  # the schema config.yaml and the overrides are loaded into


class JudgeBuild(JobExtension):
    """The recipe's own part: its task and judge before Ray starts, its plot at the end."""

    judge_model: str | None = None

    def configure(self, cfg: GenRMRunConfig) -> GenRMRunConfig:
        from offbeat.core.models import cache_root

        cfg = prepare_genrm(cfg, cache_root())  # builds and trains the judge unless cached
        self.judge_model = dict(cfg.reward.genrm).get("model_path")
        return cfg

    async def report(self, summary: dict[str, Any]) -> None:
        history = summary["trainer"].tracker.history
        plot = plot_genrm(history, Path(summary["run_dir"]) / "genrm.png")
        summary["genrm_plot"] = str(plot) if plot else None
        summary["judge_model"] = self.judge_model


async def run_genrm(cfg: GenRMRunConfig) -> dict[str, Any]:
    """Run `cfg` (validated) to the end; the summary adds `genrm_plot` and `judge_model`."""
    return await run_job(cfg, extensions=[JudgeBuild()])


def report(s: dict[str, Any]) -> None:
    rows = [r for r in s["trainer"].tracker.history if "genrm/score_mean" in r]
    val, g = s["val_history"], s["genrm"]
    print("\n=== genrm finished ===")
    print(f"steps: {s['steps']}  wall time: {s['total_wall_s']:.0f}s  judge: {s['judge_model']}")
    for name, r in (("first", rows[:1]), ("last", rows[-1:])):
        for x in r:
            print(f"{name} step {int(x['step'])}: judge score {x['genrm/score_mean']:.3f}, "
                  f"rule reward {x.get('genrm/rule_reward_mean', float('nan')):.3f}")  # fmt: skip
    if val:
        print(f"validation rule reward: {val[0][1]:.3f} (version {val[0][0]}) -> "
              f"{val[-1][1]:.3f} (version {val[-1][0]})")  # fmt: skip
    print(f"judgments {g['judgments']}, cache hits {g['cache_hits']}, parse failures "
          f"{g['parse_failures']}, judge replicas removed {g['removed_replicas']}")  # fmt: skip
    print(f"metrics: {s['metrics']}\nplot: {s['genrm_plot']}")


def main(cfg: GenRMRunConfig) -> int:
    report(asyncio.run(run_with_restarts(run_genrm, cfg)))
    return 0


if __name__ == "__main__":
    import sys

    from offbeat.core.cli import main as cli_main

    sys.exit(cli_main(["run", "genrm", *sys.argv[1:]]))
