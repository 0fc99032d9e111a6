"""End to end on SmolLM2: `validate niah` (bf16 + one INT2 method, short length), resume, refusals, `report`."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from oscar.common import OscarError
from oscar.validate.niah import NiahConfig, run_niah

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    import torch

    from oscar.validate.env import load_model

    torch.set_num_threads(1)  # small shapes: one thread is faster and immune to a busy machine
    return load_model("smollm2-135m")


def _cfg(out, **kw):
    base = dict(out=str(out), methods=["bf16", "naive-int2"], tasks=["niah_single_1"], lengths=[400], samples=2)
    base.update(kw)
    return NiahConfig(**base)


def test_niah_resume_and_report(smollm2, tmp_path, monkeypatch):
    # 1. an uninterrupted run
    full = run_niah(_cfg(tmp_path / "a"), loaded=smollm2, progress=False)
    assert set(full.columns) >= {"suite", "task", "method", "length", "samples", "score"}
    assert len(full) == 2 and (full.samples == 2).all()
    bf16 = full.set_index("method").score["bf16"]
    assert bf16 == 100.0  # SmolLM2 retrieves a 7-digit needle at 400 tokens in full precision

    # 2. the same run, one sample per batch (part 1 decoded both samples in one batch), interrupted after
    # its first sample (both methods decode it together), then resumed
    from oscar.scoring import rows as scoring_rows

    calls = {"n": 0}
    real = scoring_rows.decode_rows

    def interrupting(*a, **k):
        if calls["n"] == 1:
            raise KeyboardInterrupt
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(scoring_rows, "decode_rows", interrupting)
    with pytest.raises(KeyboardInterrupt):  # workers=1: the patched decode runs in this process
        run_niah(_cfg(tmp_path / "b", batch_tokens=400), loaded=smollm2, progress=False, workers=1)
    lines = open(tmp_path / "b" / "niah_samples.jsonl").read().splitlines()
    assert len(lines) == 2
    monkeypatch.setattr(scoring_rows, "decode_rows", real)
    calls["n"] = 0
    resumed = run_niah(_cfg(tmp_path / "b", batch_tokens=400), loaded=smollm2, progress=False, workers=1)
    lines2 = open(tmp_path / "b" / "niah_samples.jsonl").read().splitlines()
    assert lines2[:2] == lines and len(lines2) == 4  # only the missing sample was scored
    pd.testing.assert_frame_equal(full.reset_index(drop=True), resumed.reset_index(drop=True))
    a = [json.loads(l) for l in open(tmp_path / "a" / "niah_samples.jsonl")]
    b = [json.loads(l) for l in lines2]
    assert sorted((r["index"], r["method"], r["pred"]) for r in a) == sorted((r["index"], r["method"], r["pred"]) for r in b)

    # a changed identity (seed) is refused instead of mixing results
    with pytest.raises(OscarError, match="holds NIAH samples"):
        run_niah(_cfg(tmp_path / "b", seed=1), loaded=smollm2, progress=False)
    # so are samples scored under an older meaning of the protocols (before pages were released whole)
    cpath = tmp_path / "b" / "niah_config.json"
    saved = cpath.read_text()
    old = json.loads(saved)
    old["identity"].pop("protocol_version")
    cpath.write_text(json.dumps(old))
    with pytest.raises(OscarError, match="holds NIAH samples"):
        run_niah(_cfg(tmp_path / "b"), loaded=smollm2, progress=False)
    cpath.write_text(saved)

    # 3. report on it (through the CLI: reads files only)
    r = subprocess.run([sys.executable, "-m", "oscar", "report", str(tmp_path / "b")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    md = open(tmp_path / "b" / "report.md").read()
    assert "### niah_single_1" in md and "| bf16 |" in md and "naive-int2" in md
    html = open(tmp_path / "b" / "report.html").read()
    assert "data:image/png;base64," in html and "<table>" in html
    mem = json.load(open(tmp_path / "b" / "memory.json"))
    assert {m["method"] for m in mem} == {"bf16", "naive-int2"}


def test_lengths_beyond_context_refused(smollm2, tmp_path):
    with pytest.raises(OscarError, match=r"exceed smollm2-135m's context of 8192"):
        run_niah(_cfg(tmp_path, lengths=[4096, 16384]), loaded=smollm2, progress=False)
    assert not os.path.exists(tmp_path / "niah_samples.jsonl")


def test_bad_inputs(smollm2, tmp_path):
    with pytest.raises(OscarError, match="need --artifact"):
        run_niah(_cfg(tmp_path, methods=["bf16", "oscar-int2"]), loaded=smollm2, progress=False)
    with pytest.raises(OscarError, match="unknown task"):
        run_niah(_cfg(tmp_path, tasks=["nope"]), loaded=smollm2, progress=False)
    with pytest.raises(OscarError, match="batch_tokens must be >= 1"):
        run_niah(_cfg(tmp_path, batch_tokens=0), loaded=smollm2, progress=False)
    with pytest.raises(OscarError, match="does not exist"):
        run_niah(_cfg(tmp_path, methods=["oscar-int2"], artifact=str(tmp_path / "x.safetensors")), loaded=smollm2, progress=False)


def test_cli_refuses_128k_cleanly(tmp_path):
    r = subprocess.run([sys.executable, "-m", "oscar", "validate", "niah", "--methods", "bf16", "--lengths", "128k",
                        "--samples", "1", "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "exceed" in r.stderr and "Traceback" not in r.stderr
