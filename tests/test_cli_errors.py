"""Every subcommand, given bad arguments or bad files, fails with a one-line `oscar X: error:` message.

Runs `oscar.__main__.main` in this process: any exception that escapes it (a traceback for the
user) fails the test; argparse's usage errors (SystemExit 2) are messages too. Also: a closed
stdout pipe ends quietly, and output paths are refused before any work.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from oscar.__main__ import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("bad")
    junk = os.urandom(3000)
    (d / "junk.bin").write_bytes(junk)
    (d / "junk.safetensors").write_bytes(junk)
    (d / "junk.gguf").write_bytes(junk)
    (d / "junk.parquet").write_bytes(junk)
    (d / "junk.json").write_text("{not json")
    (d / "junk.yaml").write_text("calibrate: [1, 2\n  : :")
    (d / "junkdir").mkdir()
    (d / "junkdir" / "x.txt").write_text("x")
    (d / "junk.zarr").mkdir()
    (d / "junk.zarr" / "zarr.json").write_text("{not json")
    (d / "other.zarr").mkdir()
    (d / "other.zarr" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {"format": "x"}}')
    return {k: str(d / k) for k in ("junk.bin", "junk.safetensors", "junk.gguf", "junk.parquet", "junk.json",
                                    "junk.yaml", "junkdir", "junk.zarr", "other.zarr")} | {
        "missing": str(d / "missing"), "tmp": str(d), "nodir": str(d / "no_such_dir" / "a.safetensors")}


CASES = [
    ["calibrate", "--model", "{missing}", "--store", "{tmp}/s1.zarr"],
    ["calibrate", "--model", "{junk.gguf}", "--store", "{tmp}/s2.zarr"],
    ["calibrate", "--model", "{junkdir}", "--store", "{tmp}/s3.zarr"],
    ["calibrate", "--model", "tiny-llama", "--corpus", "{junk.parquet}", "--store", "{tmp}/s4.zarr"],
    ["calibrate", "--model", "tiny-llama", "--store", "{junk.bin}"],
    ["calibrate", "--model", "tiny-llama", "--store", "{junkdir}"],
    ["calibrate", "--seq-len", "0"],
    ["inspect", "{missing}"], ["inspect", "{junk.bin}"], ["inspect", "{junk.safetensors}"], ["inspect", "{junk.zarr}"],
    ["inspect", "{junkdir}"], ["inspect", "{other.zarr}"],
    ["verify", "{missing}"], ["verify", "{junk.zarr}"], ["verify", "{junkdir}"], ["verify", "{junk.bin}"],
    ["fit", "{junk.zarr}", "--out", "{tmp}/a.safetensors"], ["fit", "{missing}", "--out", "{tmp}/a.safetensors"],
    ["fit", "{other.zarr}", "--out", "{tmp}/a.safetensors"], ["fit", "{junkdir}", "--out", "{nodir}"],
    ["fit", "{junkdir}", "--out", "{junkdir}"],
    ["export", "{junk.safetensors}", "--format", "sglang-oscar", "--out", "{tmp}/e1"],
    ["export", "{missing}", "--format", "gguf-rot", "--out", "{tmp}/e2"],
    ["import", "{junk.bin}", "--format", "gguf-rot", "--out", "{tmp}/i.safetensors"],
    ["import", "{junkdir}", "--format", "sglang-oscar", "--out", "{tmp}/i.safetensors"],
    ["import", "{missing}", "--format", "sglang-oscar", "--out", "{nodir}"],
    ["bench", "memory", "--model", "{junk.json}"], ["bench", "memory", "--model", "{missing}"],
    ["bench", "memory", "--model", "tiny-llama", "--context", "-5"],
    ["bench", "memory", "--model", "tiny-llama", "--out", "{nodir}"],
    ["validate", "niah", "--model", "{missing}", "--out", "{tmp}/n1"],
    ["validate", "niah", "--model", "tiny-llama", "--artifact", "{junk.safetensors}", "--methods", "oscar-int2",
     "--lengths", "1k", "--samples", "1", "--out", "{tmp}/n2"],
    ["validate", "niah", "--model", "tiny-llama", "--lengths", "zz", "--out", "{tmp}/n3"],
    ["validate", "ppl", "--model", "{junkdir}", "--out", "{tmp}/p1"],
    ["validate", "ppl", "--model", "tiny-llama", "--artifact", "{missing}", "--methods", "oscar-int2", "--out", "{tmp}/p2"],
    ["validate", "tune", "--model", "tiny-llama", "--artifact", "{junk.safetensors}", "--out", "{tmp}/t.safetensors"],
    ["validate", "tune", "--model", "tiny-llama", "--artifact", "{junk.safetensors}", "--out", "{nodir}"],
    ["validate", "attention", "--store", "{junk.zarr}", "--out", "{tmp}/a1"],
    ["validate", "attention", "--store", "{missing}", "--out", "{tmp}/a2"],
    ["run", "--out", "{junk.bin}"], ["run", "--out", "{tmp}/r1", "--no-ray", "--model", "{missing}"],
    ["ablate", "--out", "{junk.bin}", "--smoke"],
    ["ablate", "--out", "{tmp}/ab", "--smoke", "--regimes", "real", "--store", "{junk.zarr}"],
    ["plan", "--model", "{missing}", "--stages", "1"], ["plan", "--model", "{junk.json}", "--stages", "1"],
    ["plan", "--model", "tiny-llama", "--stages", "0"],
    ["submit", "{missing}"], ["submit", "{junk.yaml}"], ["submit", "{junk.bin}"],
    ["status", "{missing}"], ["status", "{junk.zarr}"], ["status", "{other.zarr}"],
    ["report", "{missing}"], ["report", "{junkdir}"], ["report", "{junk.bin}"],
    ["models", "install", "no-such-model"],
    ["models", "install", "qwen2.5-0.5b", "--source", "{missing}", "--cache-dir", "{tmp}/mc1"],
    ["models", "install", "qwen2.5-0.5b", "--source", "{junkdir}", "--cache-dir", "{tmp}/mc2"],
    ["cluster", "render", "--out", "{tmp}/m1"],  # every required parameter unset
    ["cluster", "render", "--out", "{junk.bin}", "--image", "x", "--nodes", "1", "--gpus-per-node", "8",
     "--gpu-mem", "80", "--model", "{missing}", "--store", "/data/s.zarr"],
]


def _fill(a: str, bad: dict) -> str:
    for k, v in bad.items():
        a = a.replace("{" + k + "}", v)
    return a


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse: a usage message, no traceback
        rc = e.code if isinstance(e.code, int) else 2
    return rc, capsys.readouterr().err


def test_every_subcommand_has_a_bad_input_case():
    sub = build_parser()._subparsers._group_actions[0].choices
    covered = {c[0] for c in CASES}
    assert set(sub) - covered <= {"variants"}, set(sub) - covered  # variants takes no input


@pytest.mark.parametrize("case", CASES, ids=[" ".join(c[:2]) + f"#{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_a_message(case, bad, capsys):
    argv = [_fill(a, bad) for a in case]
    rc, err = _run(argv, capsys)
    assert rc != 0, f"{argv} exited 0"
    assert "Traceback" not in err, err
    assert f"oscar {argv[0]}: error:" in err or "usage:" in err, err


@pytest.mark.parametrize("case", [c for c in [["calibrate", "--model", "tiny-llama"], ["fit", "x.zarr", "--out", "a.safetensors"],
                                              ["validate", "niah", "--out", "n"], ["plan", "--model", "tiny-llama"]]])
def test_bad_option_is_a_usage_message(case, capsys):
    rc, err = _run(case + ["--no-such-option"], capsys)
    assert rc == 2 and "usage:" in err and "Traceback" not in err


def test_fit_out_in_missing_directory_refused_before_work(tmp_path, capsys):
    """`oscar fit --out missing_dir/a.safetensors` fails at once, naming the directory (no fitting)."""
    rc, err = _run(["fit", str(tmp_path / "not-even-a-store"), "--out", str(tmp_path / "missing_dir" / "a.safetensors")],
                   capsys)
    assert rc == 2 and "missing_dir does not exist" in err


@pytest.mark.parametrize("argv", [["plan", "--model", "tiny-llama", "--stages", "2", "--json"],
                                  ["bench", "memory", "--model", "tiny-llama", "--json"]])
def test_closed_pipe_ends_quietly(argv):
    """`oscar plan ... --json | head -1`: the reader is gone before we write; no traceback, no noise."""
    r, w = os.pipe()
    os.close(r)  # every write to w now fails with EPIPE
    p = subprocess.run([sys.executable, "-m", "oscar", *argv], stdout=w, stderr=subprocess.PIPE, text=True,
                       cwd=ROOT, timeout=300)
    os.close(w)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    assert p.returncode == 141


def test_inspect_piped_to_head_is_quiet(tmp_path):
    """The shell form of the report: `oscar inspect STORE | head -1`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_ti", Path(__file__).with_name("test_integrity.py"))
    ti = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ti)
    from oscar.pipeline.calibrate import run_blocks
    from oscar.pipeline.store import CalibStore, WriterLock

    model = ti.ts.ref.make_model("llama")
    tokens, mask = ti.ts.block_data()
    path = tmp_path / "s.zarr"
    with WriterLock(path, range(3)):
        run_blocks(model, CalibStore.open_or_create(path, ti.ts.meta_for(model), tokens, mask), progress=False)
    p = subprocess.run(f"{sys.executable} -m oscar inspect {path} --json | head -c 1", shell=True, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.stdout == "{" and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
