"""Where the genrm judge disagrees with the rule on the policy's own samples.

Runs the genrm recipe (the policy trained on the judge's scores) for N steps and records
every response the judge scores: (step, question, response, reference, the judge's
verdict text, its score, the rule reward). Prints the judge's agreement with the rule per
class of response (right answers; wrong numbers; malformed: anything but a bare number;
empty), early and late in the run, and the responses it over-scores most often. Figure 1
measures agreement on held-out answers of the shapes the judge was trained on; this
measures it where the reward is used.

    uv run --frozen --no-sync python benchmarks/genrm_policy_agreement.py [steps=N] \
        [out=PATH.jsonl] [key=value ...]

`rejudge=PATH.jsonl` runs no job: the judge the recipe config names (built and cached as
the job would) re-scores the responses recorded in PATH, greedy, through transformers, and
the same tables are printed; so a judge trained differently is measured on the samples
that fooled the old one.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import sys
from pathlib import Path


def response_class(response: str, rule: float) -> str:
    """right (rule 1, a bare number), wrong (a bare number, rule 0), malformed, empty."""
    s = response.strip()
    if not s:
        return "empty"
    if not re.fullmatch(r"\d+", s):
        return "malformed, rule right" if rule >= 0.5 else "malformed, rule wrong"
    return "right" if rule >= 0.5 else "wrong number"


def record_judgments(records: list[dict]) -> None:
    """Patch `GenRMJudge` so every score it returns is appended to `records`."""
    from offbeat.core.rewards import genrm

    judge_cls = genrm.GenRMJudge
    call, score, new_step = judge_cls._call, judge_cls.score, judge_cls.new_step
    texts: dict[str, str] = {}
    step = [1]

    async def _call(self, prompt: str) -> str:
        texts[prompt] = text = await call(self, prompt)
        return text

    async def _score(self, question, response, reference=None, *, data_source="",
                     rule_reward=None):  # fmt: skip
        s = await score(self, question, response, reference, data_source=data_source,
                        rule_reward=rule_reward)  # fmt: skip
        prompt = genrm.render_prompt(self.cfg, question, response, reference, self.tokenizer)
        records.append({"step": step[0], "question": question, "response": response,
                        "reference": reference, "verdict": texts.get(prompt),
                        "judge": s, "rule": rule_reward})  # fmt: skip
        return s

    def _new_step(self) -> None:
        if hasattr(self, "_cache"):
            step[0] += 1
        new_step(self)

    judge_cls._call, judge_cls.score, judge_cls.new_step = _call, _score, _new_step


def table(records: list[dict], title: str) -> None:
    by: dict[str, list[dict]] = collections.defaultdict(list)
    for r in records:
        by[response_class(r["response"], r["rule"])].append(r)
    print(f"\n### {title}: {len(records)} scored responses")
    print("| class | n | share | judge agrees with rule | judge score mean | rule mean |")
    print("|---|---|---|---|---|---|")
    for k in ("right", "wrong number", "malformed, rule right", "malformed, rule wrong", "empty"):
        rs = by.get(k, [])
        if not rs:
            continue
        agree = sum((r["judge"] >= 0.5) == (r["rule"] >= 0.5) for r in rs) / len(rs)
        js = sum(r["judge"] for r in rs) / len(rs)
        rl = sum(r["rule"] for r in rs) / len(rs)
        print(f"| {k} | {len(rs)} | {len(rs) / len(records):.0%} | {agree:.1%} | {js:.3f} | "
              f"{rl:.3f} |")  # fmt: skip
    agree = sum((r["judge"] >= 0.5) == (r["rule"] >= 0.5) for r in records) / max(len(records), 1)
    print(f"| all | {len(records)} | | **{agree:.1%}** | | |")


def rejudge(cfg, path: Path) -> list[dict]:
    """The records in `path`, each re-scored by the judge `cfg` names (`judge_scores`:
    greedy, transformers, each distinct response once)."""
    from offbeat.core.models import cache_root
    from offbeat.core.rewards.genrm import from_config, render_prompt
    from offbeat.core.rewards.genrm_job import prepare_genrm
    from offbeat.core.rewards.genrm_sft import judge_scores

    cache = cache_root()
    g = from_config(prepare_genrm(cfg, cache).reward.genrm)
    records = [json.loads(x) for x in path.read_text().splitlines()]
    unique = list({(r["question"], r["response"], r["reference"]): r for r in records})
    prompts = [[{"role": "user", "content": render_prompt(g, q, a, ref)}] for q, a, ref in unique]
    scores = dict(zip(unique, (s or 0.0 for s in judge_scores(g.model_path, g, prompts)),
                      strict=True))  # fmt: skip
    print(f"judge {g.model_path}: {len(unique)} distinct responses of {len(records)}")
    return [{**r, "judge": scores[(r["question"], r["response"], r["reference"])],
             "verdict": None} for r in records]  # fmt: skip


def main() -> None:
    import ray

    from offbeat.core.cli import load_recipe_config

    args = sys.argv[1:]
    n = next((int(a.split("=", 1)[1]) for a in args if a.startswith("steps=")), 12)
    out = Path(next((a.split("=", 1)[1] for a in args if a.startswith("out=")),
                    "outputs/genrm_policy_agreement.jsonl"))  # fmt: skip
    again = next((Path(a.split("=", 1)[1]) for a in args if a.startswith("rejudge=")), None)
    extra = [a for a in args if not a.startswith(("steps=", "out=", "rejudge="))]
    module, cfg = load_recipe_config("genrm", [
        "runtime.progress_bar=false", "trainer.loggers=[jsonl]", f"trainer.total_training_steps={n}",
        f"trainer.test_freq={n}", "trainer.experiment_name=genrm_policy_agreement", *extra,
    ])  # fmt: skip
    records: list[dict] = []
    if again is not None:
        records = rejudge(cfg, again)
        n = max(r["step"] for r in records)
    else:
        record_judgments(records)
        affinity = os.sched_getaffinity(0)
        try:
            asyncio.run(module.run_genrm(cfg))
        finally:
            os.sched_setaffinity(0, affinity)
            ray.shutdown()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in records))
    half = max(r["step"] for r in records) // 2 if records else 0
    table([r for r in records if r["step"] <= max(half, 1)], f"steps 1..{max(half, 1)}")
    table([r for r in records if r["step"] > max(half, 1)], f"steps {max(half, 1) + 1}..{n}")
    wrong = collections.Counter(
        (r["response"], r["reference"], r["verdict"]) for r in records
        if r["judge"] >= 0.5 and r["rule"] < 0.5
    )  # fmt: skip
    print("\nmost frequent over-scored (judge right, rule wrong): response | ref | verdict | n")
    for (resp, ref, v), c in wrong.most_common(15):
        print(f"  {resp!r} | {ref} | {v!r} | {c}")
    missed = collections.Counter(
        (r["response"], r["reference"], r["verdict"]) for r in records
        if r["judge"] < 0.5 and r["rule"] >= 0.5
    )  # fmt: skip
    print("most frequent under-scored (judge wrong, rule right):")
    for (resp, ref, v), c in missed.most_common(8):
        print(f"  {resp!r} | {ref} | {v!r} | {c}")
    print(f"records: {again or out}; load average {Path('/proc/loadavg').read_text().split()[:3]}")


if __name__ == "__main__":
    main()
