"""Does the tool task's warm start teach the tiny model to call the calculator on the
row's own numbers? Greedy first turn of the warm-started model (transformers), on the
task's validation rows: well-formed calls, and calls whose expression is exactly the
row's. The run's reward depends on the second: a call on other numbers returns a wrong
product. Baseline: the recipe's own warm start (its `tool_warm_start.steps`), beside
each `--steps` asked, same rows. Warm starts are cached (a second run reuses them).

    uv run --frozen --no-sync python benchmarks/agent_tool_call_copy.py \
        [--steps 1000] [--rows 32] [key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def evaluate(model_dir: str, cfg, rows: list[dict]) -> tuple[int, int, str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from offbeat.core.agent import TurnTemplate
    from offbeat.core.agent.tools import CALCULATOR
    from offbeat.core.tasks.rows import row_extra_info, row_messages

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    template = TurnTemplate(tok, cfg.agent.eos_ids)
    formed = exact = 0
    example = ""
    for row in rows:
        ids = template.prompt_ids(row_messages(row, cfg.data.prompt_key), [CALCULATOR.schema()])
        out = model.generate(torch.tensor([ids]), max_new_tokens=100, do_sample=False)
        text = tok.decode(out[0, len(ids) :])
        expression = row_extra_info(row)["expression"]
        formed += text.startswith('<tool_call>{"name": "calculator", "arguments": {"expression"')
        exact += f'"expression": "{expression}"' in text
        example = example or f"asked {expression!r}, called: {text[:90]!r}"
    return formed, exact, example


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, nargs="*", default=[1000])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from offbeat.core.cli import load_recipe_config
    from offbeat.core.tasks import read_parquet
    from offbeat.core.trainer.prepare import resolve_data

    module, cfg = load_recipe_config("separate_async_tools", args.overrides)
    cache = Path.home() / ".cache" / "offbeat"
    _, val_files = resolve_data(cfg, cache / "tasks")
    rows = [r for f in val_files for r in read_parquet(f)][: args.rows]
    print(f"tool task {cfg.task.name} {cfg.task.min_len}-{cfg.task.max_len} digits, "
          f"{len(rows)} validation rows, greedy; load before {loadavg()}")  # fmt: skip
    print(f"{'warm-start steps':>17} {'train_s':>8} {'well-formed':>12} {'exact calls':>12}")
    for steps in [cfg.tool_warm_start.steps, *args.steps]:
        ws = dataclasses.replace(cfg.tool_warm_start, steps=steps)
        t0 = time.perf_counter()
        warm = module.warm_start_on_tool_traces(dataclasses.replace(cfg, tool_warm_start=ws))
        secs = time.perf_counter() - t0
        formed, exact, example = evaluate(warm.model.path, cfg, rows)
        tag = " (recipe)" if steps == cfg.tool_warm_start.steps else ""
        print(f"{steps:>8}{tag:>9} {secs:>8.0f} {formed:>6}/{len(rows):<5} {exact:>6}/{len(rows):<5}"
              f"  {example}")  # fmt: skip
    print(f"load after {loadavg()} (train_s: 0 = cached)")


if __name__ == "__main__":
    main()
