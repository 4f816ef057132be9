"""`offbeat profile` and `offbeat plan`: the planner's subcommands of the `offbeat` script.

Knows the command line only; `offbeat.core.cli` hands the parsed arguments over, the
measuring lives in `measure`, the sweep in `plan`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

__all__ = ["DEFAULT_PROFILE", "add_parsers", "plan_main", "profile_main"]


def DEFAULT_PROFILE(recipe: str) -> Path:
    return Path("outputs") / "profiles" / f"{recipe}.json"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    prof = sub.add_parser(
        "profile",
        help="measure this machine for a recipe (a short traced run, the train engine) "
        "and write a profile for `offbeat plan`",
    )
    prof.add_argument("recipe")
    prof.add_argument("overrides", nargs="*")
    prof.add_argument(
        "--out", help="profile JSON to write (default outputs/profiles/<recipe>.json)"
    )
    prof.add_argument("--steps", type=int, default=6, help="steps of the short run (default 6)")
    plan = sub.add_parser(
        "plan",
        help="simulate device splits, replicas x TP, staleness and mode on a profile; rank them",
    )
    plan.add_argument("recipe")
    plan.add_argument("overrides", nargs="*")
    plan.add_argument("--devices", type=int, help="devices of the cluster to plan for")
    plan.add_argument("--nodes", type=int, default=1, help="nodes they sit on (default 1)")
    plan.add_argument("--profile", help="profile JSON (default outputs/profiles/<recipe>.json)")
    plan.add_argument("--steps", type=int, default=10, help="simulated steps per candidate")
    plan.add_argument("--top", type=int, default=15, help="rows of the table")
    plan.add_argument(
        "--predict", action="store_true",
        help="print one line for the config as given: predicted: step_s=... trainer_idle=... "
        "rollout_idle=... tokens_per_s=...",
    )  # fmt: skip


def profile_main(args: argparse.Namespace) -> int:
    from offbeat.planner.measure import profile_recipe

    if args.steps < 2:
        raise SystemExit(
            f"offbeat profile: --steps={args.steps}: need >= 2 (the first is left out)"
        )
    from offbeat.core.config import ConfigError

    out = Path(args.out) if args.out else DEFAULT_PROFILE(args.recipe)
    try:
        prof = profile_recipe(args.recipe, list(args.overrides), steps=args.steps)
    except ConfigError as e:
        print(f"offbeat profile: {e}", file=sys.stderr)
        return 2
    prof.save(out)
    t, r, s, m = prof.trainer, prof.rollout, prof.sync, prof.measured
    print(f"offbeat profile: {args.recipe} on {prof.job.get('device')} -> {out}")
    print(f"  trainer ({t.devices} device): seq_len rows forward_s backward_s optimizer_s")
    for p in t.points:
        print(
            f"    {p.seq_len:6d} {p.rows:5d} {p.forward_s:9.4f} {p.backward_s:10.4f} {p.optimizer_s:11.4f}"
        )
    curve = " ".join(f"{c:g}:{v:.0f}" for c, v in zip(r.concurrency, r.tokens_per_s, strict=True))
    lens = r.response_lengths
    print(f"  rollout (per replica, TP {r.tp}) tokens/s by sequences in flight: {curve}")
    where = f"cores {r.cores}" if r.cores else "devices of its own (not pinned to cores)"
    busy = "measured" if r.device_busy_measured else "assumed"
    print(f"  replica 0 on {where}, shared by {r.shared_by} replica(s); keeps them "
          f"{r.device_busy:.2f} busy while it has requests ({busy})")  # fmt: skip
    if lens:
        print(
            f"  response lengths: {len(lens)} samples, mean {sum(lens) / len(lens):.2f}, max {max(lens)}"
        )
    print(f"  weight sync: {s.bytes / 1e6:.1f} MB at {s.transfer_gbps:.2f} GB/s, abort {s.abort_s:.4f}s, "
          f"rest {s.fixed_s:.4f}s; validation {prof.validation.seconds:.2f}s")  # fmt: skip
    print(f"  short run: step_s={m.get('step_s', 0):.3f} trainer_idle={m.get('trainer_idle', 0):.3f} "
          f"rollout_idle={m.get('rollout_idle', 0):.3f} tokens_per_s={m.get('tokens_per_s', 0):.1f}; "
          f"load average {prof.machine.get('load_avg_before')} -> {prof.machine.get('load_avg_after')}")  # fmt: skip
    return 0


def _load_profile(args: argparse.Namespace):
    from offbeat.planner.profile import Profile

    path = Path(args.profile) if args.profile else DEFAULT_PROFILE(args.recipe)
    if not path.is_file():
        raise SystemExit(
            f"offbeat plan: --profile {path}: no such file; measure one first with "
            f"`offbeat profile {args.recipe}` (or pass --profile PATH)"
        )
    try:
        return Profile.load(path), path
    except ValueError as e:
        raise SystemExit(f"offbeat plan: {e}") from e


def plan_main(args: argparse.Namespace, cfg) -> int:
    from offbeat.planner.plan import PlanRequest, assumptions, format_table, plan, predict

    profile, path = _load_profile(args)
    if args.predict:
        print(predict(cfg, profile, steps=args.steps).predict_line())
        return 0
    if args.devices is None:
        raise SystemExit(
            "offbeat plan: --devices N is required (or --predict for the config as given)"
        )
    try:
        req = PlanRequest(devices=args.devices, nodes=args.nodes, steps=args.steps)
    except ValueError as e:
        raise SystemExit(f"offbeat plan: {e}") from e
    ranked = plan(cfg, req, profile)
    if not ranked:
        raise SystemExit(
            f"offbeat plan: no split of {args.devices} devices fits: actor.ppo_mini_batch_size x "
            f"rollout.n must split over the trainer ranks, TP must divide the rollout devices"
        )
    per_node = args.devices // args.nodes
    print(f"offbeat plan: {args.recipe} on {args.devices} devices ({args.nodes} node(s) x "
          f"{per_node}), profile {path} (measured {profile.machine.get('when', '?')}, load average "
          f"{profile.machine.get('load_avg_before', '?')})")  # fmt: skip
    print("simulated, not measured. scaling assumptions:")
    for a in assumptions(profile, req):
        print(f"  - {a}")
    print(format_table(ranked, args.top))
    best = ranked[0]
    r = best.result
    print(f"best: {best.label()}, {best.trainer_devices} trainer device(s), {best.replicas} "
          f"replica(s) x TP {best.tp}: step_s={r.step_s:.3f} tokens_per_s={r.tokens_per_s:.1f}")  # fmt: skip
    words = [*args.overrides, *best.overrides(args.nodes, args.devices, cfg)]
    print("run it with:")
    print(f"  offbeat run {args.recipe} " + " ".join(shlex.quote(w) for w in words))
    return 0
