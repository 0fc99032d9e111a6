"""The dependency rules as a check over the import graph.

Every module of every package pyproject.toml installs is parsed with `ast` (nothing is imported), its
imports resolved to modules, folders mapped through `[tool.setuptools.package-dir]`. Three kinds of
import are read: module-level ones (try/except included), late ones (inside a function: they hide a
cycle from the interpreter, not from this check) and type-only ones (under `if TYPE_CHECKING:`).
Type-only imports obey the layer rules like the others (a type from a later stage is a dependency
against the flow) but are left out of the cycle check: they never execute, which is how a cycle of
annotations is meant to be broken (point 5).

Why a test rather than import-linter: import-linter builds its graph with grimp from importable
top-level packages, so it would have to import the installed `oscar` (site-packages / the editable
finder), not read this checkout's folders through the package-dir mapping, and its contracts cannot
say "kernels may import stats.artifact but no other stats module" without one ignore line per
module. The rules below are ~30 lines of plain Python and run in ~1 s with the rest of tests/.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Shared leaves: import nothing but each other (and third-party code).
LEAVES = {"oscar", "oscar.common", "oscar.quant", "oscar.artifact_header", "oscar.constraints", "oscar.defaults",
          "oscar.modelconfig", "oscar.host", "oscar.cli_options", "oscar.native_build",
          "oscar.dirlock"}
# The entry points: the main job, the `oscar` CLI and its dispatcher import any stage.
TOP = {"oscar.run", "oscar.cli", "oscar.__main__"}
# validate's result schemas and verdict statistics: what reports reads of validation (the rows of its result files,
# the intervals and the goals), importing nothing of the stage that runs the model.
RESULTS = {"oscar.validate.evidence", "oscar.validate.intervals", "oscar.validate.ruler_outputs"}
# The CLI glue of the cluster: it hands `oscar validate`'s configs to the stage actors (the only cluster module that
# may read validate/).
CLUSTER_CLI = "oscar.cluster.cli"
# Who may import what, by component (a component is a stage package; a name with a dot is one module). The floors:
# pipeline -> stats -> kernels -> scoring -> recipe -> validate -> reports, cluster beside the recipe.
ALLOWED = {
    "leaf": {"leaf"},
    "pipeline": {"leaf", "pipeline"},
    "stats": {"leaf", "stats", "oscar.pipeline.store"},
    "kernels": {"leaf", "kernels", "oscar.stats.artifact"},
    # the engines, protocols, window NLL and needle loops: model + INT2 cache + text -> NLLs, answers, gradients
    "scoring": {"leaf", "pipeline", "stats", "kernels", "scoring"},
    # the fit stage's model-driven steps (clip tune, per-layer widths): they read the model through scoring only
    "recipe": {"leaf", "pipeline", "stats", "kernels", "scoring", "recipe"},
    "validate": {"leaf", "pipeline", "stats", "kernels", "scoring", "recipe", "validate", "ablation", "results"},
    "results": {"leaf", "results"},
    # the synthetic ablation: the quantizers and stores it measures, never the model-level validation
    "ablation": {"leaf", "pipeline", "stats", "kernels", "ablation", "results"},
    # cluster runs calibration, scoring and the recipe's gradient on the stage actors, through their public functions
    "cluster": {"leaf", "pipeline", "stats", "kernels", "scoring", "recipe", "cluster"},
    "cluster-cli": {"leaf", "pipeline", "stats", "kernels", "scoring", "recipe", "validate", "results", "cluster"},
    "reports": {"leaf", "reports", "results"},
}
# The serving cache (the product's transformers Cache) and what it may never load, directly or through another module:
# the simulators of the cache family sit beside it (kernels/backends.py builds either).
SERVING_CACHE = "oscar.kernels.cache"
SIMULATORS = {"oscar.kernels.simulate", "oscar.kernels.rowbatch", "oscar.kernels.window_attention",
              "oscar.kernels.grad_attention"}
RAY_ALLOWED = {"cluster", "cluster-cli", "top"}

# Violations tolerated while a change that removes them is under way: {violation: what removes it}.
# The test fails on any violation not listed here AND on a listed one that no longer occurs, so the
# list only shrinks. It is empty; keep it empty.
KNOWN: dict[str, str] = {
}


@dataclass(frozen=True)
class Import:
    src: str      # importing module
    dst: str      # imported module (one of ours), or a third-party top-level name
    line: int
    kind: str     # "top" | "late" | "type"
    ours: bool
    end: int = 0  # last line of the statement


def packages(root: Path) -> dict[str, Path]:
    """Package name -> folder, as setuptools maps them (listed packages; a subpackage without its own
    package-dir entry sits under its parent's folder)."""
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    pdir = cfg.get("package-dir", {})
    out = {}
    for pkg in sorted(cfg["packages"], key=len):
        if pkg in pdir:
            out[pkg] = root / pdir[pkg]
        else:
            parent, _, leaf = pkg.rpartition(".")
            out[pkg] = (out[parent] / leaf) if parent in out else root / pkg.replace(".", "/")
    return out


def modules(root: Path) -> dict[str, Path]:
    mods = {}
    for pkg, folder in packages(root).items():
        for f in sorted(folder.glob("*.py")):
            mods[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return mods


def unlisted_packages(root: Path) -> list[str]:
    """Folders with an __init__.py under a package that pyproject does not list (not installed)."""
    pk = packages(root)
    listed = {p.resolve() for p in pk.values()}
    return sorted(str(d.parent.relative_to(root)) for folder in pk.values() for d in folder.glob("*/__init__.py")
                  if d.parent.resolve() not in listed)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, known: set[str]) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.stem == "__init__" else name.rpartition(".")[0]
    out: list[Import] = []

    def resolve(mod: str) -> tuple[str, bool]:
        while mod and mod not in known and "." in mod:
            mod = mod.rpartition(".")[0]
        return (mod, True) if mod in known else (mod.split(".")[0], False)

    def add(target: str, node: ast.AST, kind: str):
        dst, ours = resolve(target)
        if dst != name:
            out.append(Import(name, dst, node.lineno, kind, ours, node.end_lineno))

    def visit(node: ast.AST, kind: str):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, node, kind)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")
                base = ".".join(up[:len(up) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                add(full if full in known else base, node, kind)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for n in node.body:
                visit(n, "type")
            for n in node.orelse:
                visit(n, kind)
            return
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind = "type" if kind == "type" else "late"
        for child in ast.iter_child_nodes(node):
            visit(child, kind)

    visit(tree, "top")
    return out


def component(mod: str) -> str:
    if mod in LEAVES:
        return "leaf"
    if mod in TOP:
        return "top"
    if mod in RESULTS:
        return "results"
    if mod == CLUSTER_CLI:
        return "cluster-cli"
    parts = mod.split(".")
    if parts[:3] == ["oscar", "validate", "ablation"]:
        return "ablation"
    return parts[1] if len(parts) > 1 else mod


def _allowed(src: str, dst: str) -> bool:
    c = component(src)
    if c == "top":
        return True
    rules = ALLOWED.get(c)
    if rules is None:  # a module of oscar/ that is neither a leaf nor the top: a new leaf must be declared
        return False
    return component(dst) in rules or dst in rules


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]; counter[0] += 1
        stack.append(start); on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1
                    stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop(); on.discard(w); comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` loads, directly or through others (executed imports: type-only ones are left out)."""
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def violations(root: Path) -> dict[str, str]:
    """Every rule broken under root: {violation: where}. A violation names the rule and the modules."""
    mods = modules(root)
    known = set(mods)
    found: dict[str, str] = {}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for imp in imports(name, path, known):
            where = f"{os.path.relpath(path, root)}:{imp.line} ({imp.kind})"
            if imp.ours:
                if imp.kind != "type":
                    graph[imp.src].add(imp.dst)
                if not _allowed(imp.src, imp.dst):
                    found.setdefault(f"layer: {imp.src} -> {imp.dst}", where)
            elif imp.dst == "ray" and component(name) not in RAY_ALLOWED:
                found.setdefault(f"ray: {imp.src}", where)
    for comp in cycles(graph):
        found[f"cycle: {' <-> '.join(comp)}"] = "modules importing each other (late imports included)"
    for sim in sorted(reachable(graph, SERVING_CACHE) & SIMULATORS):
        found[f"serving cache: {SERVING_CACHE} -> {sim}"] = ("the serving cache loads a simulator (directly or through "
                                                            "another module); kernels/backends.py builds either")
    for d in unlisted_packages(root):
        found[f"unlisted package: {d}"] = "pyproject's [tool.setuptools] packages does not list it"
    return found


# ----------------------------------------------------------------------------- validate/ holds no cache and writes no artifact

# transformers' cache bases: a class deriving from one (directly, or through a class of the same module) is a cache
CACHE_BASES = {"Cache", "CacheLayerMixin", "DynamicLayer", "DynamicCache", "StaticCache", "StaticLayer"}
# the calls that write an artifact (stats/artifact.py: the producer side of the format)
ARTIFACT_WRITERS = {"save_artifact", "save_file"}


def stage_roles(path: Path) -> list[str]:
    """What a module of validate/ must leave to other stages: cache classes (the kernels' cache family) and artifact
    writes (fit writes artifacts; a command that saves one sits beside the main job). 'LINE class NAME' / 'LINE
    writes'."""
    tree = ast.parse(path.read_text(), str(path))
    base_name = lambda b: b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")  # noqa: E731
    caches, out = set(CACHE_BASES), []
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    changed = True
    while changed:  # a class deriving from a cache class of this module is one too
        changed = False
        for c in classes:
            if c.name not in caches and any(base_name(b) in caches for b in c.bases):
                caches.add(c.name)
                changed = True
    out += [f"{c.lineno} class {c.name}" for c in classes if c.name in caches]
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and base_name(n.func) in ARTIFACT_WRITERS:
            out.append(f"{n.lineno} writes ({ast.unparse(n.func)})")
        elif isinstance(n, (ast.Import, ast.ImportFrom)) and any(a.name in ARTIFACT_WRITERS for a in n.names):
            out.append(f"{n.lineno} writes (imports {', '.join(a.name for a in n.names if a.name in ARTIFACT_WRITERS)})")
    return sorted(out, key=lambda x: int(x.split()[0]))


def validate_roles(root: Path) -> list[str]:
    mods = modules(root)
    return [f"{os.path.relpath(p, root)}:{r}" for m, p in mods.items() if component(m) in ("validate", "ablation")
            for r in stage_roles(p)]


def test_validate_defines_no_cache_and_writes_no_artifact():
    bad = validate_roles(ROOT)
    assert not bad, ("validate/ keeps recipes-to-methods and the protocols: caches belong to the kernels' cache family "
                     "(kernels/backends.py make_cache), artifacts are written by fit or the commands beside the main job "
                     "(oscar/cli.py):\n  " + "\n  ".join(bad))


def test_validate_roles_finds_caches_and_writes(tmp_path):
    root = _tree(tmp_path, {
        "validate/a.py": ("from transformers.cache_utils import Cache, DynamicLayer\nclass L(DynamicLayer):\n    pass\n"
                          "class M(L):\n    pass\nclass C(Cache):\n    pass\nclass Plain:\n    pass\n"),
        "validate/b.py": "import transformers\nclass X(transformers.cache_utils.CacheLayerMixin):\n    pass\n",
        "validate/c.py": "from oscar.stats.artifact import save_artifact\n",
        "validate/d.py": "from oscar.stats import artifact\ndef f(a):\n    artifact.save_artifact(a, 'x')\n",
        "validate/ablation/e.py": "from safetensors.torch import save_file\n",
        "validate/ok.py": "from oscar.kernels.backends import make_cache\nfrom oscar.stats.artifact import load_artifact\n",
        "kernels/cache.py": "from transformers.cache_utils import Cache\nclass OscarCache(Cache):\n    pass\n",
    })
    assert validate_roles(root) == [
        "validate/a.py:2 class L", "validate/a.py:4 class M", "validate/a.py:6 class C", "validate/b.py:2 class X",
        "validate/c.py:1 writes (imports save_artifact)", "validate/d.py:3 writes (artifact.save_artifact)",
        "validate/ablation/e.py:1 writes (imports save_file)"], validate_roles(root)
# ----------------------------------------------------------------------------- late imports say why

# Imports sit at the top of their module (docs/decisions/0089-imports-at-the-top-late-only-with-a-reason.md). An
# import inside a function, of one of our modules or a third-party one, needs a reason on its own line just above it
# or at the end of the statement: a comment starting `# late:` that says what it costs or which optional dependency
# it waits for. Standard-library imports are not checked.
LATE_REASON = "# late:"

def _reason(lines: list[str], line: int, end: int) -> str:
    """The `# late:` text on the line above the statement at lines [line, end], or in it ("" if none; end < line:
    the line above only)."""
    above = lines[line - 2].strip() if line >= 2 else ""
    own = " ".join(lines[line - 1:end])
    said = above if above.startswith(LATE_REASON) else own[own.find(LATE_REASON):] if LATE_REASON in own else ""
    return said[len(LATE_REASON):].strip()


def unexplained_late_imports(root: Path) -> dict[str, list[str]]:
    """{module file: ["file:line imports X", ...]}: late imports of ours or third-party modules without a reason.
    A reason above a run of import statements (one right after the other) covers the run."""
    known = set(modules(root))
    out: dict[str, list[str]] = {}
    for name, path in modules(root).items():
        rel = os.path.relpath(path, root)
        lines = path.read_text().splitlines()
        late = sorted({(i.line, i.end): i for i in imports(name, path, known) if i.kind == "late"}.values(),
                      key=lambda i: i.line)
        said, run, prev_end = {}, "", -1  # run: the reason above the current run of import statements
        for i in late:
            above = _reason(lines, i.line, i.line - 1) if i.line >= 2 else ""
            run = above or (run if i.line == prev_end + 1 else "")
            said[i.line], prev_end = run or _reason(lines, i.line, i.end), i.end
        for imp in imports(name, path, known):
            if imp.kind == "late" and (imp.ours or imp.dst not in sys.stdlib_module_names) and not said[imp.line]:
                out.setdefault(rel, []).append(f"{rel}:{imp.line} imports {imp.dst}")
    return out


def test_late_imports_say_why():
    found = unexplained_late_imports(ROOT)
    bad = [w for f, ws in sorted(found.items()) for w in ws]
    assert not bad, ("import at the top of the module, or say on the line above why it waits (`# late: ...`: an "
                     "optional dependency, or a measured import cost on a path that must stay fast; "
                     "docs/decisions/0089-imports-at-the-top-late-only-with-a-reason.md):\n  " + "\n  ".join(bad))


def test_unexplained_late_imports_are_found(tmp_path):
    root = _tree(tmp_path, {
        "stats/fit.py": ("import numpy\nfrom oscar.stats import clip\n\n\n"
                         "def f():\n    from oscar.stats import reduce\n"          # ours, no reason
                         "    import torch\n"                                       # third party, no reason
                         "    import json\n"                                        # standard library: not checked
                         "    # late: optional dependency (triton)\n"
                         "    import triton\n"                                      # the reason above
                         "    import ray  # late: optional dependency (ray)\n"      # the reason on the line
                         "    from oscar.stats import (  # late: keeps torch out of --help\n"
                         "        split)\n"                                          # a statement over two lines
                         "    # late:\n    import pandas\n"                         # no reason given
                         "    # a plain comment\n    import zarr\n"                 # not a reason
                         "    if TYPE_CHECKING:\n        from oscar.stats import spectrum\n"  # type only
                         "    # late: keeps torch out of --help\n    import torch\n    from oscar.stats import clip\n"  # a run
                         "\n    import safetensors\n"                                   # a blank line ends the run
                         "    import pyarrow  # late: its own reason\n    import scipy\n"),  # ... not the next one's
        "stats/clip.py": "", "stats/reduce.py": "", "stats/split.py": "", "stats/spectrum.py": "",
        "kernels/paged.py": "def g():\n    from oscar.stats import clip\n",
    })
    found = unexplained_late_imports(root)
    assert found == {"stats/fit.py": ["stats/fit.py:6 imports oscar.stats.reduce", "stats/fit.py:7 imports torch",
                                      "stats/fit.py:15 imports pandas", "stats/fit.py:17 imports zarr",
                                      "stats/fit.py:24 imports safetensors", "stats/fit.py:26 imports scipy"],
                     "kernels/paged.py": ["kernels/paged.py:2 imports oscar.stats.clip"]}, found


# ----------------------------------------------------------------------------- bench/ and lab/ stay outside

SCRIPT_DIRS = ("bench", "lab")  # benchmarks and the lab's experiments: they may use the product, never the reverse
_LOADERS = ("spec_from_file_location", "run_path", "import_module", "path.insert", "path.append", "SourceFileLoader")
_SCRIPT_PATH = re.compile(r"""['"](?:[^'"]*/)?(?:bench|lab)(?:/[^'"]*)?['"]""")


def script_refs(path: Path, root: Path) -> list[str]:
    """Where the file at `path` reaches into bench/ or lab/: an import of a module there (by the folder's name, or
    by a script's own name as when the folder is on sys.path), or a path into them handed to a loader (importlib,
    runpy, sys.path)."""
    stems = {p.stem for d in SCRIPT_DIRS if (root / d).is_dir() for p in (root / d).rglob("*.py")}
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else [])
        out += [f"{os.path.relpath(path, root)}:{node.lineno} imports {n}" for n in names
                if n.split(".")[0] in SCRIPT_DIRS or n.split(".")[0] in stems]
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(_LOADERS) and _SCRIPT_PATH.search(
                ast.unparse(node)):
            out.append(f"{os.path.relpath(path, root)}:{node.lineno} loads {ast.unparse(node)[:100]}")
    return out


def product_and_test_files(root: Path) -> tuple[list[Path], list[Path]]:
    """(every module of the installed packages, every .py under tests/)."""
    return list(modules(root).values()), sorted((root / "tests").rglob("*.py")) if (root / "tests").is_dir() else []


def test_no_product_module_or_product_test_reaches_into_bench_or_lab():
    mods, tests = product_and_test_files(ROOT)
    assert len(mods) > 50 and len(tests) > 50
    bad = [r for f in mods + tests for r in script_refs(f, ROOT)]
    assert not bad, ("bench/ and lab/ are outside the product: move shared code into the package (product code) or "
                     "tests/helpers.py (test code):\n  " + "\n  ".join(bad))


def test_script_refs_finds_each_way_in(tmp_path):
    root = _tree(tmp_path, {
        "bench/fit.py": "", "lab/key_bits.py": "",
        "stats/a.py": "from bench.fit import main\n",
        "stats/b.py": "def f():\n    import key_bits\n",
        "tests/test_x.py": ("import importlib.util\nfrom pathlib import Path\n"
                            "s = importlib.util.spec_from_file_location('k', Path(__file__).parents[1] / 'lab' / 'k.py')\n"),
        "tests/test_y.py": "import sys\nsys.path.insert(0, 'bench')\n",
        "tests/test_ok.py": "import numpy\nfrom oscar.stats import fit\nx = 'a lab note'\n",
    })
    mods, tests = product_and_test_files(root)
    refs = {r.split(":")[0] for f in mods + tests for r in script_refs(f, root)}
    assert refs == {"stats/a.py", "stats/b.py", "tests/test_x.py", "tests/test_y.py"}, refs


# ----------------------------------------------------------------------------- tests share code through tests/helpers/

_PATH_LOADERS = ("spec_from_file_location", "SourceFileLoader", "run_path")  # a module loaded by its file's path


def path_loads(path: Path, root: Path) -> list[str]:
    """Where the test file at `path` loads a module by its path (importlib, runpy) or imports another test file
    (a `test_*` module or conftest): what tests share lives in tests/helpers/, imported by plain `import helpers`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else [])
        out += [f"{os.path.relpath(path, root)}:{node.lineno} imports {n}" for n in names
                if any(p.startswith("test_") or p == "conftest" for p in n.split("."))]
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(_PATH_LOADERS):
            out.append(f"{os.path.relpath(path, root)}:{node.lineno} loads {ast.unparse(node)[:100]}")
    return out


def test_tests_share_code_through_the_helpers_package_only():
    _, tests = product_and_test_files(ROOT)
    assert (ROOT / "tests" / "helpers" / "__init__.py").is_file()
    bad = [r for f in tests for r in path_loads(f, ROOT)]
    assert not bad, ("tests load no module by path and import no other test file: move what they share into "
                     "tests/helpers/ and import it (`from helpers import ...`):\n  " + "\n  ".join(bad))


def test_path_loads_finds_each_way_in(tmp_path):
    root = _tree(tmp_path, {
        "tests/test_a.py": ("import importlib.util\nfrom pathlib import Path\n"
                            "s = importlib.util.spec_from_file_location('x', Path(__file__).with_name('test_b.py'))\n"),
        "tests/test_b.py": "def f():\n    import test_cache\n",
        "tests/test_c.py": "import runpy\nrunpy.run_path('tests/helpers/cluster.py')\n",
        "tests/test_d.py": "from importlib.machinery import SourceFileLoader\nm = SourceFileLoader('m', 'm.py').load_module()\n",
        "tests/test_ok.py": ("from helpers import cluster\nfrom helpers.artifacts import rotated_artifact\n"
                             "import importlib\nx = 'spec_from_file_location'\n"),
    })
    _, tests = product_and_test_files(root)
    refs = {r.split(":")[0] for f in tests for r in path_loads(f, root)}
    assert refs == {"tests/test_a.py", "tests/test_b.py", "tests/test_c.py", "tests/test_d.py"}, refs


# ----------------------------------------------------------------------------- the project


def test_every_module_is_seen():
    mods = modules(ROOT)
    for m in ("oscar.common", "oscar.run", "oscar.pipeline.store", "oscar.stats.artifact", "oscar.kernels.paged",
              "oscar.validate.methods", "oscar.validate.ablation.schemes", "oscar.cluster.pipeline",
              "oscar.reports.calibration", "oscar.scoring.engine", "oscar.recipe.widths", "oscar.kernels.backends",
              "oscar.validate.evidence"):
        assert m in mods, m
    assert mods["oscar.kernels.paged"] == ROOT / "kernels" / "paged.py"


def test_dependency_rules():
    found = violations(ROOT)
    new = {v: w for v, w in found.items() if v not in KNOWN}
    gone = sorted(v for v in KNOWN if v not in found)
    assert not new, "import against the dependency rules (README 'Layout', docs/decisions/0054-structure-follows-the-data-flow-dependency-rules.md):\n" + "\n".join(
        f"  {v}   at {w}" for v, w in sorted(new.items()))
    assert not gone, "no longer occurs; remove it from KNOWN in tests/test_import_graph.py:\n  " + "\n  ".join(gone)


# ----------------------------------------------------------------------------- the checker itself


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["oscar", "oscar.scoring", "oscar.recipe", "oscar.pipeline", "oscar.stats", "oscar.kernels", "oscar.cluster", '
        '"oscar.reports", "oscar.validate", "oscar.validate.ablation"]\n'
        '[tool.setuptools.package-dir]\n"oscar" = "oscar"\n"oscar.pipeline" = "pipeline"\n"oscar.stats" = "stats"\n'
        '"oscar.kernels" = "kernels"\n"oscar.cluster" = "cluster"\n"oscar.reports" = "reports"\n'
        '"oscar.validate" = "validate"\n')
    for d in ("oscar", "oscar/scoring", "oscar/recipe", "pipeline", "stats", "kernels", "cluster", "reports", "validate",
              "validate/ablation"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        (tmp_path / d / "__init__.py").write_text("")
    for rel, src in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    return tmp_path


def test_clean_tree_has_no_violation(tmp_path):
    root = _tree(tmp_path, {
        "oscar/common.py": "import numpy\n",
        "pipeline/store.py": "from oscar.common import x\n",
        "stats/artifact.py": "from oscar.pipeline.store import CalibStore\nfrom . import fit\n",
        "stats/fit.py": "def f():\n    from oscar.pipeline import store\n",
        "kernels/paged.py": "from oscar.stats.artifact import Artifact\nfrom .dispatch import q\n",
        "kernels/dispatch.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from oscar.kernels.paged import P\n",
        "validate/methods.py": "from oscar.kernels import paged\nfrom oscar.validate.ablation.schemes import S\n",
        "validate/ablation/schemes.py": "from oscar.kernels.paged import P\n",
        "cluster/actors.py": "import ray\nfrom oscar.pipeline import store\n",
        "oscar/artifact_header.py": "from oscar.common import OscarError\n",
        "reports/calibration.py": "from oscar.artifact_header import read_metadata\n",
        "oscar/run.py": "import ray\nfrom oscar.reports import calibration\nfrom oscar.cluster import actors\n",
        # the floors above kernels: scoring, the recipe, validate's result schemas, reports reading them
        "oscar/scoring/engine.py": "from oscar.kernels.backends import make_cache\nfrom oscar.pipeline import store\n",
        "kernels/backends.py": "from oscar.kernels.cache import OscarCache\nfrom oscar.kernels.simulate import S\n",
        "kernels/cache.py": "from oscar.kernels.paged import P\n", "kernels/simulate.py": "",
        "oscar/recipe/tune.py": "from oscar.scoring import engine\nfrom oscar.stats.artifact import save_artifact\n",
        "validate/niah.py": "from oscar.recipe.tune import t\nfrom oscar.validate.evidence import e\n",
        "validate/evidence.py": "from oscar.validate.intervals import wilson\n", "validate/intervals.py": "",
        "reports/build.py": "from oscar.validate.evidence import niah_stats\n",
        "cluster/scoring.py": "from oscar.scoring.engine import served\nfrom oscar.recipe import tune\n",
        "cluster/cli.py": "from oscar.validate.niah import run_niah\nfrom oscar.cluster import scoring\n",
    })
    assert violations(root) == {}
    assert modules(root)["oscar.validate.ablation.schemes"] == root / "validate" / "ablation" / "schemes.py"


def test_each_rule_fails(tmp_path):
    root = _tree(tmp_path, {
        "pipeline/cli.py": "def inspect():\n    from oscar.stats.artifact import describe\n",   # late, against the flow
        "stats/artifact.py": "from oscar.kernels.quant import QuantSpec\n",                       # stats -> kernels
        "stats/reduce.py": "from oscar.pipeline.models import load\n",                            # not the store
        "kernels/quant.py": "from ..stats import artifact\n",                                     # relative; cycle
        "kernels/memory.py": "try:\n    import ray\nexcept ImportError:\n    ray = None\n",      # ray outside cluster
        "validate/run.py": "from oscar.cluster.pipeline import calibrate_on_ray\n",               # validate -> cluster
        "validate/ablation/ablate.py": "from oscar.validate.methods import M\n",                  # ablation -> model-level
        "reports/build.py": "import oscar.validate.niah\n",                                       # reports -> a stage
        "reports/calibration.py": "from oscar.stats.artifact import read_metadata\n",            # reports -> a stage
        "oscar/newleaf.py": "x = 1\n",                                                            # undeclared oscar module
        "oscar/common.py": "from oscar.newleaf import x\n",
        "validate/sub/__init__.py": "",                                                           # not in pyproject
        "pipeline/models.py": "", "cluster/pipeline.py": "", "validate/methods.py": "", "validate/niah.py": "",
    })
    found = violations(root)
    assert set(found) == {
        "layer: oscar.pipeline.cli -> oscar.stats.artifact",
        "layer: oscar.stats.artifact -> oscar.kernels.quant",
        "layer: oscar.stats.reduce -> oscar.pipeline.models",
        "ray: oscar.kernels.memory",
        "layer: oscar.validate.run -> oscar.cluster.pipeline",
        "layer: oscar.validate.ablation.ablate -> oscar.validate.methods",
        "layer: oscar.reports.build -> oscar.validate.niah",
        "layer: oscar.reports.calibration -> oscar.stats.artifact",
        "layer: oscar.common -> oscar.newleaf",
        "cycle: oscar.kernels.quant <-> oscar.stats.artifact",
        "unlisted package: validate/sub",
    }, found
    assert found["layer: oscar.pipeline.cli -> oscar.stats.artifact"] == "pipeline/cli.py:2 (late)"


def test_each_floor_rule_fails(tmp_path):
    """The floors pipeline -> stats -> kernels -> scoring -> recipe -> validate -> reports, cluster beside the recipe:
    each rule fails on a synthetic violation of it."""
    root = _tree(tmp_path, {
        "oscar/recipe/tune.py": "from oscar.validate.ppl import window_nll\n",                 # the recipe -> validate
        "oscar/recipe/widths.py": "def f():\n    from oscar.validate import methods\n",        # ... late, too
        "oscar/scoring/engine.py": "from oscar.validate.codebooks import layer_codecs\n",     # scoring -> validate
        "oscar/scoring/nll.py": "from oscar.recipe.tune import t\n",                           # scoring -> the recipe
        "oscar/recipe/driver.py": "from oscar.cluster.scoring import StagedScorer\n",          # the recipe -> cluster
        "cluster/scoring.py": "from oscar.validate.niah import PrefillPool\n",                 # cluster -> validate
        "cluster/cli.py": "from oscar.validate.niah import run_niah\n",                        # its CLI glue may
        "kernels/cache.py": "from oscar.kernels.paged import P\n",                             # the serving cache ->
        "kernels/paged.py": "def f():\n    from oscar.kernels import simulate\n",              # ... a simulator, through
        "kernels/memory.py": "from oscar.kernels.rowbatch import RowBatchCache\n",             # another module (not:
        "kernels/backends.py": "from oscar.kernels.cache import OscarCache\nfrom oscar.kernels import simulate\n",
        "kernels/simulate.py": "", "kernels/rowbatch.py": "",                                     # the factory may)
        "validate/evidence.py": "from oscar.validate.niah import x\n",                         # a result schema -> the stage
        "reports/build.py": "from oscar.validate.evidence import e\nfrom oscar.scoring.engine import s\n",  # reports -> scoring
        "validate/ppl.py": "", "validate/methods.py": "", "validate/codebooks.py": "", "validate/niah.py": "",
        "cluster/cli_b.py": "", "oscar/scoring/__init__.py": "",
    })
    found = violations(root)
    assert set(found) == {
        "layer: oscar.recipe.tune -> oscar.validate.ppl",
        "layer: oscar.recipe.widths -> oscar.validate.methods",
        "layer: oscar.scoring.engine -> oscar.validate.codebooks",
        "layer: oscar.scoring.nll -> oscar.recipe.tune",
        "layer: oscar.recipe.driver -> oscar.cluster.scoring",
        "layer: oscar.cluster.scoring -> oscar.validate.niah",
        "layer: oscar.validate.evidence -> oscar.validate.niah",
        "layer: oscar.reports.build -> oscar.scoring.engine",
        "serving cache: oscar.kernels.cache -> oscar.kernels.simulate",
    }, found
    # the serving cache importing a simulator itself, and through a module it imports
    (root / "kernels/paged.py").write_text("")
    (root / "kernels/cache.py").write_text("from oscar.kernels.memory import cache_bytes\n")
    assert "serving cache: oscar.kernels.cache -> oscar.kernels.rowbatch" in violations(root)


def test_type_only_cycle_is_not_a_cycle_but_still_a_layer_rule(tmp_path):
    root = _tree(tmp_path, {
        "kernels/paged.py": "from oscar.kernels.dispatch import q\n",
        "kernels/dispatch.py": "import typing\nif typing.TYPE_CHECKING:\n    from oscar.kernels.paged import P\n"
                               "    from oscar.validate.methods import M\n",
        "validate/methods.py": "",
    })
    assert violations(root) == {"layer: oscar.kernels.dispatch -> oscar.validate.methods": "kernels/dispatch.py:4 (type)"}
    (root / "kernels/dispatch.py").write_text("def late():\n    from oscar.kernels.paged import P\n")
    assert violations(root) == {"cycle: oscar.kernels.dispatch <-> oscar.kernels.paged":
                                "modules importing each other (late imports included)"}
