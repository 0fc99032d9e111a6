"""Needles on the pipeline stages (cluster/scoring.py) equal one process: `oscar validate niah --ray --stages 2` on
a real local Ray cluster against `run_niah` in this process; every (task, length, sample, method) gets the same
greedy answer. A resumed staged run decodes only the samples it lacks.

Why identical answers (not a tolerance): both sides run the same float32 operations on the same shapes with one
thread (the stages' prefill and rows attention are the one-process functions); a greedy answer could only change
at an argmax tie within float summation order, which these fixed seeds do not meet."""

from __future__ import annotations

import json
import os

import pytest

from oscar.cluster.pipeline import ClusterConfig
from oscar.cluster.scoring import StagedScorer
from oscar.common import OscarError, set_threads
from oscar.validate.niah import NiahConfig, eos_ids, run_niah

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(900)]


def answers(out: str) -> dict:
    return {(r["task"], r["length"], r["index"], r["method"]): (r["pred"], r["score"])
            for r in map(json.loads, open(os.path.join(out, "niah_samples.jsonl")))}


def rows(out: str) -> list[dict]:
    return [json.loads(x) for x in open(os.path.join(out, "niah_samples.jsonl"))]


@pytest.mark.parametrize("model,methods", [
    ("tiny-llama", ["bf16", "naive-int2", "oscar-int2"]),
    ("tiny-glm4-moe", ["bf16", "naive-int2", "hadamard-int2"]),
    pytest.param("smollm2-135m", ["bf16", "kivi2", "hadamard-int2"], marks=pytest.mark.full),  # the real model
])
def test_needles_on_two_stages_equal_one_process(model, methods, ray_head, scaled_artifact, tmp_path):
    # batches of 2 samples at 300 tokens and of 1 at 600: rows leaving a batch, prefixes reused across samples
    kw = dict(model=model, methods=methods, tasks=["niah_single_1", "niah_multikey_1"], lengths=[300, 600],
              samples=3, protocol="strict", dtype="float32", batch_tokens=700,
              artifact=scaled_artifact if "oscar-int2" in methods else None)
    set_threads(1)  # each stage actor runs one thread
    run_niah(NiahConfig(out=str(tmp_path / "one"), **kw), progress=False, workers=1)
    with StagedScorer(model, ClusterConfig(stages=2, cpus_per_stage=1), address=ray_head.address) as sc:
        assert len(sc.ranges) == 2 and all(b > a for a, b in sc.ranges)
        run_niah(NiahConfig(out=str(tmp_path / "two"), **kw), progress=False, stages=sc)
        from oscar.validate.env import load_model

        m, tok, _ = load_model(model)
        assert eos_ids(sc, tok) == eos_ids(m, tok)  # the stages read the checkpoint's generation config
    one, two = answers(str(tmp_path / "one")), answers(str(tmp_path / "two"))
    assert one.keys() == two.keys() and len(one) == 2 * 2 * 3 * len(methods)
    assert one == two
    assert all(r["stages"] == 2 and r["batch_cpu_s"] > 0 for r in rows(str(tmp_path / "two")))


class Counting(StagedScorer):
    """The stages, counting the samples sent through them."""
    sent = 0

    def needle_batch(self, samples, names, protocol, eos, **kw):
        type(self).sent += len(samples)
        return super().needle_batch(samples, names, protocol, eos, **kw)


def test_cli_resumes_without_decoding_twice(ray_head, tmp_path, monkeypatch):
    """`oscar validate niah --ray ADDR --stages 2`; a run whose log lost its last samples (killed) decodes exactly
    those again, and the table is the same."""
    import oscar.cluster.scoring as scoring
    from oscar.__main__ import main

    out = tmp_path / "n"
    argv = ["validate", "niah", "--model", "tiny-llama", "--methods", "bf16,naive-int2", "--tasks", "niah_single_1",
            "--lengths", "300", "--samples", "4", "--protocol", "strict", "--dtype", "float32", "--out", str(out),
            "--ray", ray_head.address, "--stages", "2", "--no-progress"]
    monkeypatch.setattr(scoring, "StagedScorer", Counting)
    assert main(argv) == 0 and Counting.sent == 4
    full = answers(str(out))
    lines = open(out / "niah_samples.jsonl").read().splitlines(True)
    open(out / "niah_samples.jsonl", "w").writelines(lines[:5])  # as if killed inside sample 3 (2 rows per sample)
    Counting.sent = 0
    assert main(argv) == 0 and Counting.sent == 2  # samples 3 (one method lost) and 4
    assert answers(str(out)) == full and len(open(out / "niah_samples.jsonl").read().splitlines()) == 8


def test_refusals_before_any_work(capsys, tmp_path):
    from oscar.__main__ import main

    never = str(tmp_path / "never")
    assert main(["validate", "niah", "--stages", "2", "--out", never]) == 2
    assert "--stages needs --ray" in capsys.readouterr().err and not os.path.exists(never)
    # the stages compute in their own dtype (nothing connects or starts before the refusal)
    sc = StagedScorer("tiny-llama", ClusterConfig(stages=2, dtype="bfloat16"), address="auto")
    for engine in ("simulate", "cache"):
        with pytest.raises(OscarError, match="needles on the pipeline stages: they compute in their dtype bfloat16; "
                                             "got dtype float32"):
            run_niah(NiahConfig(out=never, model="tiny-llama", engine=engine, dtype="float32"), stages=sc)
    assert not os.path.exists(never) and not sc.actors


def test_gpu_stages_without_gpus_refused(ray_head, tmp_path, capsys):
    """`--device cuda` puts each stage on the GPU Ray gives it; a cluster without enough GPUs is refused at once
    (not after the placement's timeout), and so is a GPU share without --device cuda."""
    from oscar.__main__ import main

    base = ["validate", "niah", "--model", "tiny-llama", "--methods", "bf16", "--tasks", "niah_single_1", "--lengths",
            "300", "--samples", "1", "--dtype", "float32", "--ray", ray_head.address, "--stages", "2"]
    assert main(base + ["--device", "cuda", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "2 stages x 1 GPU need 2 GPUs; the Ray cluster has 0" in err and err.count("\n") == 1
    assert main(base + ["--gpus-per-stage", "0.5", "--out", str(tmp_path / "b")]) == 2
    assert "with --gpus-per-stage > 0; on CPU, none" in capsys.readouterr().err and not (tmp_path / "b").exists()
