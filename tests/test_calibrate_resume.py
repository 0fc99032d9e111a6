"""A store resumes by its path alone: `oscar calibrate --store X` takes the job config X records; a flag that
contradicts it is refused before any work, naming the command that resumes (deleting the store comes last)."""

from __future__ import annotations

import shutil

import pytest

from oscar.__main__ import main
from oscar.pipeline.store import CalibStore, recorded_job


@pytest.fixture()
def store(tiny_store, tmp_path) -> str:
    dst = str(tmp_path / "s.zarr")
    shutil.copytree(tiny_store, dst)
    return dst


def test_recorded_job(store):
    rec = recorded_job(store)
    assert rec["config"]["model"] == "tiny-llama" and rec["config"]["seq_len"] == 96
    assert rec["blocks_done"] == rec["blocks_total"] == 2
    assert recorded_job(store + "-missing") is None


def test_resume_by_path_alone(store, capsys):
    before = CalibStore(store).done().copy()
    assert main(["calibrate", "--store", store, "--no-progress", "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert "0 this run, 2 resumed" in out
    assert "recorded job config: --model tiny-llama --corpus pydoc --seq-len 96 --sink 4 --seqs-per-block 2" in err
    assert "--seed 1" in err  # a non-default value the store records, not the flag's default
    assert (CalibStore(store).done() == before).all()


def test_same_values_given_resume(store, capsys):
    assert main(["calibrate", "--store", store, "--model", "TINY-LLAMA", "--seq-len", "96", "--seed", "1",
                 "--no-progress", "--threads", "1"]) == 0
    assert "0 this run, 2 resumed" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--seq-len", "128"], ["--seed", "0"], ["--block-tokens", "16384"],
                                   ["--ray", "auto", "--stages", "2", "--reservoir", "64"]])
def test_conflict_names_the_resume_command(store, capsys, extra):
    before = CalibStore(store).done().copy()
    assert main(["calibrate", "--store", store, "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith("oscar calibrate: error: store ") and f"`oscar calibrate --store {store}`" in line
    assert line.index(f"oscar calibrate --store {store}") < line.index("--overwrite")  # resume first, delete last
    assert "2/2 blocks done" in line
    assert (CalibStore(store).done() == before).all()


def test_overwrite_ignores_the_record(store, capsys):
    assert main(["calibrate", "--store", store, "--model", "tiny-llama", "--seq-len", "64", "--sink", "4",
                 "--seqs-per-block", "2", "--tokens", "128", "--reservoir", "8", "--overwrite", "--no-progress",
                 "--threads", "1"]) == 0
    assert recorded_job(store)["config"]["seq_len"] == 64
