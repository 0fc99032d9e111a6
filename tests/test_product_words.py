"""The product speaks of the product alone: no work-process names (issue numbers, hypothesis labels, session
words) in the package's source, in the `--help` of any oscar command, in the reports built from the committed
examples, or in file names under the package folders, bench/, lab/ and tests/. (README and docs have their own
check.)"""

from __future__ import annotations

import os
import re

import pytest

from helpers.cli import walk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = ("oscar", "pipeline", "stats", "kernels", "validate", "cluster", "reports")
NAMED = PACKAGE + ("bench", "lab", "tests")
TEXT = (".py", ".c", ".yaml", ".yml", ".json", ".md", ".html", ".txt", ".toml", ".cfg", ".sh")
SKIP_DIRS = {"__pycache__", ".pytest_cache", "build", "dist"}

# the names a piece of work gives itself, not what the thing it made is
WORK_NAMES = re.compile(
    r"(?<![a-z0-9])issue[\s_#-]*\d+"    # issue 16, issue-16, issue #16, issue16, test_issue16_ab
    r"|(?<![a-z0-9])hypothes[ie]s"     # hypothesis 4, hypotheses 2 and 4
    r"|\bH[1-9]\b"                     # H1..H9 labels
    r"|\bthis session\b|\bsession\s+\d+\b|\bthe session (?:ran|that|'s)",
    re.IGNORECASE)
DATA_URI = re.compile(r"data:[\w/+.-]+;base64,[A-Za-z0-9+/=]+")
H_LABEL = re.compile(r"\bH[1-9]\b")  # case-sensitive: h1 / h2 are ordinary names (heads, hidden sizes)


def work_names(text: str) -> list[str]:
    """The work-process names in `text` (empty: none); inline data (base64 images) is not text."""
    out = []
    for m in WORK_NAMES.finditer(DATA_URI.sub("", text)):
        s = m.group(0)
        if re.fullmatch(r"h[1-9]", s, re.IGNORECASE) and not H_LABEL.fullmatch(s):
            continue
        out.append(s)
    return out


def _files(top: str):
    for d, dirs, files in os.walk(os.path.join(ROOT, top)):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith(".")]
        for f in files:
            if not f.endswith((".pyc", ".so")):
                yield os.path.join(d, f)


def test_the_pattern_catches_planted_names_and_spares_product_words():
    for planted in ("see issue 16", "Issue 16's goal", "issue-16 formats", "issue #44", "bench/issue16_goal.py",
                    "test_issue16_ab.py", "hypothesis 4", "hypotheses 2 and 4", "H3 lost", "in this session",
                    "session 12 measured", "the session ran it"):
        assert work_names(planted), planted
    for fine in ("a Ray session", "its own session id", "H = heads", "h2 = hidden", "the issue is the clip",
                 "per-layer key widths (copy-probe gradient)", "start_new_session", "session_pids(pgid)"):
        assert not work_names(fine), fine


def test_package_sources_name_no_work():
    bad = []
    for top in PACKAGE:
        for p in _files(top):
            rel = os.path.relpath(p, ROOT)
            if rel.startswith(os.path.join("reports", "examples")) and not p.endswith((".md", ".html")):
                continue  # example data (samples, tables); their report texts are read below
            if not p.endswith(TEXT):
                continue
            with open(p, encoding="utf-8", errors="replace") as f:
                for i, line in enumerate(f, 1):
                    if work_names(line):
                        bad.append(f"{rel}:{i}: {line.strip()[:120]}")
    assert not bad, "work-process names in the package:\n" + "\n".join(bad)


def test_cli_help_names_no_work():
    from oscar.__main__ import build_parser

    bad, n = [], 0
    for path, p in walk(build_parser()):
        n += 1
        found = work_names(p.format_help())
        if found:
            bad.append(f"{' '.join(path)} --help: {found}")
    assert n > 10, n  # the walk reached the subcommands
    assert not bad, "\n".join(bad)


def test_report_texts_name_no_work():
    """The committed example reports (their builder's strings are package source, read above)."""
    ex = os.path.join(ROOT, "reports", "examples")
    texts = [os.path.join(ex, e, n) for e in sorted(os.listdir(ex)) for n in ("report.md", "report.html")
             if os.path.exists(os.path.join(ex, e, n))]
    assert texts
    bad = []
    for p in texts:
        with open(p, encoding="utf-8") as f:
            found = work_names(f.read())
        if found:
            bad.append(f"{os.path.relpath(p, ROOT)}: {found}")
    assert not bad, "\n".join(bad)


def test_file_names_name_no_work():
    bad = [os.path.relpath(os.path.join(d, x), ROOT)
           for top in NAMED if os.path.isdir(os.path.join(ROOT, top))
           for d, dirs, files in os.walk(os.path.join(ROOT, top))
           if not any(part in SKIP_DIRS or part.startswith(".") for part in os.path.relpath(d, ROOT).split(os.sep))
           for x in dirs + files if work_names(x)]
    assert not bad, "work-process names in file names:\n" + "\n".join(bad)
