"""A CLI that explains itself: every option of every (nested) subcommand has help stating its meaning and
default; aliases keep the older spellings working; `--version`; `--no-progress` silences every bar."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from helpers.cli import walk
from oscar.__main__ import build_parser, main

FLAGS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction, argparse._CountAction,
         argparse._AppendConstAction)


def problems(parser: argparse.ArgumentParser) -> list[str]:
    out = []
    for path, p in walk(parser):
        where = " ".join(path)
        if len(path) > 1 and not p.description:
            out.append(f"{where}: no description")
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            name = "/".join(a.option_strings) or a.dest
            h = (a.help or "").strip()
            if not h or h == argparse.SUPPRESS:
                out.append(f"{where} {name}: no help")
                continue
            if a.option_strings and not isinstance(a, FLAGS) and not a.required and a.default is None \
                    and not any(w in h.lower() for w in ("default", "required")):
                out.append(f"{where} {name}: default is None but the help does not say what happens without it")
        p.format_help()  # every help string formats (a stray % would raise here)
    return out


def test_every_option_of_every_subcommand_has_help():
    bad = problems(build_parser())
    assert not bad, "options without help (meaning and default):\n  " + "\n  ".join(bad)


def test_walk_reaches_nested_subcommands():
    paths = {p for p, _ in walk(build_parser())}
    for want in [("oscar", "validate", "niah"), ("oscar", "validate", "attention"), ("oscar", "bench", "memory"),
                 ("oscar", "fit"), ("oscar", "run"), ("oscar", "variants"), ("oscar", "submit")]:
        assert want in paths, want


def test_the_check_fails_on_an_option_without_help():
    p = argparse.ArgumentParser(prog="x")
    sub = p.add_subparsers().add_parser("y", description="d").add_subparsers().add_parser("z", description="d")
    sub.add_argument("--bare")
    sub.add_argument("--quiet-default", default=None, help="something")
    bad = problems(p)
    assert any(b.endswith("y z --bare: no help") for b in bad) and any("--quiet-default: default is None" in b for b in bad)


def test_defaults_are_printed():
    p = build_parser()
    sub = dict(walk(p))
    h = " ".join(sub[("oscar", "validate", "niah")].format_help().split())  # unwrapped
    assert "(default: 1k,2k,4k)" in h and "(default: 20)" in h and "(default: bf16," in h
    assert "seed of the haystacks, needles and questions (default: 0)" in h
    h = " ".join(sub[("oscar", "fit")].format_help().split())
    assert "(default: 256)" in h and "(default: minmax)" in h and "(default: None)" not in h


def test_version(capsys):
    from oscar import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"oscar-kv {__version__}"


@pytest.mark.parametrize("argv,dest,value", [
    (["fit", "s.zarr", "--out", "a"], "store_pos", "s.zarr"),
    (["fit", "--store", "s.zarr", "--out", "a"], "store", "s.zarr"),
    (["fit", "--store", "s", "--out", "a", "--quiet"], "no_progress", True),
    (["fit", "--store", "s", "--out", "a", "--no-progress"], "no_progress", True),
    (["status", "--store", "s"], "store", "s"),
    (["status", "s"], "store_pos", "s"),
    (["validate", "ppl", "--out", "o", "--contexts", "1k"], "contexts", "1k"),
    (["validate", "ppl", "--out", "o", "--lengths", "2k"], "contexts", "2k"),
    (["validate", "ppl", "--out", "o", "--protocol", "strict"], "protocols", "strict"),
    (["validate", "ppl", "--out", "o", "--protocols", "serving"], "protocols", "serving"),
    (["validate", "niah", "--out", "o", "--contexts", "1k"], "lengths", "1k"),
    (["plan", "--model", "m", "--stages", "1", "--batch-size", "2"], "micro_batch", 2),
    (["plan", "--model", "m", "--stages", "1", "--micro-batch", "3"], "micro_batch", 3),
    (["calibrate", "--micro-batch", "2"], "batch_size", 2),
    (["export", "a.safetensors", "--format", "gguf-rot", "--out", "o"], "artifact_pos", "a.safetensors"),
    (["export", "--artifact", "a.safetensors", "--format", "gguf-rot", "--out", "o"], "artifact", "a.safetensors"),
])
def test_aliases_parse(argv, dest, value):
    assert getattr(build_parser().parse_args(argv), dest) == value


def test_dtype_defaults_agree():
    sub = dict(walk(build_parser()))
    for path in [("oscar", "run"), ("oscar", "validate", "niah"), ("oscar", "validate", "ppl")]:
        assert sub[path].get_default("dtype") == "auto", path  # the host's: oscar/host.py


def test_store_given_twice_or_never_is_a_clear_error(tmp_path, capsys):
    assert main(["fit", "a.zarr", "--store", "b.zarr", "--out", str(tmp_path / "x")]) == 2
    assert "--store given twice" in capsys.readouterr().err
    assert main(["fit", "--out", str(tmp_path / "x")]) == 2
    assert "--store is required" in capsys.readouterr().err
    assert main(["status"]) == 2
    assert "--store is required" in capsys.readouterr().err


@pytest.mark.slow
def test_no_progress_silences_transformers_bars(tmp_path):
    """The same tiny-model command with and without --no-progress: the bars (ours and transformers' weight-loading
    bar) are on stderr only without it."""
    from oscar.pipeline.models import resolve_model

    resolve_model("tiny-llama")  # materialise the preset once, outside the timed commands
    base = [sys.executable, "-m", "oscar", "validate", "ppl", "--model", "tiny-llama", "--methods", "bf16",
            "--lengths", "64", "--tokens", "128", "--dtype", "float32"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TQDM_DISABLE", None)
    loud = subprocess.run(base + ["--out", str(tmp_path / "a")], capture_output=True, text=True, env=env)
    quiet = subprocess.run(base + ["--out", str(tmp_path / "b"), "--no-progress"], capture_output=True, text=True, env=env)
    assert loud.returncode == 0 and quiet.returncode == 0, (loud.stderr[-2000:], quiet.stderr[-2000:])
    assert "ppl:" in loud.stderr or "%|" in loud.stderr, loud.stderr[-2000:]  # there is a bar to silence
    assert "%|" not in quiet.stderr and "it/s" not in quiet.stderr and "tok/s" not in quiet.stderr, quiet.stderr[-2000:]


def test_no_help_prints_a_format_placeholder(capsys):
    """`oscar X --help` for every command and nested subcommand, run as the user runs it: no literal `%(default)s`
    (a `%%` in a help string that already states its default) and no `%%` reaches the screen."""
    paths = [path[1:] for path, _ in walk(build_parser())]
    assert ("calibrate",) in paths and ("validate", "niah") in paths and ("models", "list") in paths
    bad = {}
    for path in paths:
        with pytest.raises(SystemExit) as e:
            main([*path, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and "usage: oscar" in out, path
        if "%(" in out or "%%" in out:
            bad[" ".join(path)] = [ln for ln in out.splitlines() if "%(" in ln or "%%" in ln]
    assert not bad, bad


def test_calibrate_help_states_the_model_default(capsys):
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "HF directory or .gguf file (default: smollm2-135m)" in out


def test_no_help_or_doc_string_points_to_a_missing_design_document():
    """Help and doc strings point to documents the repository has (docs/*.md), not to the design brief."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    for path, p in walk(build_parser()):
        assert "DESIGN" not in p.format_help(), path
    from oscar.stats.rotations import VARIANTS

    assert not [v.name for v in VARIANTS.values() if "DESIGN" in v.doc]
    sources = [f for d in ("oscar", "pipeline", "stats", "kernels", "validate", "cluster", "reports", "bench")
               for f in (root / d).rglob("*.py")]
    assert not [str(f) for f in sources if "DESIGN" in f.read_text()]
    for f in sources + list((root / "docs").rglob("*.md")):  # every docs/X.md (docs/decisions/N.md) named exists
        for ref in set(re.findall(r"docs/([\w.-]+(?:/[\w.-]+)*\.md)", f.read_text())):
            assert (root / "docs" / ref).is_file(), (str(f), ref)


def test_variants_points_to_real_docs(capsys):
    assert main(["variants"]) == 0
    out = capsys.readouterr().out
    assert "DESIGN" not in out and "docs/reference-recipe.md" in out


def test_help_loads_no_heavy_package():
    """Building every command's parser (what `oscar --help` and `oscar X --help` do) imports no torch, transformers,
    ray or the other packages a handler loads when it runs (docs/decisions/0089-imports-at-the-top-late-only-with-a-reason.md)."""
    heavy = ("torch", "transformers", "ray", "triton", "accelerate", "pandas", "matplotlib", "scipy", "zarr")
    code = ("import sys; import oscar.__main__ as m; m.build_parser(); "
            f"print(' '.join(p for p in {heavy!r} if p in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"`oscar --help` imports {out}: import it in the handler, with a `# late:` line"
