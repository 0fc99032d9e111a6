"""`validate ppl` on SmolLM2 records each window's 512-token segments and writes the interval columns;
a segment's NLL is what a window of its length computes (causal model: a prefix is a window)."""

import json
import os

import numpy as np
import pandas as pd
import pytest
import torch

from oscar.validate.ppl import PplConfig, heldout_ids, heldout_text_ids, run_ppl
from oscar.scoring.nll import window_nll

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from oscar.validate.env import load_model

    torch.set_num_threads(1)
    return load_model("smollm2-135m")


def test_segments_windows_and_interval_columns(smollm2, tmp_path):
    out = str(tmp_path / "ppl")
    df = run_ppl(PplConfig(out=out, methods=["bf16", "naive-int2"], contexts=[256, 1024], tokens=2048,
                           protocols=["strict"]), loaded=smollm2, progress=False)
    assert set(df.columns) >= {"windows", "ratio", "ratio_ci_low", "ratio_ci_high", "ppl_ci_low", "ppl_ci_high", "blocks"}
    recs = [json.loads(l) for l in open(os.path.join(out, "ppl_windows.jsonl"))]
    for r in recs:  # segments add up to the window, each <= 512 predicted tokens
        assert sum(s[1] for s in r["seg"]) == r["count"] and max(s[1] for s in r["seg"]) <= 512
        assert sum(s[0] for s in r["seg"]) == pytest.approx(r["nll"], rel=1e-9)
    big = [r for r in recs if r["context"] == 1024]
    assert len(big) == 4 and all(len(r["seg"]) == 2 for r in big)
    # the first segment of a 1k window = a 513-token window scored on its own
    model, tok, _ = smollm2
    ids = torch.tensor([heldout_ids(tok, "pydoc", 2048)])
    first = next(r for r in big if r["method"] == "bf16" and r["window"] == 1)
    nll, n = window_nll(model, ids[:, 1024:1024 + 513])
    assert n == first["seg"][0][1] and nll == pytest.approx(first["seg"][0][0], rel=2e-4)
    row = df[(df.method == "naive-int2") & (df.context == 1024)].iloc[0]
    assert row.windows == 2 and row.block == "segment" and row.blocks == 4  # < 8 windows: their segments
    assert row.ratio_ci_low < row.ratio < row.ratio_ci_high and row.ratio > 1
    row = df[(df.method == "naive-int2") & (df.context == 256)].iloc[0]
    assert row.windows == 8 and row.block == "window" and row.blocks == 8
    assert row.ratio == pytest.approx(row.ratio_vs_bf16, rel=1e-12)  # every window paired: the same ratio
    goal = json.load(open(os.path.join(out, "goal.json")))
    assert goal["status"] == "not measured" and "rule" in goal  # no oscar-int2 in this run
    old = pd.read_parquet(os.path.join(out, "ppl.parquet"))
    assert len(old) == len(df)


def test_heldout_split_holds_the_main_jobs_windows(smollm2):
    """8192 tokens (the main job: 8 windows of 1k, 2 of 4k) and 12288 (--full: 3 of 4k) fit the split."""
    from oscar.common import OscarError
    from oscar.run import RunConfig

    _, tok, _ = smollm2
    assert RunConfig(out="x").ppl_tokens == 4096 and RunConfig(out="x", full=True).ppl_tokens == 12288
    ids, src = heldout_text_ids(tok, "pydoc", 12288)
    assert len(ids) == 12288 and src == {"split_tokens": 12288, "docstring_tokens": 0, "python": None}


def test_past_the_split_the_docstrings_follow_and_share_no_calibration_run(smollm2):
    """More tokens than the split holds: the split unchanged as a prefix, then standard-library docstrings that
    repeat no 32-token run of the calibration split (the second held-out source); refused past what both hold."""
    from oscar.common import OscarError
    from oscar.validate import env
    from oscar.validate.heldout import check_disjoint

    _, tok, _ = smollm2
    n = 16 * 4096
    ids, src = heldout_text_ids(tok, "pydoc", n)
    split = heldout_ids(tok, "pydoc", 12427)
    assert len(ids) == n and src["split_tokens"] == 12427 and src["docstring_tokens"] == n - 12427 and src["python"]
    assert ids[:12427] == split and len(tok(env.heldout_text("pydoc"), add_special_tokens=False)["input_ids"]) == 12427
    assert heldout_ids(tok, "pydoc", 20000) == ids[:20000]  # a longer budget only appends
    cal = np.array(tok(env._calibration_text("pydoc"), add_special_tokens=False)["input_ids"], dtype=np.int64)
    rep = check_disjoint([np.array(ids[12427:], dtype=np.int64)], cal[None], np.ones((1, len(cal)), bool))
    assert rep["calibration_tokens"] == len(cal) > 50_000
    # the check can fail: a calibration passage pasted into the stream is refused
    with pytest.raises(OscarError, match="repeats 32 tokens"):
        check_disjoint([np.array(ids[12427:20000] + cal[1000:1040].tolist())], cal[None], np.ones((1, len(cal)), bool))
    with pytest.raises(OscarError, match="held-out text gives only"):
        heldout_ids(tok, "pydoc", 50_000_000)


@pytest.mark.full
def test_ppl_past_the_split_records_its_text(smollm2, tmp_path):
    """A run past the split says so in its identity: resumed with the same budget, refused with another text."""
    out = str(tmp_path / "ppl")
    cfg = PplConfig(out=out, methods=["bf16"], contexts=[1024], tokens=13 * 1024, protocols=["strict"])
    df = run_ppl(cfg, loaded=smollm2, progress=False, workers=1)
    conf = json.load(open(os.path.join(out, "ppl_config.json")))
    assert conf["identity"]["text"]["docstring_tokens"] == 13 * 1024 - 12427 and conf["text"]["split_tokens"] == 12427
    assert int(df.iloc[0].windows) == 13
    recs = [json.loads(l) for l in open(os.path.join(out, "ppl_windows.jsonl"))]
    last = next(r for r in recs if r["window"] == 12)  # wholly docstrings: an ordinary perplexity, not a fault
    assert 1.0 < np.exp(last["nll"] / last["count"]) < 200
    run_ppl(cfg, loaded=smollm2, progress=False, workers=1)  # resumes: nothing rescored
    assert len(open(os.path.join(out, "ppl_windows.jsonl")).readlines()) == len(recs)
    ident = dict(conf["identity"], text=dict(conf["identity"]["text"], python="2.7.18"))
    json.dump(dict(conf, identity=ident), open(os.path.join(out, "ppl_config.json"), "w"))
    from oscar.common import OscarError
    with pytest.raises(OscarError, match="another model/artifact/token budget/text"):
        run_ppl(cfg, loaded=smollm2, progress=False, workers=1)
