"""An example made by the main job holds its evidence (tests/helpers/example_evidence.py): the checks pass on a real
small `oscar run` with the long end and fail on each gap they look for; the committed second-model example is held
to them at its own sizes."""

from __future__ import annotations

import json
import os
import shutil

import pandas as pd
import pytest

from helpers.example_evidence import Sizes, cell_problems, example_problems, interval_problems, run_json_problems
from oscar.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "reports", "examples", "qwen2.5-0.5b")
QWEN = Sizes(tasks=["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1"],
             lengths=[1024, 2048, 4096, 8192], methods=["bf16", "oscar-int2", "kivi2", "tq-int2"], samples=20,
             contexts=[1024, 4096, 8192], windows=8, min_positions=8192, long_task="niah_single_1",
             long_lengths=[16384, 32768], long_samples=5)
# the small run below: 2 samples per cell, 2 windows per context, the long end at 1k
SMALL = Sizes(tasks=["niah_single_1", "niah_single_2"], lengths=[256, 512], methods=["bf16", "oscar-int2"], samples=2,
              contexts=[256, 512], windows=2, min_positions=1024, long_task="niah_single_1", long_lengths=[1024],
              long_samples=1)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("run") / "run")
    argv = ["run", "--out", d, "--no-ray", "--model", "tiny-llama", "--calib-tokens", "2048", "--seq-len", "256",
            "--samples", "2", "--tasks", "niah_single_1,niah_single_2", "--lengths", "256,512", "--long-lengths", "1k",
            "--long-samples", "1", "--methods", "bf16,oscar-int2", "--ppl-contexts", "256,512", "--ppl-tokens", "1k",
            "--attn-lengths", "512", "--no-progress"]
    assert main(argv) == 0
    return d


def _copy(src: str, dst) -> str:
    d = str(dst / "copy")
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("calib.zarr"))
    return d


@pytest.mark.slow
def test_the_checks_pass_on_a_real_run_and_fail_on_each_gap(small_run, tmp_path):
    assert example_problems(small_run, SMALL) == []
    info = json.load(open(os.path.join(small_run, "run.json")))
    assert [s["stage"] for s in info["steps"]][-1] == "niah-long" and "--long-lengths 1k" in info["command"]
    assert info["total_cpu_seconds"] == pytest.approx(sum(s["cpu_s"] for s in info["steps"]))
    report = open(os.path.join(small_run, "report.md")).read()  # the report lists each step's command and time
    assert "## Commands" in report and "`oscar calibrate --model tiny-llama --corpus pydoc --store " in report
    # asking for more than the run holds
    more = Sizes(**{**SMALL.__dict__, "samples": 3, "windows": 3, "long_samples": 2, "min_positions": 2048})
    got = example_problems(small_run, more)
    assert any(p.startswith("needle cell niah_single_2 512 oscar-int2: 2 samples") for p in got)
    assert any(p.startswith("long-end cell niah_single_1 1024 bf16: 1 samples") for p in got)
    assert any(p.startswith("perplexity oscar-int2 strict 512: 2 windows") for p in got)
    assert any(p.startswith("calibration at positions 1024: fewer than 2048") for p in got)

    # a sample line dropped: the cell is short and results.parquet no longer recomputes
    d = _copy(small_run, tmp_path / "a")
    lines = open(os.path.join(d, "niah_samples.jsonl")).readlines()
    gone = json.loads(lines[0])
    open(os.path.join(d, "niah_samples.jsonl"), "w").writelines(lines[1:])
    assert any(f"{gone['task']} {gone['length']} {gone['method']}" in p for p in cell_problems(d, SMALL))
    assert any("do not recompute from the sample lines" in p for p in interval_problems(d))

    # an interval edited in results.parquet, a perplexity in ppl.parquet
    d = _copy(small_run, tmp_path / "b")
    res = pd.read_parquet(os.path.join(d, "results.parquet"))
    res.loc[0, "ci_high"] = res.loc[0, "ci_high"] * 0.5 + 1
    res.to_parquet(os.path.join(d, "results.parquet"), index=False)
    ppl = pd.read_parquet(os.path.join(d, "ppl.parquet"))
    ppl.loc[1, "ratio_ci_low"] = ppl.loc[1, "ratio_ci_low"] + 0.01
    ppl.to_parquet(os.path.join(d, "ppl.parquet"), index=False)
    got = interval_problems(d)
    assert any("results.parquet" in p and "ci_high" in p for p in got) and any("ppl.parquet" in p for p in got)

    # a recorded command that is not a product command, a step without CPU time, another script's run.json
    d = _copy(small_run, tmp_path / "c")
    info = json.load(open(os.path.join(d, "run.json")))
    info["steps"][0]["command"] = "python -c 'calibrate()'"
    info["steps"][1]["cpu_s"] = None
    info["command"] = "bash scripts/make_example.sh"
    json.dump(info, open(os.path.join(d, "run.json"), "w"))
    got = run_json_problems(d, SMALL)
    assert any("calibrate step is not a product command" in p for p in got)
    assert any("fit step records no CPU seconds" in p for p in got)
    assert any("command is not `oscar run`" in p for p in got)

    # samples of another artifact in the same directory
    d = _copy(small_run, tmp_path / "d")
    cfg = json.load(open(os.path.join(d, "niah_config.json")))
    cfg["identity"]["artifact"] = "0" * 16
    json.dump(cfg, open(os.path.join(d, "niah_config.json"), "w"))
    assert any("niah_config.json names another artifact" in p for p in run_json_problems(d, SMALL))


def example_from_the_main_job() -> bool:
    info = json.load(open(os.path.join(EX, "run.json")))
    return info.get("command", "").startswith("oscar run ")


@pytest.mark.xfail(not example_from_the_main_job(), strict=True,
                   reason="the committed example still comes from a script of single steps; the main job's run "
                          "replaces it")
def test_committed_second_model_example_holds_its_evidence():
    assert example_problems(EX, QWEN) == []
