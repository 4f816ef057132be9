"""The generic name → object registry: registration, lookup, plugins, built-in modules."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types
from importlib.metadata import EntryPoint

import pytest

from offbeat.core import registry as registry_mod
from offbeat.core.registry import Registry, UnknownNameError


def test_register_get_and_decorator():
    reg: Registry[object] = Registry("widget")
    a = object()
    assert reg.register("a", a) is a

    @reg.register("b")
    def b():
        return 1

    assert reg.get("a") is a and reg.get("b") is b
    assert reg.names() == ["a", "b"] and "a" in reg and "zz" not in reg and len(reg) == 2
    assert list(reg) == ["a", "b"]


def test_duplicate_name_is_an_error_unless_override_or_same_object():
    reg: Registry[object] = Registry("widget")
    a, b = object(), object()
    reg.register("a", a)
    reg.register("a", a)  # re-import of the same provider
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", b)
    reg.register("a", b, override=True)
    assert reg.get("a") is b
    with pytest.raises(ValueError, match="non-empty string"):
        reg.register("", a)


def test_unknown_name_lists_registered():
    reg: Registry[int] = Registry("widget")
    reg.register("x", 1)
    reg.register("y", 2)
    with pytest.raises(UnknownNameError) as ei:
        reg.get("z")
    assert str(ei.value) == "unknown widget 'z'; registered: x, y"
    assert ei.value.known == ["x", "y"]
    assert isinstance(ei.value, KeyError)
    with pytest.raises(UnknownNameError, match=r"\(none registered\)"):
        Registry("empty").get("a")


def _fake_entry_points(monkeypatch, group: str, name: str, value: str) -> None:
    ep = EntryPoint(name=name, value=value, group=group)
    monkeypatch.setattr(
        registry_mod, "entry_points", lambda group: [ep] if group == ep.group else []
    )


def test_entry_point_hook_registers_lazily(monkeypatch):
    reg: Registry[str] = Registry("gadget", entry_point_group="test.gadgets")
    calls = []
    mod = types.ModuleType("fake_gadget_plugin")

    def register():
        calls.append(1)
        reg.register("fancy", "the fancy gadget")

    mod.register = register
    monkeypatch.setitem(sys.modules, "fake_gadget_plugin", mod)
    _fake_entry_points(monkeypatch, "test.gadgets", "fancy", "fake_gadget_plugin:register")

    assert "fancy" in reg.names() and calls == []  # listed without being loaded
    assert reg.get("fancy") == "the fancy gadget" and calls == [1]
    assert reg.get("fancy") == "the fancy gadget" and calls == [1]


def test_membership_of_a_registered_name_scans_no_entry_points(monkeypatch):
    reg: Registry[str] = Registry("gadget", entry_point_group="test.gadgets")
    reg.register("plain", "a plain gadget")
    _fake_entry_points(monkeypatch, "test.gadgets", "fancy", "fake_gadget_plugin:register")
    scans = []
    real = registry_mod.entry_points
    monkeypatch.setattr(
        registry_mod, "entry_points", lambda group: scans.append(group) or real(group=group)
    )
    assert "plain" in reg and scans == []  # `in` runs per sample on hot paths
    assert "fancy" in reg and scans == ["test.gadgets"]  # plugins are still found
    assert "nothing" not in reg and 5 not in reg


def test_entry_point_hook_errors_surface(monkeypatch):
    reg: Registry[str] = Registry("gadget", entry_point_group="test.gadgets")
    mod = types.ModuleType("fake_broken_plugin")
    mod.register = lambda: None  # forgets to register
    mod.raising = lambda: (_ for _ in ()).throw(ImportError("install fancy-extra"))
    monkeypatch.setitem(sys.modules, "fake_broken_plugin", mod)
    _fake_entry_points(monkeypatch, "test.gadgets", "lazy", "fake_broken_plugin:register")
    with pytest.raises(RuntimeError, match="did not register gadget 'lazy'"):
        reg.get("lazy")
    _fake_entry_points(monkeypatch, "test.gadgets", "needy", "fake_broken_plugin:raising")
    with pytest.raises(ImportError, match="install fancy-extra"):
        reg.get("needy")


def test_builtin_modules_imported_on_first_lookup(monkeypatch):
    reg: Registry[int] = Registry("thing", builtin_modules=("fake_builtin_provider",))
    mod = types.ModuleType("fake_builtin_provider")
    monkeypatch.setitem(sys.modules, "fake_builtin_provider", mod)
    imported = []
    real_import = registry_mod.importlib.import_module

    def fake_import(name):
        imported.append(name)
        reg.register("builtin", 7)
        return real_import(name)

    monkeypatch.setattr(registry_mod.importlib, "import_module", fake_import)
    assert reg.get("builtin") == 7 and imported == ["fake_builtin_provider"]
    reg.names()
    assert imported == ["fake_builtin_provider"]  # only once


def test_absent_builtin_module_is_skipped_but_broken_one_raises():
    absent: Registry[int] = Registry("thing", builtin_modules=("offbeat.core._no_such_mod",))
    assert absent.names() == []
    broken: Registry[int] = Registry("thing", builtin_modules=("fake_broken_builtin",))
    sys.modules.pop("fake_broken_builtin", None)
    code = "import no_such_dependency_xyz\n"  # a provider that exists but is broken

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name == "fake_broken_builtin":
                return importlib.util.spec_from_loader(name, self)
            return None

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            exec(code, module.__dict__)

    finder = Finder()
    sys.meta_path.insert(0, finder)
    try:
        with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
            broken.names()
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("fake_broken_builtin", None)
