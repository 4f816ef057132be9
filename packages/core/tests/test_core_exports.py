"""`offbeat.core` resolves every public name lazily and imports nothing heavy up front;
every public module's `__all__` names what it defines and nothing it lacks."""

import importlib
import inspect
import pkgutil
import subprocess
import sys
import types

import pytest

import offbeat.core as core


def export_problems(module: types.ModuleType) -> list[str]:
    """What is wrong with `module.__all__`: a name that does not resolve, a duplicate, a
    public class or function defined here but not listed, and (for a package) a re-export
    that its defining module does not list. Empty when all is well."""
    name = module.__name__
    listed = getattr(module, "__all__", None)
    if listed is None:
        return [f"{name}: no __all__"] if hasattr(module, "__path__") else []
    problems = [f"{name}.__all__ lists {n!r}, which does not resolve" for n in listed
                if not hasattr(module, n)]  # fmt: skip
    problems += [f"{name}.__all__ lists {n!r} twice" for n in sorted(set(listed))
                 if listed.count(n) > 1]  # fmt: skip
    for attr, obj in vars(module).items():
        if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        home = getattr(obj, "__module__", None)
        if home == name and attr not in listed:
            problems.append(f"{name} defines public {attr!r} but __all__ does not list it")
    if hasattr(module, "__path__"):  # a package re-exports from its own modules
        for attr in listed:
            obj = getattr(module, attr, None)
            home = sys.modules.get(getattr(obj, "__module__", "") or "")
            if (
                home is not None
                and home is not module
                and home.__name__.startswith(name + ".")
                and attr in vars(home)
                and attr not in getattr(home, "__all__", [attr])
            ):
                problems.append(
                    f"{name} re-exports {attr!r} but {home.__name__}.__all__ does not list it"
                )
    return problems


def _public_modules() -> list[str]:
    names = [core.__name__]
    for info in pkgutil.walk_packages(core.__path__, core.__name__ + "."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


def test_every_exported_name_resolves_to_its_modules_object():
    assert set(core.__all__) == {"__version__", *core._WHERE}
    for name in core.__all__:
        if name == "__version__":
            continue
        home = importlib.import_module(core._WHERE[name])
        assert name in home.__all__, f"offbeat.core.{name}: not public in {home.__name__}"
        assert getattr(core, name) is getattr(home, name), name


@pytest.mark.parametrize("module_name", _public_modules())
def test_public_module_all_matches_what_it_defines(module_name):
    assert export_problems(importlib.import_module(module_name)) == []


def test_export_check_catches_a_broken_module():
    mod = types.ModuleType("fake_pkg")
    mod.__path__ = []  # a package
    sub = types.ModuleType("fake_pkg.sub")
    sub.__all__ = ["listed"]

    def listed(): ...

    def hidden(): ...

    def unlisted(): ...

    for fn, home in ((listed, sub), (hidden, sub), (unlisted, mod)):
        fn.__module__ = home.__name__
        setattr(home, fn.__name__, fn)
    mod.listed, mod.hidden, mod.unlisted = listed, hidden, unlisted
    mod.__all__ = ["listed", "hidden", "listed", "ghost"]
    sys.modules["fake_pkg.sub"] = sub
    try:
        problems = export_problems(mod)
    finally:
        del sys.modules["fake_pkg.sub"]
    assert problems == [
        "fake_pkg.__all__ lists 'ghost', which does not resolve",
        "fake_pkg.__all__ lists 'listed' twice",
        "fake_pkg defines public 'unlisted' but __all__ does not list it",
        "fake_pkg re-exports 'hidden' but fake_pkg.sub.__all__ does not list it",
    ]
    assert export_problems(types.ModuleType("no_all_plain_module")) == []
    bare = types.ModuleType("bare_pkg")
    bare.__path__ = []
    assert export_problems(bare) == ["bare_pkg: no __all__"]


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="does_not_exist"):
        core.does_not_exist  # noqa: B018


def test_import_is_cheap_and_names_resolve_lazily():
    code = (
        "import sys, offbeat.core as c\n"
        "heavy = ('torch', 'ray', 'transformers', 'vllm')\n"
        "before = sorted(m for m in sys.modules if m.startswith('offbeat.') or m in heavy)\n"
        "c.MetricsAggregator\n"
        "after = sorted(m for m in ('ray', 'transformers', 'vllm') if m in sys.modules)\n"
        "print(before, after)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # nothing but the package itself up front; touching a light name pulls in no heavy one
    assert out.stdout.strip() == "['offbeat.core'] []"
