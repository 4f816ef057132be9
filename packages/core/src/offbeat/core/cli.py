"""The `offbeat` console script: `offbeat run <recipe> [key=value ...]`.

`offbeat profile` and `offbeat plan` belong to offbeat-planner (`offbeat.planner.cli`);
without that package they say what to install.

Knows nothing about what a recipe does: it finds `recipes/<recipe>/` (config.yaml and
main.py), imports main.py (which may register engines and name its config schema as
`CONFIG`), loads the YAML plus Hydra-style overrides into that schema, validates the
whole config before anything starts, and calls the recipe's `main(cfg)`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
from pathlib import Path
from types import ModuleType

__all__ = [
    "find_recipes",
    "load_recipe",
    "load_recipe_config",
    "main",
    "quiet_progress_bars_off_a_terminal",
]


def _recipe_roots() -> list[Path]:
    roots = []
    if env := os.environ.get("OFFBEAT_RECIPES_DIR"):
        roots.append(Path(env))
    here = Path.cwd().resolve()
    for d in (here, *here.parents):
        if (d / "recipes").is_dir():
            roots.append(d / "recipes")
            break
    # A source checkout: <root>/packages/core/src/offbeat/core/cli.py
    src_root = Path(__file__).resolve().parents[5]
    if (src_root / "recipes").is_dir():
        roots.append(src_root / "recipes")
    out: list[Path] = []
    for r in roots:
        if r.resolve() not in out:
            out.append(r.resolve())
    return out


def find_recipes() -> dict[str, Path]:
    """name -> directory of every recipe (a folder with config.yaml and main.py)."""
    found: dict[str, Path] = {}
    for root in _recipe_roots():
        for d in sorted(root.iterdir()):
            if (d / "config.yaml").is_file() and (d / "main.py").is_file():
                found.setdefault(d.name, d)
    return found


def load_recipe(name: str) -> tuple[ModuleType, Path]:
    recipes = find_recipes()
    if name not in recipes:
        raise SystemExit(
            f"offbeat: unknown recipe {name!r}; available: {sorted(recipes) or '(none found)'} "
            f"(looked in {[str(r) for r in _recipe_roots()]}; set OFFBEAT_RECIPES_DIR)"
        )
    d = recipes[name]
    spec = importlib.util.spec_from_file_location(f"offbeat_recipe_{name}", d / "main.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module, d


def load_recipe_config(name: str, overrides: list[str]):
    """(recipe module, validated config) for `offbeat run <name> <overrides>`."""
    from offbeat.core.config import JobConfig, load_config, validate

    module, d = load_recipe(name)
    schema = getattr(module, "CONFIG", JobConfig)
    cfg = load_config(d / "config.yaml", overrides, schema=schema)
    validate(cfg)
    return module, cfg


def _parser() -> argparse.ArgumentParser:
    recipes = ", ".join(sorted(find_recipes())) or "(none found)"
    p = argparse.ArgumentParser(
        prog="offbeat",
        description="offbeat: asynchronous RL post-training for LLMs.",
        epilog=f"recipes: {recipes}\n\nexample: offbeat run separate_async trainer.total_training_steps=5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run a recipe with Hydra-style key=value overrides")
    run.add_argument("recipe", help=f"one of: {recipes}")
    run.add_argument(
        "overrides", nargs="*", help="key.sub=value, e.g. trainer.total_training_steps=3"
    )
    check = sub.add_parser("check", help="load and validate a recipe's config, start nothing")
    check.add_argument("recipe")
    check.add_argument("overrides", nargs="*")
    sub.add_parser("recipes", help="list the recipes")
    planner = _planner_cli()
    if planner is not None:
        planner.add_parsers(sub)
    else:
        for name in ("profile", "plan"):
            missing = sub.add_parser(
                name, help="needs offbeat-planner (pip install offbeat-planner)"
            )
            missing.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def _planner_cli() -> ModuleType | None:
    try:
        return importlib.import_module("offbeat.planner.cli")
    except ImportError:
        return None


def quiet_progress_bars_off_a_terminal() -> None:
    """When stdout is not a terminal, turn library progress bars off for this process and
    the ones it starts. tqdm reads TQDM_DISABLE when it is imported, so this must run
    before the recipe (and through it transformers) is imported."""
    if not (hasattr(sys.stdout, "isatty") and sys.stdout.isatty()):
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")


def main(argv: list[str] | None = None) -> int:
    from offbeat.core.config import ConfigError

    quiet_progress_bars_off_a_terminal()
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides after an option (`offbeat profile R --out P a.b=1`): argparse gives the
    # positional list what came before the option and leaves the rest over.
    if (
        extra
        and hasattr(args, "overrides")
        and all("=" in x and not x.startswith("-") for x in extra)
    ):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        _parser().print_help()
        return 0
    if args.command == "recipes":
        for name, d in sorted(find_recipes().items()):
            print(f"{name}\t{d}")
        return 0
    if args.command in ("profile", "plan") and _planner_cli() is None:
        print(f"offbeat {args.command}: needs offbeat-planner; install it: pip install offbeat-planner",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.command == "profile":  # it loads and validates the config with its own overrides
        return _planner_cli().profile_main(args)
    try:
        module, cfg = load_recipe_config(args.recipe, list(args.overrides))
    except ConfigError as e:
        print(f"offbeat: {e}", file=sys.stderr)
        return 2
    if args.command == "plan":
        return _planner_cli().plan_main(args, cfg)
    if args.command == "check":
        print(f"offbeat: config of {args.recipe!r} is valid")
        return 0
    # SIGTERM unwinds like Ctrl-C, so the job's cleanup (replicas, Ray) runs.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    result = module.main(cfg)
    return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
