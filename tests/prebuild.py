"""Build what the recipe e2e tests need into the session's cache, ahead of them.

The root conftest starts one process per target at the start of a full session (never
in `--fast`), one torch thread each, niced, so the supervised builds (the GenRM judge,
the OPD teachers, the tool recipe's warm start, the students' warm starts) run on what
the unit and package tests leave of the machine. A test that needs them waits for every
target it names (`@pytest.mark.prebuilt(...)`: waits for `<target>.done`); a build
that failed here is built again by the test itself (every build is cached atomically, so two builders of one entry
cannot corrupt it).

    python tests/prebuild.py <cache root> <target>   # writes <cache root>/prebuild/<target>.*
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
from pathlib import Path

TARGETS = ("judge", "teacher-char_match", "teacher-math", "tools", "students")


def build(target: str) -> None:
    import torch

    torch.set_num_threads(1)
    from offbeat.core.cli import load_recipe_config
    from offbeat.core.distill.build import build_teachers, write_mixed_task_files
    from offbeat.core.models import cache_root
    from offbeat.core.rewards.genrm_job import prepare_genrm
    from offbeat.core.trainer.prepare import prepare

    cache = cache_root()
    if target == "judge":
        _, g = load_recipe_config("genrm", [])
        prepare(prepare_genrm(g, cache))
    elif target.startswith("teacher-"):
        _, o = load_recipe_config("opd", [])
        name = target.removeprefix("teacher-")
        build_teachers({name: o.distillation.teachers[name]}, cache, prompt_key=o.data.prompt_key)
    elif target == "tools":
        module, t = load_recipe_config("separate_async_tools", [])
        module.warm_start_on_tool_traces(t)
    elif target == "students":
        _, cfg = load_recipe_config("separate_async", [])
        prepare(cfg)
        _, o = load_recipe_config("opd", [])
        train, val = write_mixed_task_files(list(o.distillation.tasks), cache / "tasks")
        prepare(dataclasses.replace(
            o, data=dataclasses.replace(o.data, train_files=train, val_files=val)
        ))  # fmt: skip
    else:
        raise SystemExit(f"prebuild: unknown target {target!r}; targets: {', '.join(TARGETS)}")


def main(root: Path, target: str) -> int:
    out = root / "prebuild"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rc = 0
    try:
        build(target)
        print(f"{target} built in {time.perf_counter() - t0:.0f}s", flush=True)
    except BaseException:  # the test builds it itself: say why here, never hide it
        traceback.print_exc()
        rc = 1
    finally:
        # written whole, then renamed: a waiter never reads a half-written (empty) file
        tmp = out / f"{target}.done.tmp"
        tmp.write_text(f"{rc}\n")
        os.replace(tmp, out / f"{target}.done")
    return rc


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
