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
    (d / "chat.jsonl").write_text('{"text": "prose"}\n{"messages": [{"role": "user"}]}\n')
    (d / "other.zarr").mkdir()
    (d / "other.zarr" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {"format": "x"}}')
    return {k: str(d / k) for k in ("junk.bin", "junk.safetensors", "junk.gguf", "junk.parquet", "junk.json",
                                    "junk.yaml", "junkdir", "junk.zarr", "other.zarr", "chat.jsonl")} | {
        "missing": str(d / "missing"), "tmp": str(d), "nodir": str(d / "no_such_dir" / "a.safetensors")}


CASES = [
    ["calibrate", "--model", "{missing}", "--store", "{tmp}/s1.zarr"],
    ["calibrate", "--model", "{junk.gguf}", "--store", "{tmp}/s2.zarr"],
    ["calibrate", "--model", "{junkdir}", "--store", "{tmp}/s3.zarr"],
    ["calibrate", "--model", "tiny-llama", "--corpus", "{junk.parquet}", "--store", "{tmp}/s4.zarr"],
    ["calibrate", "--model", "tiny-llama", "--store", "{junk.bin}"],
    ["calibrate", "--model", "tiny-llama", "--store", "{junkdir}"],
    ["calibrate", "--seq-len", "0"],
    ["calibrate", "--model", "tiny-llama", "--blocks", "999", "--store", "{tmp}/s5.zarr"],  # more than pydoc gives
    ["calibrate", "--model", "tiny-llama", "--tokens", "99999999", "--store", "{tmp}/s6.zarr"],
    ["calibrate", "--model", "tiny-llama", "--corpus", "{chat.jsonl}", "--store", "{tmp}/s7.zarr"],
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
    ["fit", "{junk.zarr}", "--widths", "none", "--out", "{tmp}/t.safetensors"],
    ["fit", "{other.zarr}", "--no-tune", "--out", "{tmp}/t.safetensors"],
    ["validate", "attention", "--store", "{junk.zarr}", "--out", "{tmp}/a1"],
    ["validate", "attention", "--store", "{missing}", "--out", "{tmp}/a2"],
    ["run", "--out", "{junk.bin}"], ["run", "--out", "{tmp}/r1", "--no-ray", "--model", "{missing}"],
    ["ablate", "--out", "{junk.bin}", "--smoke"],
    ["ablate", "--out", "{tmp}/ab", "--smoke", "--regimes", "real", "--store", "{junk.zarr}"],
    ["plan", "--model", "{missing}", "--stages", "1"], ["plan", "--model", "{junk.json}", "--stages", "1"],
    ["plan", "--model", "tiny-llama", "--stages", "0"],
    ["plan", "--model", "tiny-llama", "--stages", "1", "--blocks", "64"],  # more than pydoc gives
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
    from helpers.capture_reference import make_model
    from helpers.stores import block_data, meta_for
    from oscar.pipeline.calibrate import run_blocks
    from oscar.pipeline.store import CalibStore, WriterLock

    model = make_model("llama")
    tokens, mask = block_data()
    path = tmp_path / "s.zarr"
    with WriterLock(path, range(3)):
        run_blocks(model, CalibStore.open_or_create(path, meta_for(model), tokens, mask), progress=False)
    p = subprocess.run(f"{sys.executable} -m oscar inspect {path} --json | head -c 1", shell=True, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.stdout == "{" and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


# --------------------------------------------------------------------------- checked before any work

BAD_SIZES = [
    ["calibrate", "--seq-len", "-4"], ["calibrate", "--positions", "0"], ["calibrate", "--sink", "-1"],
    ["calibrate", "--blocks", "0"], ["calibrate", "--block-tokens", "0"], ["calibrate", "--seqs-per-block", "-2"],
    ["calibrate", "--tokens", "0"], ["calibrate", "--batch-size", "0"], ["calibrate", "--reservoir", "-1"],
    ["calibrate", "--threads", "0"], ["calibrate", "--seed", "-1"], ["calibrate", "--seq-len", "abc"],
    ["calibrate", "--ray", "auto", "--stages", "0"], ["calibrate", "--ray", "auto", "--replicas", "0"],
    ["calibrate", "--ray", "auto", "--cpus-per-stage", "-1"], ["calibrate", "--ray", "auto", "--memory-per-stage", "0"],
    ["fit", "s.zarr", "--bits", "0"], ["fit", "s.zarr", "--bits", "9"], ["fit", "s.zarr", "--group-size", "0"],
    ["fit", "s.zarr", "--sink", "-1"], ["fit", "s.zarr", "--recent", "-16"], ["fit", "s.zarr", "--threads", "0"],
    ["inspect", "s.zarr", "--top", "0"],
    ["validate", "niah", "--lengths", "0"], ["validate", "niah", "--lengths", "1k,0"], ["validate", "niah", "--lengths", "-1k"],
    ["validate", "niah", "--lengths", "1k,,2k"], ["validate", "niah", "--lengths", ""], ["validate", "niah", "--lengths", "zz"],
    ["validate", "niah", "--samples", "0"], ["validate", "niah", "--seed", "-3"],
    ["validate", "ppl", "--lengths", "0"], ["validate", "ppl", "--tokens", "0"],
    ["fit", "s.zarr", "--widths", "wide"], ["fit", "s.zarr", "--tune-objective", "loss"], ["fit", "s.zarr", "--blocks", "0"],
    ["validate", "attention", "--store", "s.zarr", "--lengths", "4k,0"],
    ["validate", "attention", "--store", "s.zarr", "--windows", "0"],
    ["validate", "attention", "--store", "s.zarr", "--seq-len", "0"],
    ["validate", "attention", "--store", "s.zarr", "--layers", "0,-1"],
    ["validate", "attention", "--store", "s.zarr", "--sink", "-1"],
    ["run", "--samples", "0"], ["run", "--calib-seq-len", "0"], ["run", "--calib-positions", "-1"],
    ["run", "--lengths", "1k,0"], ["run", "--long-lengths", "x"], ["run", "--long-samples", "0"],
    ["run", "--ppl-contexts", ""], ["run", "--ppl-tokens", "0"], ["run", "--attn-lengths", "4k,"], ["run", "--positions", "2q"],
    ["ablate", "--seeds", "0"], ["ablate", "--bits", "2", "0"], ["ablate", "--nu", "0"], ["ablate", "--nu", "nan"],
    ["ablate", "--layer", "-1"], ["ablate", "--head", "-1"], ["ablate", "--triton-seeds", "-1"],
    ["bench", "memory", "--context", "0"], ["bench", "memory", "--sink", "-1"], ["bench", "memory", "--page-size", "0"],
    ["import", "p", "--format", "sglang-oscar", "--num-kv-heads", "0"],
    ["submit", "job.yaml", "--timeout", "0"],
]  # plan and cluster render refuse their sizes themselves, before reading a config (tests/test_cluster_plan.py, _render.py)
OUT = {"calibrate": "--store", "fit": "--out", "validate": "--out", "run": "--out", "ablate": "--out", "bench": "--out",
       "import": "--out"}


@pytest.mark.parametrize("case", BAD_SIZES, ids=[" ".join(c) for c in BAD_SIZES])
def test_bad_size_is_a_usage_error_before_anything_runs(case, tmp_path, capsys):
    """Zero, negative or malformed sizes and length lists: argparse's one-line error (exit 2) at parse time, so
    nothing runs and the output path is never created."""
    out = tmp_path / "out"
    argv = list(case)
    flag = OUT.get(case[0])
    if flag:
        suffix = ".safetensors" if case[:2] in (["fit", "s.zarr"], ["import", "p"]) or case[1:2] in (["tune"], ["widths"]) \
            else ".json" if case[0] == "bench" else ""
        out = tmp_path / ("out" + suffix)
        argv += [flag, str(out)]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "usage: oscar" in err and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("oscar ") and ": error: argument " in last, last
    assert not out.exists() and os.listdir(tmp_path) == []


def test_lengths_zero_refused_before_any_work(tmp_path):
    """`oscar validate niah --lengths 0` once refused the length only after minutes of work, leaving files in --out."""
    out = tmp_path / "n"
    p = subprocess.run([sys.executable, "-m", "oscar", "validate", "niah", "--lengths", "0", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("oscar validate niah: error: argument --lengths/--contexts: "
                                                "length '0' in '0' must be at least 1 token")
    assert not out.exists()


def test_argument_types():
    import argparse

    from oscar.common import (int_between, length_list, nonneg_float, nonneg_int, nonneg_int_list, parse_token_count,
                              positive_float, positive_float_list, positive_int)

    assert positive_int("3") == 3 and nonneg_int("0") == 0 and positive_float("0.5") == 0.5 and nonneg_float("0") == 0
    assert int_between(1, 8)("8") == 8 and length_list("1k, 4096,2.5k") == "1k, 4096,2.5k"
    assert [parse_token_count(x) for x in ("1k", "128k", "1500", "0.5k")] == [1024, 131072, 1500, 512]
    assert nonneg_int_list("") == "" and nonneg_int_list("0,3") == "0,3" and positive_float_list("1,1.5") == "1,1.5"
    for f, v in [(positive_int, "0"), (positive_int, "-1"), (positive_int, "1.5"), (nonneg_int, "-1"),
                 (positive_float, "0"), (positive_float, "inf"), (nonneg_float, "-0.1"), (int_between(1, 8), "0"),
                 (length_list, "0"), (length_list, "1k,"), (length_list, "0.3"), (nonneg_int_list, "a"),
                 (positive_float_list, "-1")]:
        with pytest.raises(argparse.ArgumentTypeError):
            f(v)


def test_every_size_option_is_typed():
    """No option of any command parses a bare int or float: each says which values it accepts (positive_int, ...)."""
    import argparse

    from helpers.cli import walk

    # Ray's --max-restarts: -1 = restart forever; plan and cluster render check their sizes in cluster/plan.py and
    # cluster/render.py, before reading a config, with messages of their own
    loose = [f"{' '.join(path)} {'/'.join(a.option_strings)}" for path, p in walk(build_parser()) for a in p._actions
             if a.type in (int, float) and not a.choices and a.dest != "max_restarts"
             and path[1:] not in (("plan",), ("cluster", "render"))]
    assert not loose, loose
    assert isinstance(build_parser(), argparse.ArgumentParser)


@pytest.mark.parametrize("case", [
    ["fit", "s.zarr", "--out", "/proc/oscar-x.safetensors"],
    ["import", "p", "--format", "gguf-rot", "--out", "/proc/oscar-x.safetensors"],
    ["fit", "s.zarr", "--no-tune", "--widths", "none", "--out", "/sys/oscar-x.safetensors"],
    ["validate", "niah", "--out", "/proc/oscar-run"],
    ["run", "--out", "/proc/oscar-run/sub"],
    ["bench", "memory", "--out", "/proc/oscar-mem.json"],
    ["calibrate", "--store", "/sys/oscar.zarr"],
])
def test_unwritable_output_refused_before_work(case, capsys):
    """Root is granted W_OK on /proc and /sys by os.access, yet nothing can be created there: the check probes
    by creating (and removing) a file, so these fail at once with one line, not after the work."""
    if not os.path.isdir("/proc") or not os.path.isdir("/sys"):
        pytest.skip("no /proc, /sys")
    rc, err = _run(case, capsys)
    assert rc == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert f"oscar {case[0]}: error: " in err and ("--out" in err or "--store" in err)


def test_read_only_directory_refused(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes into a mode-555 directory (a read-only mount is what refuses root: /proc stands in)")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        rc, err = _run(["fit", "s.zarr", "--out", str(d / "a.safetensors")], capsys)
        assert rc == 2 and "cannot create a file" in err
        rc, err = _run(["validate", "niah", "--out", str(d / "n")], capsys)
        assert rc == 2 and "not writable" in err
    finally:
        d.chmod(0o755)


@pytest.mark.parametrize("case", [
    ["fit", "s.zarr", "--out", "{d}"], ["import", "p", "--format", "gguf-rot", "--out", "{d}"],
    ["fit", "s.zarr", "--widths", "none", "--out", "{d}"], ["bench", "memory", "--out", "{d}"],
])
def test_out_directory_where_a_file_is_expected(case, tmp_path, capsys):
    """A command that writes one file refuses an existing directory as --out, whatever its name."""
    d = tmp_path / "somedir"
    d.mkdir()
    rc, err = _run([a.replace("{d}", str(d)) for a in case], capsys)
    assert rc == 2 and f"--out {d} is a directory; give a file path" in err and "Traceback" not in err
    assert os.listdir(d) == []


def test_output_probe_leaves_nothing(tmp_path):
    from oscar.common import OscarError, check_output_path

    (tmp_path / "empty").mkdir()
    check_output_path(str(tmp_path / "empty"), file=False)
    check_output_path(str(tmp_path / "empty" / "a.safetensors"))
    check_output_path(str(tmp_path / "new" / "deeper"), file=False)
    assert os.listdir(tmp_path / "empty") == [] and sorted(os.listdir(tmp_path)) == ["empty"]
    (tmp_path / "f.safetensors").write_bytes(b"keep")
    check_output_path(str(tmp_path / "f.safetensors"))  # an existing file is opened for writing, not truncated
    assert (tmp_path / "f.safetensors").read_bytes() == b"keep"
    with pytest.raises(OscarError, match="exists and is not a directory"):
        check_output_path(str(tmp_path / "f.safetensors"), file=False)


def test_run_config_refuses_bad_sizes_before_any_stage(tmp_path):
    """A `run:` job config reaches RunConfig without argparse: lengths and sizes are checked there, and lengths may
    be written in k-units."""
    from oscar.common import OscarError
    from oscar.run import RunConfig

    assert RunConfig(out=str(tmp_path / "r"), lengths=["1k", 2048]).lengths == [1024, 2048]
    for kw in ({"lengths": [0]}, {"lengths": []}, {"lengths": ["zz"]}, {"ppl_contexts": [-1024]},
               {"attn_lengths": [0]}, {"samples": 0}, {"ppl_tokens": 0}, {"widths_windows": 0}, {"seq_len": 0},
               {"calib_tokens": 0}, {"long_lengths": [0]}, {"long_samples": 0}):
        with pytest.raises(OscarError, match="oscar run: "):
            RunConfig(out=str(tmp_path / "r"), **kw)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("case,msg", [
    (["run", "--no-ray", "--model", "no-such-model", "--out", "{o}"], "unknown model 'no-such-model'"),
    (["run", "--no-ray", "--calib-tokens", "1000000", "--out", "{o}"],
     "--tokens 1,000,000 asks for more than the calibration split gives"),
    (["run", "--no-ray", "--long-lengths", "16k", "--positions", "8k", "--out", "{o}"],
     "long-end needle cells of 16384 tokens reach past the calibration positions 8192; raise --positions"),
    (["run", "--no-ray", "--long-lengths", "16k", "--methods", "kivi2,tq-int2", "--out", "{o}"],
     "the long-end needle cells (16384) score bf16 and oscar-int2; --methods kivi2,tq-int2 has neither"),
    (["validate", "niah", "--model", "tiny-llama@seed=x", "--out", "{o}"], "bad model spec"),
    (["validate", "ppl", "--model", "{t}/missing.gguf", "--out", "{o}"], "GGUF file not found"),
    (["validate", "niah", "--corpus", "{t}/missing.txt", "--out", "{o}"], "--corpus {t}/missing.txt: no such file"),
    (["calibrate", "--corpus", "{t}", "--store", "{o}"], "is a directory"),
    (["validate", "niah", "--artifact", "{t}/missing.safetensors", "--out", "{o}"], "no such artifact file"),
    (["fit", "{t}/missing.zarr", "--out", "{o}.safetensors"], "calibration store {t}/missing.zarr does not exist"),
    (["bench", "memory", "--artifact", "{t}/missing.safetensors", "--out", "{o}.json"], "no such artifact file"),
    (["export", "{t}/missing.safetensors", "--format", "gguf-rot", "--out", "{o}"], "ARTIFACT {t}/missing.safetensors"),
    (["validate", "attention", "--store", "{t}/missing.zarr", "--artifact", "{t}/a.safetensors", "--out", "{o}"],
     "calibration store {t}/missing.zarr does not exist"),
])
def test_inputs_checked_before_any_work(case, msg, tmp_path, capsys):
    """The model spec, corpus, artifact and store paths are checked before any model loads or --out is created
    (`oscar run --model typo` used to leave DIR/stages behind)."""
    (tmp_path / "a.safetensors").write_bytes(b"x")
    t, o = str(tmp_path), str(tmp_path / "out")
    rc, err = _run([a.replace("{t}", t).replace("{o}", o) for a in case], capsys)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"oscar {case[0]}: error: " in err and msg.replace("{t}", t) in err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]
