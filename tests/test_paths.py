"""No pointer to a file that does not exist: every repo path a module or a document names (`cluster/scoring.py`,
`docs/decisions/0101-...md`) is a file of the checkout.

Scanned: the .py and .md files git tracks. Left out: tests/ (its synthetic trees name files on purpose), the
results and generated reports (bench/results/, reports/examples/: the paths of the run that wrote them), and, in
the decision records and their index, every path but a record's own (a record describes the tree of its day;
the records it cites must exist). Paths are those of sources and documents (.py, .md, .sh): a data file a script
writes (bench/results/x.json) need not be committed.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PATH = re.compile(r"(?<![\w/.$~-])((?:pipeline|stats|kernels|validate|cluster|reports|oscar|tests|bench|lab|docs|scripts)"
                  r"/[\w./-]*\w\.(?:py|md|sh))(?![\w/])")
SKIP = ("tests/", "bench/results/", "reports/examples/")
HISTORY = re.compile(r"docs/decisions/(?:\d{4}-.*|README)\.md$")
RECORD = "docs/decisions/"
# Paths of other projects named where the product follows them: {path: whose}.
EXTERNAL = {"scripts/eval/evaluate.py": "RULER's evaluation script (NVIDIA/RULER)"}


def stale_paths(root: Path, files: list[str]) -> list[str]:
    """'file:line: path' for every path named in `files` (relative to root) that is not a file under root."""
    out = []
    for f in files:
        if f.startswith(SKIP) or not f.endswith((".py", ".md")):
            continue
        history = bool(HISTORY.search(f))
        for i, line in enumerate((root / f).read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                p = m.group(1)
                if (history and not p.startswith(RECORD)) or p in EXTERNAL:
                    continue
                if not (root / p).is_file():
                    out.append(f"{f}:{i}: {p}")
    return out


def tracked(root: Path) -> list[str]:
    return subprocess.run(["git", "ls-files", "*.py", "*.md"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.split()


def test_every_path_named_exists():
    files = tracked(ROOT)
    assert len(files) > 200
    bad = stale_paths(ROOT, files)
    assert not bad, "a module or document names a file that does not exist (moved? name the new place):\n  " + \
        "\n  ".join(bad)


def test_stale_paths_are_found(tmp_path):
    files = {
        "oscar/scoring/rows.py": '"""The stages\' runner (cluster/needles.py); the cache: kernels/rowbatch.py."""\n',
        "kernels/rowbatch.py": "",
        "docs/validation.md": "See docs/decisions/0042-gone.md and docs/decisions/0001-kept.md, `validate/engine.py`.\n",
        "docs/decisions/0001-kept.md": "Moved validate/engine.py to oscar/scoring/engine.py; see docs/decisions/0002-x.md.\n",
        "bench/fit.py": '"""Writes bench/results/fit.json (an output); RULER\'s scripts/eval/evaluate.py."""\n',
        "tests/test_x.py": "root = {'validate/a.py': ''}\n",
        "README.md": "[a](docs/validation.md), oscar/scoring/rows.py, `python lab/<script>.py`\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert stale_paths(tmp_path, list(files)) == [
        "oscar/scoring/rows.py:1: cluster/needles.py",
        "docs/validation.md:1: docs/decisions/0042-gone.md",
        "docs/validation.md:1: validate/engine.py",
        "docs/decisions/0001-kept.md:1: docs/decisions/0002-x.md",
    ]
