"""Build a typed `JobConfig` from a recipe YAML plus Hydra-style command-line overrides.

Knows only OmegaConf: no process is started and no rule beyond types is checked here
(call `validate` next). Every type error and unknown key of the YAML and the overrides is
collected and raised as one `ConfigError`, like `validate` does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from offbeat.core.config.schema import JobConfig
from offbeat.core.config.validation import ConfigError, Problem

__all__ = ["load_config", "parse_overrides"]

C = TypeVar("C")


def load_config(
    yaml_path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    schema: type[C] = JobConfig,  # type: ignore[assignment]
) -> C:
    """`schema` defaults ← the YAML file ← `overrides` ("key.sub=value"), as a dataclass.

    Overrides use Hydra's simple syntax: `a.b=1`, `+a.b=1` / `++a.b=1` (same here: the
    schema decides which keys exist), values parsed as YAML (`x=[1,2]`, `y=null`). As in
    Hydra, a list replaces a list and a mapping merges into a mapping, so `a.map={}` would
    change nothing: it is reported instead.
    Pass a subclass of `JobConfig` as `schema` to load a recipe's extended config.
    """
    cfg: DictConfig = OmegaConf.structured(schema)
    problems: list[Problem] = []
    if yaml_path is not None:
        raw = OmegaConf.to_container(OmegaConf.load(Path(yaml_path)), resolve=False)
        if not isinstance(raw, dict):
            raise ConfigError([Problem(str(yaml_path), raw, "the YAML must be a mapping")])
        for key, value in _leaves(raw):
            _merge_one(cfg, key, value, problems)
    for key, value in parse_overrides(overrides, problems):
        if (
            value == {}
            and isinstance(current := OmegaConf.select(cfg, key), DictConfig)
            and current
        ):
            # Hydra merges a mapping into a mapping: `{}` would silently change nothing.
            problems.append(
                Problem(
                    key,
                    value,
                    f"an empty mapping merges into {OmegaConf.to_container(current)} and "
                    f"changes nothing; override its keys one by one ({key}.NAME=value)",
                )
            )
            continue
        _merge_one(cfg, key, value, problems)
    if problems:
        raise ConfigError(problems)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def parse_overrides(
    overrides: Sequence[str], problems: list[Problem] | None = None
) -> list[tuple[str, Any]]:
    """`["a.b=1", "++c=[x]"]` → `[("a.b", 1), ("c", ["x"])]` (values parsed as YAML)."""
    out: list[tuple[str, Any]] = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.lstrip("+").strip()
        if not sep or not key or key.startswith("~"):
            p = Problem(item, None, "overrides look like key.sub=value (deletion is not supported)")
            if problems is None:
                raise ConfigError([p])
            problems.append(p)
            continue
        value = (
            OmegaConf.create({"v": text}) if text == "" else OmegaConf.from_dotlist([f"v={text}"])
        )
        out.append((key, OmegaConf.to_container(value)["v"]))  # type: ignore[index]
    return out


def _leaves(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    # Merge leaf by leaf so one bad value does not hide the next. Empty mappings are
    # leaves too (e.g. `engine_kwargs: {}`).
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _leaves(v, key + ".")
        else:
            yield key, v


# Keys that moved: an old config names the new place.
MOVED = {"runtime.stall_timeout_s": "trainer.stall_timeout_s"}


def _merge_one(cfg: DictConfig, key: str, value: Any, problems: list[Problem]) -> None:
    nested: Any = value
    for part in reversed(key.split(".")):
        nested = {part: nested}
    try:
        cfg.merge_with(nested)
    except ConfigKeyError:
        if key in MOVED:
            problems.append(Problem(key, value, f"moved: set {MOVED[key]} instead"))
            return
        parent = key.rpartition(".")[0]
        node = OmegaConf.select(cfg, parent) if parent else cfg
        while parent and not isinstance(node, DictConfig):  # deepest section that exists
            parent = parent.rpartition(".")[0]
            node = OmegaConf.select(cfg, parent) if parent else cfg
        valid = ", ".join(str(k) for k in node)
        where = f"in {parent}" if parent else "at the top level"
        problems.append(Problem(key, value, f"unknown key {where}; valid keys: {valid}"))
    except OmegaConfBaseException as e:
        first_line = str(getattr(e, "msg", e)).splitlines()[0]
        problems.append(Problem(key, value, first_line))
