"""`oscar run --stages 2` (the tune, widths, needles and perplexity on pipeline stage actors of a local Ray cluster) against
the same run in one process: the same artifact, the same needle answers, per-window NLLs within 1e-5 relative;
run.json and the report say where each step ran; refusals come before calibration."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file

from oscar.common import OscarError, set_threads
from oscar.run import RunConfig, run_main

from helpers.cluster import attached_head

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1500)]


def _cfg(out, **kw) -> RunConfig:
    # the whole recipe, per-layer widths included (one 1024-token copy window: the needle length bounds it)
    return RunConfig(out=str(out), model="tiny-llama", calib_tokens=2048, seq_len=512, samples=2,
                     tasks=["niah_single_1"], lengths=[1024], methods=["bf16", "naive-int2", "oscar-int2"],
                     ppl_tokens=1024, ppl_contexts=[512], attn_lengths=[512], widths_windows=1, dtype="float32",
                     progress=False, cluster={"cpus_per_stage": 1}, **kw)


def _lines(path: str) -> list[dict]:
    return [json.loads(x) for x in open(path)]


def test_run_on_two_stages_equals_one_process(tmp_path):
    set_threads(1)  # the stage actors run one thread each
    with attached_head(num_cpus=4):
        one = run_main(_cfg(tmp_path / "one", stages=1))
        two = run_main(_cfg(tmp_path / "two", stages=2))
    a, b = (load_file(str(tmp_path / d / "artifact.safetensors")) for d in ("one", "two"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # the same tune choice, the same tensors
    key = lambda r: (r["task"], r["length"], r["index"], r["method"])  # noqa: E731
    n1, n2 = ({key(r): r["pred"] for r in _lines(str(tmp_path / d / "niah_samples.jsonl"))} for d in ("one", "two"))
    assert n1 == n2 and len(n1) == 6
    wkey = lambda r: (r["method"], r["protocol"], r["context"], r["window"])  # noqa: E731
    p1, p2 = ({wkey(r): r["nll"] for r in _lines(str(tmp_path / d / "ppl_windows.jsonl"))} for d in ("one", "two"))
    assert p1.keys() == p2.keys() and p1 and all(abs(p1[k] - p2[k]) <= 1e-5 * abs(p1[k]) for k in p1)
    assert one["placement"]["niah"] == {"stages": 1, "device": "cpu", "on": "this process"}
    assert two["placement"]["niah"]["stages"] == 2 and two["placement"]["tune"]["stages"] == 2
    assert "not run" == two["placement"]["attention"]["on"] and not os.path.exists(tmp_path / "two" / "attention.parquet")
    report = open(tmp_path / "two" / "report.md").read()
    assert "Steps ran on: calibrate 1 stage on cpu (Ray); tune 2 stages on cpu (Ray stage actors); widths 2 stages" in report
    assert two["stage_seconds"].keys() >= {"tune", "widths", "niah", "ppl"}


def test_staged_run_refusals_before_calibration(tmp_path):
    for kw, msg in [(dict(ray=False), "drop --no-ray"), (dict(engine="cache"), "takes --engine simulate --device cpu"),
                    (dict(widths="copy", variant="scaled"), "with --ray pass --widths gradient"),
                    (dict(stages=0), "stages must be a positive integer")]:
        with pytest.raises(OscarError, match=msg):
            RunConfig(out=str(tmp_path / "r"), stages=kw.pop("stages", 2), **kw)
    assert RunConfig(out=str(tmp_path), cluster={"stages": 3}, widths="none").stages == 3  # a run: job's cluster sets the default
    assert not os.path.exists(tmp_path / "r")
