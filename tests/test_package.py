"""Packaging invariants: stage folders import as oscar.<stage>, never top-level."""

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

STAGES = ["pipeline", "stats", "kernels", "validate", "cluster", "reports"]
assert tuple(STAGES) == importlib.import_module("oscar").STAGES


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("stage", STAGES)
def test_stage_imports_under_oscar(stage):
    m = importlib.import_module(f"oscar.{stage}")
    # A namespace package (no __init__.py: it can shadow nothing) whose one folder is the stage's.
    assert getattr(m, "__file__", None) is None
    assert [Path(p).resolve() for p in m.__path__] == [ROOT / stage]


@pytest.mark.parametrize("stage", STAGES)
def test_stage_folder_has_no_init(stage):
    assert not (ROOT / stage / "__init__.py").exists(), f"{stage}/__init__.py would shadow an installed `{stage}`"


def _fake_site(tmp_path: Path) -> Path:
    """A site directory with a regular package of every stage's name, as PyPI's `kernels`, `pipeline`, ... are."""
    site = tmp_path / "site"
    for name in STAGES:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"INSTALLED = {name!r}\n")
    return site


@pytest.mark.parametrize("how", ["-c", "-m"])
def test_installed_package_wins_from_repo_root(tmp_path, how):
    """From the repo root (sys.path[0] = the checkout, as for `python -m pytest`, a Ray worker or `python -c`),
    an installed package named like a stage folder is the one imported, and oscar.<stage> is still ours."""
    site = _fake_site(tmp_path)
    code = ("import importlib, sys\n"
            f"stages = {STAGES!r}\n"
            "for s in stages:\n"
            "    m = importlib.import_module(s)\n"
            "    assert getattr(m, 'INSTALLED', None) == s, (s, getattr(m, '__path__', m))\n"
            "    ours = importlib.import_module('oscar.' + s)\n"
            f"    assert list(ours.__path__) == [{str(ROOT)!r} + '/' + s], ours.__path__\n"
            "import oscar.kernels.reference, oscar.validate.ablation\n"
            "print('ok')\n")
    if how == "-m":  # `python -m module` puts the working directory first on sys.path, like `python -m pytest`
        (tmp_path / "probe_mod.py").write_text(code)
        cmd, env_path = [sys.executable, "-m", "probe_mod"], f"{site}:{tmp_path}"
    else:
        cmd, env_path = [sys.executable, "-c", code], str(site)
    env = dict(os.environ, PYTHONPATH=env_path)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_transformers_sees_no_kernels_package_in_our_folder():
    """From the repo root, transformers' probe for Hugging Face's `kernels` finds the installed package when there
    is one, and otherwise treats our folder (a namespace portion) as absent, as it does any PEP 420 shadow."""
    code = ("import importlib.metadata, importlib.util\n"
            "from transformers.utils import import_utils as iu\n"
            "try:\n"
            "    dist = importlib.metadata.distribution('kernels')\n"
            "except importlib.metadata.PackageNotFoundError:\n"
            "    dist = None\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "if dist is None:\n"
            "    assert spec is None or spec.origin is None, spec\n"
            "    assert not iu._is_package_available('kernels', return_version=True)[0]\n"
            "else:\n"
            "    import kernels\n"
            "    assert kernels.__file__ and str(dist.locate_file('kernels')) in kernels.__file__, kernels.__file__\n"
            "    from transformers.integrations import hub_kernels  # imports from `kernels` when it is usable\n"
            "import transformers\n"
            "from transformers import LlamaForCausalLM\n"
            "print('ok', dist.version if dist else None)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr


def test_wheel_layout_imports_without_checkout(tmp_path):
    """The built wheel puts each stage under oscar/ (no top-level stage folder) and imports from a neutral
    directory with the checkout nowhere on sys.path."""
    import zipfile

    import shutil

    src = tmp_path / "src"  # setuptools writes build/ into the source tree: build a copy, not the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "runs", "*.zarr", "*.egg-info", "bench",
                                                              "tests", "docs", "examples", "__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "whl"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = (tmp_path / "whl").glob("oscar_kv-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert not [n for n in names if n.split("/")[0] in STAGES]
    for s in STAGES:
        assert any(n.startswith(f"oscar/{s}/") and n.endswith(".py") for n in names), s
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    code = ("import oscar, oscar.kernels.reference, oscar.cluster.plan, sys\n"
            f"assert oscar.__file__.startswith({str(site)!r}), oscar.__file__\n"
            f"assert list(oscar.kernels.__path__) == [{str(site / 'oscar' / 'kernels')!r}], oscar.kernels.__path__\n"
            "from oscar import _StageFinder\n"
            "assert not any(isinstance(f, _StageFinder) for f in sys.meta_path)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(site)),
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize("name", STAGES)
def test_stage_not_top_level(name, tmp_path):
    # Run from a neutral cwd: a fresh interpreter must not find our folders as top-level packages (transformers
    # probes for Hugging Face's `kernels`, which may well be installed: then it is the one found).
    code = (f"import importlib.util, sys; s = importlib.util.find_spec({name!r}); "
            f"sys.exit(s is not None and any(p.startswith({str(ROOT / name)!r}) for p in [s.origin or '', "
            f"*(s.submodule_search_locations or [])]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path)
    assert r.returncode == 0, f"top-level `{name}` is importable from the checkout"


def test_cli_help_lists_commands():
    r = subprocess.run([sys.executable, "-m", "oscar", "--help"], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr
    assert "usage: oscar" in r.stdout
