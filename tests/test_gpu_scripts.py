"""The GPU check's scripts stay runnable between GPU sessions: their CUDA code paths, run on CPU
with tiny sizes (--dry-run), produce complete JSON. Timings from these runs mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], tmp_path: Path, **env) -> dict:
    out = tmp_path / "out.json"
    e = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    r = subprocess.run([sys.executable, *args, "--out", str(out)], cwd=ROOT, env=e, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert "partial" not in d  # the final write replaced the per-row ones
    return d


def test_decode_benchmark_dry_run(tmp_path):
    d = _run(["bench/decode.py", "--dry-run", "--contexts", "700", "--batches", "1", "--no-tune"], tmp_path,
             TRITON_INTERPRET="1")
    (row,) = d["rows"]
    assert row["max_abs_diff_vs_reference"] < 6e-3  # fused kernel (fp16 dots) vs the torch reference
    assert set(d["targets"]) >= {"fraction_of_peak_ge_0.7_at_ge_32k", "faster_than_flashinfer_bf16_at_64k_b1"}


def test_e2e_decode_dry_run(tmp_path):
    d = _run(["bench/gpu_e2e.py", "decode", "--dry-run"], tmp_path)
    assert [r["context"] for r in d["rows"]] == [400, 700]
    for r in d["rows"]:
        assert "oscar_error" not in r and "bf16_error" not in r, r
        assert r["oscar_logits_finite"] and r["oscar_step_ms"] > 0 and r["bf16_step_ms"] > 0
        assert r["oscar_cache_bytes"] < r["bf16_cache_bytes"]  # the INT2 history is smaller than BF16


def test_e2e_calibrate_dry_run_in_process(tmp_path):
    d = _run(["bench/gpu_e2e.py", "calibrate", "--dry-run", "--no-ray", "--workdir", str(tmp_path / "w")], tmp_path)
    assert d["ray"] is False and d["blocks_done"] == 2 and d["tokens"] > 0
    assert [s["layers"] for s in d["stages"]] == [[0, 1], [1, 2]]
    assert all(s["plan_param_bytes"] > 0 for s in d["stages"])
    (counts,) = d["expert_tokens"].values()  # the MoE layer: every routed token counted top_k times
    assert counts["experts"] == 8 and counts["total"] == d["tokens"] * d["top_k"]


def test_e2e_calibrate_fp8_dry_run_in_process(tmp_path):
    """The block-FP8 checkpoint and its dequantized twin calibrate to the same store; the FP8 one is smaller on
    disk by its decoder weights (1 byte per parameter, plus one float32 scale per 128x128 block)."""
    d = _run(["bench/gpu_e2e.py", "calibrate-fp8", "--dry-run", "--no-ray", "--workdir", str(tmp_path / "w")],
             tmp_path)
    assert d["stores"]["max_rel_diff"] == 0.0 and d["stores"]["arrays"] > 10, d["stores"]
    assert not d["stores"]["only_in_first"] and not d["stores"]["only_in_second"]
    assert d["checkpoint_bytes"]["fp8"] < d["checkpoint_bytes"]["twin_bf16"]
    assert all(r["tokens"] > 0 for r in d["runs"].values())


@pytest.mark.parametrize("ray,eng", [pytest.param(True, "simulate", marks=pytest.mark.ray), (False, "simulate"),
                                     (False, "cache")])
def test_e2e_needles_dry_run(tmp_path, ray, eng):
    """The 2-stage needle decode: through Ray's stage actors, or (the GPU image has no Ray) the same stage objects
    called in this process, by the simulator or the product cache; the stages' answers equal one process's on the
    same device."""
    d = _run(["bench/gpu_e2e.py", "needles", "--dry-run", "--engine", eng, "--workdir", str(tmp_path / "w"),
              *([] if ray else ["--no-ray"])], tmp_path)
    assert d["ray"] is ray and d["engine"] == eng and d["ranges"] == [[0, 1], [1, 2]] and d["rows"] == 4
    assert d["answers_equal"] == d["rows"] and d["tokens_equal"] == d["tokens"] == 16


def test_e2e_latent_dry_run(tmp_path):
    """The MLA step: the Triton latent kernel (interpreted here) against the torch reference at two contexts, one
    with every token exact (no history) and one with an INT2 history."""
    d = _run(["bench/gpu_e2e.py", "latent", "--dry-run"], tmp_path, TRITON_INTERPRET="1")
    assert [r["context"] for r in d["rows"]] == [300, 500] and [r["history_tokens"] for r in d["rows"]] == [0, 180]
    assert d["all_ok"] and all(r["max_rel_err"] < 1e-4 for r in d["rows"])
