"""Perplexity on the pipeline stages (cluster/scoring.py) equals one process: `oscar validate ppl --ray --stages 2`
on a real local Ray cluster against `run_ppl` in this process, per window, for every method and protocol; a
resumed staged run scores only what is missing.

Tolerance: per-window NLL within 1e-5 relative (the stages run the same float32 operations in the same order;
only the thread count of a GEMM's reduction may differ between the two processes)."""

from __future__ import annotations

import json
import os

import pytest

from oscar.cluster.pipeline import ClusterConfig
from oscar.cluster.scoring import StagedScorer
from oscar.common import set_threads
from oscar.stats.fit import FitConfig, fit
from oscar.validate.ppl import PplConfig, run_ppl

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(900)]
REL = 1e-5


def windows(out: str) -> dict:
    return {(r["method"], r["protocol"], r["context"], r["window"]): (r["nll"], r["count"])
            for r in map(json.loads, open(os.path.join(out, "ppl_windows.jsonl")))}


def assert_equal_windows(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k][1] == b[k][1] and abs(a[k][0] - b[k][0]) <= REL * abs(a[k][0]), (k, a[k], b[k])


class Counting(StagedScorer):
    """The stages, counting the windows sent through them."""
    sent = 0

    def score(self, jobs, **kw):
        type(self).sent += len(jobs)
        return super().score(jobs, **kw)


@pytest.mark.parametrize("model,methods", [
    ("tiny-llama", ["bf16", "naive-int2", "oscar-int2"]),
    ("tiny-glm4-moe", ["bf16", "naive-int2", "hadamard-int2"]),
    pytest.param("smollm2-135m", ["bf16", "kivi2", "hadamard-int2"], marks=pytest.mark.full),  # the real model
])
def test_two_stages_equal_one_process(model, methods, ray_head, scaled_artifact, tmp_path):
    kw = dict(model=model, methods=methods, contexts=[128, 256], tokens=512,
              artifact=scaled_artifact if "oscar-int2" in methods else None)
    set_threads(1)  # each stage actor runs one thread
    run_ppl(PplConfig(out=str(tmp_path / "one"), **kw), progress=False, workers=1)
    with StagedScorer(model, ClusterConfig(stages=2, cpus_per_stage=1), address=ray_head.address) as sc:
        assert [b - a for a, b in sc.ranges] and len(sc.ranges) == 2
        run_ppl(PplConfig(out=str(tmp_path / "two"), **kw), progress=False, scorer=sc)
    assert_equal_windows(windows(str(tmp_path / "one")), windows(str(tmp_path / "two")))


def test_cli_resumes_without_scoring_twice(ray_head, tmp_path, capsys, monkeypatch):
    """`oscar validate ppl --ray ADDR --stages 2`; a run whose log lost its last windows (killed) scores exactly
    those again, and the table is the same."""
    import oscar.cluster.scoring as scoring
    from oscar.__main__ import main

    out = tmp_path / "p"
    argv = ["validate", "ppl", "--model", "tiny-llama", "--methods", "bf16,naive-int2", "--lengths", "128",
            "--tokens", "512", "--protocol", "strict", "--dtype", "float32", "--out", str(out), "--ray", ray_head.address,
            "--stages", "2", "--no-progress"]
    monkeypatch.setattr(scoring, "StagedScorer", Counting)
    assert main(argv) == 0 and Counting.sent == 8  # 2 methods x 4 windows
    full = windows(str(out))
    lines = open(out / "ppl_windows.jsonl").read().splitlines(True)
    open(out / "ppl_windows.jsonl", "w").writelines(lines[:5])  # as if killed after 5 windows
    Counting.sent = 0
    assert main(argv) == 0 and Counting.sent == 3
    assert windows(str(out)) == full and len(open(out / "ppl_windows.jsonl").read().splitlines()) == 8


def test_stages_without_ray_refused(capsys):
    from oscar.__main__ import main

    assert main(["validate", "ppl", "--stages", "2", "--out", "/tmp/oscar-never-written"]) == 2
    err = capsys.readouterr().err
    assert "--stages needs --ray" in err and err.count("\n") == 1 and not os.path.exists("/tmp/oscar-never-written")


# tiny-llama's tune on two stages also runs inside tests/test_run_stages.py (the whole recipe on two stages against
# one process); here the CI tier keeps the MoE model, the full tier repeats the dense ones
@pytest.mark.parametrize("model", [pytest.param("tiny-llama", marks=pytest.mark.full), "tiny-glm4-moe",
                                   pytest.param("smollm2-135m", marks=pytest.mark.full)])
def test_tune_on_two_stages_equals_one_process(model, ray_head, stores, tmp_path):
    """The recipe's tune with its windows scored on 2 stages (float64, as in one process): the same NLL per factor
    within float64 summation order and the same factor; `oscar fit --ray` writes that tuned artifact."""
    from oscar.__main__ import main
    from oscar.stats.artifact import load_artifact
    from oscar.recipe.tune import TuneConfig, tune_key_clip
    from oscar.validate.env import load_model

    store = stores(model)
    fitted = fit(store, FitConfig(variant="scaled", progress=False, threads=1))
    m, tok, _ = load_model(model)
    set_threads(1)
    _, one = tune_key_clip(m, tok, fitted, TuneConfig(), progress=False)
    with StagedScorer(model, ClusterConfig(stages=2, cpus_per_stage=1, dtype="float64"), address=ray_head.address) as sc:
        _, two = tune_key_clip(None, None, fitted, TuneConfig(), progress=False, scorer=sc)
    assert one["chosen_factor"] == two["chosen_factor"] and two["stages"] == 2
    assert one["nll_per_token"].keys() == two["nll_per_token"].keys()
    for f, v in one["nll_per_token"].items():
        assert abs(v - two["nll_per_token"][f]) <= 1e-9 * abs(v) + 1e-6, f  # both rounded to 6 decimals
    if model != "tiny-llama":
        return
    out = str(tmp_path / "t.safetensors")
    assert main(["fit", store, "--out", out, "--widths", "none", "--ray", ray_head.address, "--stages", "2",
                 "--threads", "1", "--quiet"]) == 0
    rec = load_artifact(out).meta["clip_tuning"]
    assert rec["stages"] == 2 and rec["chosen_factor"] == one["chosen_factor"]


def test_fit_on_stages_refuses_the_widths_probe_before_any_work(tiny_store, tmp_path, capsys):
    from oscar.__main__ import main

    out = tmp_path / "w.safetensors"
    assert main(["fit", tiny_store, "--out", str(out), "--ray", "auto", "--stages", "2", "--widths", "copy"]) == 2
    err = capsys.readouterr().err
    assert "with --ray pass --widths gradient" in err and err.count("\n") == 1 and os.listdir(tmp_path) == []
