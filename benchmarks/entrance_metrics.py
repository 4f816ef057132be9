"""How readable the entrance is (issue 30's "before and after"), for this tree and a base.

For the working tree and for a git revision (`--base`, default `main`), read from the same
run: lines of the job assembly (`offbeat/core/trainer/job.py`) and of its largest
functions, the import fan-out of that module (offbeat modules it imports, at module level
and inside functions) and its fan-in (source modules of the workspace that import it), the
count of `cfg: Any` in core, the import cycles among offbeat.core's modules, the lines of
the rollout engines' Ray proxies, the largest functions of the training loop
(`trainer/trainer.py`), and the lines the Megatron backend repeats of core's train
package (runs of 6 or more identical non-blank lines, `difflib`). Static (ast), no import
is run.

    python benchmarks/entrance_metrics.py [--base main]
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = "packages/core/src/offbeat/core/trainer/job.py"
JOB_MODULE = "offbeat.core.trainer.job"
CORE = "packages/core/src/"
TRAINER = "packages/core/src/offbeat/core/trainer/trainer.py"
MEGATRON = "packages/backend_megatron/src/"
CORE_TRAIN = "packages/core/src/offbeat/core/train/"
RUN = 6  # the shortest run of identical lines that counts as a copy
# The Ray proxies of the rollout engines (driver-side classes over an actor handle).
PROXIES = {
    "packages/rollout_vllm/src/offbeat/rollout_vllm/actor.py": "RemoteRolloutServer",
    "packages/rollout_sglang/src/offbeat/rollout_sglang/replica.py": "RemoteSGLangServer",
    "packages/core/src/offbeat/core/rollout/remote.py": "RemoteRolloutServer",
}


class Tree:
    """The workspace's Python sources at a revision (None: the working tree)."""

    def __init__(self, rev: str | None) -> None:
        self.rev = rev

    def files(self) -> list[str]:
        if self.rev is None:
            out = subprocess.run(
                ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                cwd=ROOT, capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            return [f for f in out.split() if (ROOT / f).exists()]
        out = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", self.rev],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return out.split()

    def read(self, path: str) -> str | None:
        if self.rev is None:
            p = ROOT / path
            return p.read_text() if p.exists() else None
        r = subprocess.run(
            ["git", "show", f"{self.rev}:{path}"], cwd=ROOT, capture_output=True, text=True
        )
        return r.stdout if r.returncode == 0 else None


def module_of(path: str) -> str | None:
    """`packages/<pkg>/src/offbeat/x/y.py` -> `offbeat.x.y` (None outside a package src)."""
    m = re.match(r"packages/[^/]+/src/(offbeat/.*)\.py$", path)
    if not m:
        return None
    name = m.group(1).replace("/", ".")
    return name.removesuffix(".__init__")


def imports_of(source: str, module: str, is_pkg: bool, mods: set[str]) -> set[str]:
    """The workspace modules `source` imports, anywhere in it (relative imports resolved;
    `from pkg import sub` is an import of `pkg.sub`; the implicit import of a parent
    package is not counted)."""
    out: set[str] = set()
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[: len(base) - node.level + 1]
                name = ".".join(prefix + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            subs = {f"{name}.{a.name}" for a in node.names} & mods
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(name)
    return {m for m in out if m in mods and m != module}


def graph(tree: Tree, prefix: str = "offbeat.") -> dict[str, set[str]]:
    """module -> the workspace modules it imports."""
    sources = {}
    for f in tree.files():
        mod = module_of(f)
        if mod and mod.startswith(prefix.rstrip(".")):
            text = tree.read(f)
            if text is not None:
                sources[mod] = (text, f.endswith("__init__.py"))
    mods = set(sources)
    return {m: imports_of(text, m, pkg, mods) for m, (text, pkg) in sources.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]


def largest(source: str, n: int = 4, classes: bool = False) -> str:
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef) + ((ast.ClassDef,) if classes else ())
    spans = sorted(
        ((span(x), x.name) for x in ast.walk(ast.parse(source)) if isinstance(x, kinds)),
        reverse=True,
    )
    return ", ".join(f"{name} {lines}" for lines, name in spans[:n])


def shared_lines(tree: Tree) -> int:
    """Lines of the Megatron backend's sources inside runs of `RUN`+ identical non-blank
    lines (stripped) that also occur in a module of core's train package."""
    import difflib

    def lines(path: str) -> list[str]:
        return [x.strip() for x in (tree.read(path) or "").splitlines() if x.strip()]

    files = [f for f in tree.files() if f.endswith(".py")]
    core = [lines(f) for f in files if f.startswith(CORE_TRAIN)]
    total = 0
    for f in files:
        if not f.startswith(MEGATRON):
            continue
        a = lines(f)
        hit = [False] * len(a)
        for b in core:
            m = difflib.SequenceMatcher(None, a, b, autojunk=False)
            for blk in m.get_matching_blocks():
                if blk.size >= RUN:
                    hit[blk.a : blk.a + blk.size] = [True] * blk.size
        total += sum(hit)
    return total


def metrics(tree: Tree) -> dict[str, object]:
    job = tree.read(JOB) or ""
    g = graph(tree)
    fan_in = sorted(m for m, deps in g.items() if JOB_MODULE in deps)
    cfg_any = 0
    for f in tree.files():
        if f.startswith(CORE) and f.endswith(".py"):
            cfg_any += len(re.findall(r"\bcfg: Any\b", tree.read(f) or ""))
    core = {m: {d for d in deps if d.startswith("offbeat.core")} for m, deps in g.items()}
    core = {m: d for m, d in core.items() if m.startswith("offbeat.core")}
    proxy_lines = 0
    for path, cls in PROXIES.items():
        text = tree.read(path)
        if text:
            for n in ast.parse(text).body:
                if isinstance(n, ast.ClassDef) and n.name == cls:
                    proxy_lines += span(n)
    proxies = sum(
        1
        for path, cls in PROXIES.items()
        if (t := tree.read(path)) and re.search(rf"^class {cls}\b", t, re.M)
    )
    return {
        "job.py lines": len(job.splitlines()),
        "job.py largest functions": largest(job),
        "job.py fan-out (offbeat modules)": len(g.get(JOB_MODULE, ())),
        "job.py fan-in (workspace modules)": len(fan_in),
        "cfg: Any in core": cfg_any,
        "import cycles in offbeat.core": "; ".join(" <-> ".join(c) for c in cycles(core)) or "none",
        "engine Ray proxies (classes, lines)": f"{proxies}, {proxy_lines}",
        "trainer.py largest (classes, functions)": largest(tree.read(TRAINER) or "", classes=True),
        f"Megatron lines repeating core's train package (runs of {RUN}+)": shared_lines(tree),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main", help="the git revision to compare with")
    args = ap.parse_args()
    base, here = metrics(Tree(args.base)), metrics(Tree(None))
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(f"entrance metrics: base {args.base} vs this tree (HEAD {head} + working changes)")
    for key in base:
        print(f"\n{key}\n  base: {base[key]}\n  this: {here[key]}")


if __name__ == "__main__":
    main()
