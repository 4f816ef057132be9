"""The planner's predictions against real runs of the default job on this machine.

    python benchmarks/planner_calibration.py [--profile P] [--steps 10] [--configs a,b,...] [--repeat 3]
    python benchmarks/planner_calibration.py --gpu --configs async_t2,sync,async_t3,wait_t1 \
        --out benchmarks/results/planner_calibration_gpu.txt      # one CUDA GPU

`--gpu` adds the one-GPU overrides of `gpu_separate_async.py` (the trainer and one replica
share the GPU) to the profile and to every run; a configuration with two replicas needs two
GPUs.

1. `offbeat profile separate_async` (unless --profile names one already measured);
2. for each configuration: the simulator's prediction is printed and written to the
   results file first, then the job runs (`offbeat run separate_async <overrides>`, short,
   no validation, no checkpoint) and its own metrics give the measured side: the mean over
   the steps after the first of timing/step_s, perf/trainer_idle_frac,
   perf/rollout_idle_frac, perf/tokens_per_s (the same window the simulator averages);
3. a table of predicted against measured, the error of each, and a plot
   (benchmarks/results/planner_calibration.png). The load average is recorded around every
   run: on a shared machine the profile and the runs see different contention.

Each run is traced and records its batches, so it can be profiled after the fact
(`profile_from_run`, the train engine's points kept from the profile and levelled on the
run's own updates): "replayed" is the simulator on the run's own profile. It separates the
two sources of error: the pipeline model (replayed against measured) and the machine
changing between the profile and the run (predicted against replayed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OFFBEAT = [sys.executable, "-m", "offbeat.core.cli"]

CONFIGS = {
    "async_t2": [],  # the default: separate_async, drop, threshold 2, one warm-up batch
    "sync": ["trainer.mode=sync"],
    "async_t3": [
        "async_training.max_off_policy_threshold=3",
        "async_training.num_warmup_batches=2",
    ],
    "wait_t1": [
        "async_training.max_off_policy_strategy=wait",
        "async_training.max_off_policy_threshold=1",
    ],
    "async_2rep": ["resources.devices_per_node=3", "resources.rollout_devices=2"],
}
KEYS = ("step_s", "trainer_idle", "rollout_idle", "tokens_per_s")


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def short(steps: int, log_dir: Path) -> list[str]:
    """The run's flags: `profile_from_run` reads <log_dir>/profile and <log_dir>/record."""
    return [
        f"trainer.total_training_steps={steps}", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=-1",
        "trainer.loggers=[jsonl]", f"trainer.log_dir={log_dir}",
        "trainer.experiment_name=profile", "trainer.trace=true",
        f"rollout.record.dir={log_dir / 'record'}",
    ]  # fmt: skip


def measured(run_dir: Path) -> dict[str, float]:
    from offbeat.planner.measure import run_figures

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_figures(rows, skip=1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", help="a profile already measured (default: measure one now)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument(
        "--repeat", type=int, default=1,
        help="runs of each configuration, taking turns; the tables give the medians",
    )  # fmt: skip
    ap.add_argument("--out", default=str(RESULTS / "planner_calibration.txt"))
    ap.add_argument(
        "--reuse", help="runs made before (their folder): predict and replay only, run nothing"
    )
    ap.add_argument("--gpu", action="store_true", help="one CUDA GPU (see above)")
    ap.add_argument(
        "--measured",
        help="an earlier series' results file: predict on --profile against the figures it "
        "measured (its runs are gone: no replay), run nothing",
    )
    ap.add_argument(
        "--device-busy", type=float,
        help="with --measured: set the profile's rollout.device_busy (a what-if; not measured)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.measured:
        return against_measured(args)
    base: list[str] = []
    if args.gpu:
        from gpu_separate_async import GPU_OVERRIDES

        base = [o for o in GPU_OVERRIDES if not o.startswith("trainer.loggers=")]
    plot_path = Path(args.out).with_suffix(".png")
    from offbeat.core.cli import load_recipe_config
    from offbeat.planner import Profile, predict
    from offbeat.planner.measure import profile_from_run

    out = open(args.out, "w")  # noqa: SIM115

    def say(line: str = "") -> None:
        print(line, flush=True)
        out.write(line + "\n")
        out.flush()

    say(f"# python benchmarks/planner_calibration.py {' '.join(sys.argv[1:])}")
    say(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load {load()}"
    )
    work = Path(args.reuse or tempfile.mkdtemp(prefix="offbeat-calibration-"))
    if args.reuse:
        say(f"runs: reused from {work} (nothing runs now; the predictions are recomputed)")
    if args.profile:
        path = Path(args.profile)
        say(f"profile: {path} (measured earlier)")
    else:
        before = load()
        t0 = time.perf_counter()
        path = Path(args.out).with_name(Path(args.out).stem + "_profile.json")
        subprocess.run(
            [*OFFBEAT, "profile", "separate_async", *base, "--out", str(path)], check=True
        )
        say(f"profile: offbeat profile separate_async -> {path} "
            f"({time.perf_counter() - t0:.0f}s, "
            f"load {before} -> {load()})")  # fmt: skip
    profile = Profile.load(path)
    say("profile's own short run: " + " ".join(
        f"{k}={profile.measured.get(k, float('nan')):.3f}" for k in KEYS))  # fmt: skip
    ro = profile.rollout
    say(f"profile's replica: cores {ro.cores or '(not pinned)'}, shared by {ro.shared_by}, "
        f"device_busy={ro.device_busy:.3f} ({'measured' if ro.device_busy_measured else 'assumed'})")  # fmt: skip

    # Every prediction is written before any run; with --repeat the configurations take
    # turns (round 1 runs each once, then round 2, ...) and each figure is the median.
    names = args.configs.split(",")
    preds, cfgs = {}, {}
    for name in names:
        flags = short(args.steps, work / f"{name}-1")
        # a reused run's recording exists already (the rule is for new runs)
        checked = [f for f in flags if not (args.reuse and f.startswith("rollout.record."))]
        _, cfgs[name] = load_recipe_config("separate_async", [*base, *CONFIGS[name], *checked])
        preds[name] = predict(cfgs[name], profile, steps=args.steps)
        say(f"[{name}] overrides: {' '.join(CONFIGS[name]) or '(none)'}")
        say(f"[{name}] {preds[name].predict_line()}  (written before the run)")
    runs: dict[str, list[tuple[dict, dict]]] = {name: [] for name in names}
    for r in range(1, args.repeat + 1):
        for name in names:
            tag = f"{name}-{r}"
            overrides = [*base, *CONFIGS[name]]
            before = load()
            t0 = time.perf_counter()
            if not args.reuse:
                res = subprocess.run(
                    [*OFFBEAT, "run", "separate_async", *overrides, *short(args.steps, work / tag)],
                    capture_output=True, text=True,
                )  # fmt: skip
                if res.returncode != 0:
                    tail = res.stderr.strip().splitlines()[-3:]
                    say(f"[{tag}] run failed (rc {res.returncode}): {tail}")
                    continue
            elif not (work / tag / "profile" / "metrics.jsonl").is_file():
                say(f"[{tag}] no run in {work / tag}")
                continue
            wall = time.perf_counter() - t0
            m = measured(work / tag / "profile")
            how = f"wall {wall:.0f}s, load {before} -> {load()}" if not args.reuse else "reused"
            say(f"[{tag}] measured: " + " ".join(f"{k}={m.get(k, float('nan')):.4f}" for k in KEYS)
                + f"  ({m['steps']} steps, {how})")  # fmt: skip
            trainer = dataclasses.replace(profile.trainer, run_level=1.0)
            own = profile_from_run(cfgs[name], work / tag, trainer=trainer)
            # a run's profile measures no core use: the profile's (how a lone replica uses them)
            own.rollout.device_busy = profile.rollout.device_busy
            rep = predict(cfgs[name], own, steps=args.steps)
            say(f"[{tag}] replayed on the run's own profile: {rep.predict_line()}")
            say(f"[{tag}] the run's own profile against the profile: {drift(profile, own)}")
            runs[name].append((m, {k: getattr(rep, k) for k in KEYS}))
    results = []
    for name in names:
        if not runs[name]:
            continue
        med = lambda rows, k: statistics.median(row[k] for row in rows)  # noqa: E731
        ms = [m for m, _ in runs[name]]
        reps = [rep for _, rep in runs[name]]
        results.append((name, {k: getattr(preds[name], k) for k in KEYS},
                        {k: med(ms, k) for k in KEYS}, {k: med(reps, k) for k in KEYS}))  # fmt: skip
    if args.repeat > 1:
        say()
        say(f"measured: the median of {args.repeat} runs of each configuration "
            f"(step_s per run: " + "; ".join(
                f"{n} " + " ".join(f"{m['step_s']:.3f}" for m, _ in runs[n]) for n in names
            ) + ")")  # fmt: skip

    for title, col in (("predicted from the profile, before the run", 1),
                       ("replayed on the run's own profile, after it", 3)):  # fmt: skip
        say()
        say(f"{title}:")
        say("| config | step_s pred | step_s meas | err | trainer_idle pred | meas "
            "| rollout_idle pred | meas | tokens/s pred | meas | err |")  # fmt: skip
        say("|" + "---|" * 11)
        for row in results:
            name, p, m = row[0], row[col], row[2]
            err = lambda k, p=p, m=m: (p[k] - m[k]) / m[k] * 100 if m.get(k) else float("nan")  # noqa: E731
            say(f"| {name} | {p['step_s']:.3f} | {m['step_s']:.3f} | {err('step_s'):+.1f}% | "
                f"{p['trainer_idle']:.3f} | {m['trainer_idle']:.3f} | {p['rollout_idle']:.3f} | "
                f"{m['rollout_idle']:.3f} | {p['tokens_per_s']:.1f} | {m['tokens_per_s']:.1f} | "
                f"{err('tokens_per_s'):+.1f}% |")  # fmt: skip
    say(f"# load at the end {load()}")
    _plot(results, plot_path, "GPU" if args.gpu else "CPU")
    say(f"plot: {plot_path}")
    return 0


def drift(profile, own) -> str:
    """Where a run's own profile differs from the profile the prediction used: what to
    look at when predicted and replayed disagree (the machine changed, not the model)."""
    t, u = profile.trainer, own.trainer
    cs = [c for c in own.rollout.concurrency if c >= 1]
    ratios = sorted(own.rollout.rate(c) / max(profile.rollout.rate(c), 1e-9) for c in cs)
    mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    return (
        f"trainer level x{u.run_level / t.run_level:.2f}, "
        f"overhead {u.overhead_s:.3f}/{t.overhead_s:.3f} s; "
        f"rollout tok/s x{statistics.median(ratios) if ratios else float('nan'):.2f} "
        f"(median over {len(cs)} points, {min(cs, default=0):g}..{max(cs, default=0):g} in "
        f"flight); response mean {mean(own.rollout.response_lengths):.1f}/"
        f"{mean(profile.rollout.response_lengths):.1f}; "
        f"sync {own.sync.sync_s():.4f}/{profile.sync.sync_s():.4f} s (run/profile)"
    )


def against_measured(args) -> int:
    """The simulator as it is now, on a saved profile, against an earlier series' measured
    lines ("[name] measured: step_s=... trainer_idle=... rollout_idle=... tokens_per_s=...")."""
    import re

    from offbeat.core.cli import load_recipe_config
    from offbeat.planner import Profile, predict

    profile = Profile.load(args.profile)
    if args.device_busy is not None:
        profile.rollout.device_busy = args.device_busy
    # "[name] measured: ..." or, from --repeat, "[name-2] measured: ...": the median
    runs: dict[str, list[dict[str, float]]] = {}
    text = Path(args.measured).read_text()
    for m in re.finditer(r"^\[([a-z0-9_]+?)(?:-\d+)?\] measured: (.*)$", text, re.M):
        runs.setdefault(m[1], []).append(
            {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", m[2])}
        )
    found = {n: {k: statistics.median(r[k] for r in rs) for k in KEYS} for n, rs in runs.items()}
    print(f"# python benchmarks/planner_calibration.py {' '.join(sys.argv[1:])}")
    print(f"# the simulator as committed, on {args.profile}, against the figures measured in "
          f"{args.measured} (predicted before those runs: see that file)")  # fmt: skip
    print("| config | step_s pred | meas | err | trainer_idle pred | meas | rollout_idle pred "
          "| meas | err |")  # fmt: skip
    print("|" + "---|" * 9)
    for name in args.configs.split(","):
        if name not in found:
            continue
        m = found[name]
        _, cfg = load_recipe_config(
            "separate_async", [*CONFIGS[name], f"trainer.total_training_steps={args.steps}",
                               "trainer.test_freq=0", "trainer.val_before_train=false"],
        )  # fmt: skip
        p = predict(cfg, profile, steps=args.steps)
        err = lambda k, p=p, m=m: (getattr(p, k) - m[k]) / m[k] * 100  # noqa: E731
        print(f"| {name} | {p.step_s:.3f} | {m['step_s']:.3f} | {err('step_s'):+.1f}% | "
              f"{p.trainer_idle:.3f} | {m['trainer_idle']:.3f} | {p.rollout_idle:.3f} | "
              f"{m['rollout_idle']:.3f} | {err('rollout_idle'):+.1f}% |")  # fmt: skip
    ro = profile.rollout
    print(f"# profile's replica: cores {ro.cores or '(not recorded)'}, shared by {ro.shared_by}, "
          f"device_busy={ro.device_busy} ({'measured' if ro.device_busy_measured else 'assumed'})")  # fmt: skip
    return 0


def _plot(results, path: Path, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, key, label in zip(axes, ("step_s", "trainer_idle", "rollout_idle"),
                              ("step time (s)", "trainer idle fraction", "rollout idle fraction"),
                              strict=True):  # fmt: skip
        xs = [row[2][key] for row in results]
        ys = [row[1][key] for row in results]
        zs = [row[3][key] for row in results]
        ax.scatter(xs, ys, label="predicted (profile before the run)")
        ax.scatter(xs, zs, marker="x", label="replayed (the run's own profile)")
        for row, x, y in zip(results, xs, ys, strict=True):
            ax.annotate(row[0], (x, y), fontsize="small")
        hi = max([*xs, *ys, *zs, 1e-3]) * 1.15
        ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="predicted = measured")
        if key == "step_s":
            ax.fill_between([0, hi], [0, hi * 0.85], [0, hi * 1.15], alpha=0.1, label="±15%")
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.legend(fontsize="small")
    fig.suptitle(f"offbeat plan --predict against the default job's runs ({where})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
