"""genrm's three figures, each beside its baseline, from one run of this script.

1. Judge agreement with the rule reward on held-out answers (right and wrong ones, a seed
   the judge was not trained on), greedy, through transformers; baselines: the target
   (95%) and a judge that always says "wrong" (the share of wrong answers).
2. Greedy validation rule reward after N steps of the genrm recipe (policy trained on the
   judge's scores) against N steps of the same config trained on the rule reward itself
   (`reward.name=task`, no judge started); same seeds, same steps. Target: >= 90%.
3. Step-time overhead of GenRM against the rule reward (median `timing/step_s` of steps
   3..N of the same two runs) and the judge's cache hit rate.

    uv run --frozen --no-sync python benchmarks/genrm_figures.py [steps=N] [key=value ...]

Extra key=value pairs are Hydra overrides applied to both runs; steps=0 prints figure 1 only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path


def agreement_figure(cfg) -> None:
    from offbeat.core.models import cache_root
    from offbeat.core.rewards.genrm import from_config
    from offbeat.core.rewards.genrm_job import prepare_genrm
    from offbeat.core.rewards.genrm_sft import judge_agreement, judge_rows

    cache = cache_root()
    t0 = time.perf_counter()
    cfg = prepare_genrm(cfg, cache)  # builds and trains the judge unless cached
    built_s = time.perf_counter() - t0
    g = from_config(cfg.reward.genrm)
    held_out = judge_rows(dataclasses.replace(cfg.judge_sft, n_train=600), g, seed_offset=10_007)
    a = judge_agreement(g.model_path, g, held_out)
    wrong_share = a["n_wrong"] / (a["n_right"] + a["n_wrong"])
    print("\n## 1. judge agreement with the rule reward (held-out answers, greedy)")
    print("| answers | n | judge agrees | baseline: always 'wrong' | target |")
    print("|---|---|---|---|---|")
    print(f"| right | {a['n_right']} | {a['agreement_right']:.1%} | 0.0% | |")
    print(f"| wrong | {a['n_wrong']} | {a['agreement_wrong']:.1%} | 100.0% | |")
    print(f"| all | {a['n_right'] + a['n_wrong']} | **{a['agreement']:.1%}** | "
          f"{wrong_share:.1%} | 95% |")  # fmt: skip
    print(f"parse failures {a['parse_failures']}; judge ready in {built_s:.0f}s ({g.model_path})")


def run(recipe_overrides: list[str], name: str) -> dict:
    import ray

    from offbeat.core.cli import load_recipe_config

    module, cfg = load_recipe_config("genrm", [
        "runtime.progress_bar=false", "trainer.loggers=[jsonl]",
        f"trainer.experiment_name={name}", *recipe_overrides,
    ])  # fmt: skip
    affinity = os.sched_getaffinity(0)
    try:
        summary = asyncio.run(module.run_genrm(cfg))
    finally:
        os.sched_setaffinity(0, affinity)  # the job pins this process to the trainer's core
        ray.shutdown()
    hist = summary["trainer"].tracker.history
    steps = [r for r in hist if "timing/step_s" in r]
    return {
        "val": summary["val_history"],
        "step_s": statistics.median(r["timing/step_s"] for r in steps[2:]),
        "genrm": summary.get("genrm"),
        "wall_s": summary["total_wall_s"],
    }


def main() -> None:
    args = sys.argv[1:]
    n = next((int(a.split("=", 1)[1]) for a in args if a.startswith("steps=")), 30)
    extra = [a for a in args if not a.startswith("steps=")]
    common = [f"trainer.total_training_steps={max(n, 1)}", f"trainer.test_freq={max(n, 1)}", *extra]
    from offbeat.core.cli import load_recipe_config

    _, cfg = load_recipe_config("genrm", common)
    agreement_figure(cfg)
    if n <= 0:  # steps=0: the agreement figure only
        return
    judged = run(common, "genrm_bench_judge")
    rule = run([*common, "reward.name=task"], "genrm_bench_rule")
    jv, rv = judged["val"][-1][1], rule["val"][-1][1]
    print(f"\n## 2. greedy validation rule reward after {n} steps (64 held-out prompts)")
    print("| trained on | version 0 | version N | best |")
    print("|---|---|---|---|")
    for label, r in (("judge scores (genrm)", judged), ("rule reward (baseline)", rule)):
        v = r["val"]
        print(f"| {label} | {v[0][1]:.3f} | {v[-1][1]:.3f} | {max(x for _, x in v):.3f} |")
    ratio = jv / rv if rv > 0 else float("nan")
    print(f"genrm / rule at version {n}: **{ratio:.0%}** (target >= 90%)")
    g = judged["genrm"]
    hit = g["cache_hits"] / max(g["cache_hits"] + g["judgments"], 1)
    print("\n## 3. step time (median timing/step_s, steps 3..N) and the judge's cache")
    print("| reward | s/step | wall (s) |")
    print("|---|---|---|")
    print(f"| rule (baseline) | {rule['step_s']:.2f} | {rule['wall_s']:.0f} |")
    print(f"| genrm | {judged['step_s']:.2f} | {judged['wall_s']:.0f} |")
    print(f"overhead: **{judged['step_s'] / rule['step_s'] - 1:+.0%}** per step; cache hit rate "
          f"**{hit:.0%}** ({g['cache_hits']} hits, {g['judgments']} judgments, "
          f"{g['parse_failures']} parse failures)")  # fmt: skip
    print(f"load average {Path('/proc/loadavg').read_text().split()[:3]} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
