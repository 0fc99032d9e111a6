"""Packaging invariants: stage folders import as oscar.<stage>, never top-level."""

import importlib
import importlib.util
import subprocess
import sys

import pytest

STAGES = ["pipeline", "stats", "kernels", "validate", "cluster", "reports"]


@pytest.mark.parametrize("stage", STAGES)
def test_stage_imports_under_oscar(stage):
    m = importlib.import_module(f"oscar.{stage}")
    assert m.__doc__ and m.__doc__.startswith(f"oscar.{stage}")


@pytest.mark.parametrize("name", ["kernels", "stats"])
def test_stage_not_top_level(name, tmp_path):
    # Run from a neutral cwd: a fresh interpreter must not find our folders as
    # top-level packages (transformers probes for the PyPI package `kernels`).
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is not None)"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path)
    assert r.returncode == 0, f"top-level `{name}` is importable"


def test_cli_help_lists_commands():
    r = subprocess.run([sys.executable, "-m", "oscar", "--help"], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr
    assert "usage: oscar" in r.stdout
