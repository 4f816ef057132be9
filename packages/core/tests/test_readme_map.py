"""The core README's "Where things are" map names every module of core: a module added
without a line there fails here (a glob such as `train/_*.py` or a package `agent/`
covers its files)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[1]
SRC = CORE / "src" / "offbeat" / "core"


def test_the_readme_map_names_every_core_module():
    text = (CORE / "README.md").read_text()
    table = text[text.index("Where things are") :]
    named = set(re.findall(r"`([\w/*.]+(?:\.py|/))`", table))
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if path.name == "__init__.py" or "__pycache__" in rel:
            continue
        covered = any(
            rel == n or fnmatch.fnmatch(rel, n) or (n.endswith("/") and rel.startswith(n))
            for n in named
        )
        if not covered:
            missing.append(rel)
    assert not missing, f"modules the README's map does not name: {missing}"
