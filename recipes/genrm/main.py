"""genrm: separate_async trained on an LLM judge's scores (generative reward model).

    offbeat run genrm [key=value ...]

The policy samples; each finished group's responses go to the judge (vLLM replicas of
`reward.genrm.model_path` behind a LoadBalancer of their own, never weight-synced), which
reads question, response and reference through `reward.genrm.template` and writes a short
verdict ending in a score; the parsed score, normalised to [0, 1], is the reward. The
rule reward is logged beside it (`genrm/rule_reward_mean`), never trained on. By default
the judge is a tiny model SFT-trained (cached) to grade the synthetic task's answers.
The pieces live in offbeat.core.rewards (genrm, genrm_replicas, genrm_sft, genrm_job).
"""

from __future__ import annotations

import asyncio
from typing import Any

from offbeat.core.rewards.genrm_job import GenRMRunConfig, run_genrm
from offbeat.core.trainer.restart import run_with_restarts

CONFIG = GenRMRunConfig  # the schema config.yaml and the overrides are loaded into


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
