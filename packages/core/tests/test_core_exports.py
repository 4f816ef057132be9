"""`offbeat.core` resolves every public name lazily and imports nothing heavy up front."""

import subprocess
import sys

import offbeat.core as core


def test_every_exported_name_resolves():
    for name in core.__all__:
        assert getattr(core, name) is not None, name


def test_unknown_name_raises_attribute_error():
    try:
        core.does_not_exist  # noqa: B018
    except AttributeError as e:
        assert "does_not_exist" in str(e)
    else:
        raise AssertionError("expected AttributeError")


def test_import_is_cheap():
    code = "import sys, offbeat.core; print(sorted(m for m in ('ray', 'transformers', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
