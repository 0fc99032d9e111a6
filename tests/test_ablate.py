"""`oscar ablate`: outputs, resume, bad input, and the --quick run end to end through the CLI."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from oscar.common import OscarError
from oscar.reports.ablation import build_report
from oscar.validate.ablation.ablate import AblationConfig, run_ablation
from oscar.validate.ablation.regimes import RegimeConfig

COLUMNS = {"regime", "scheme", "bits", "bits_per_element", "metric", "value", "seed", "path"}


def test_smoke_outputs_and_resume(tmp_path):
    out = str(tmp_path / "a")
    cfg = AblationConfig.preset("smoke", out, progress=False)
    paths = run_ablation(cfg)
    df = pd.read_parquet(paths["ablation"])
    assert COLUMNS <= set(df.columns)
    assert set(df.path) == {"oracle", "production"} and df.seed.nunique() == 6
    assert set(df.scheme) == {"plain", "tq_kv", "tq_qkv"} and set(df.bits) == {2, 4}
    ks = pd.read_parquet(paths["ks"])
    assert {"kind", "D", "p", "p_adj", "verdict"} <= set(ks.columns) and len(ks)
    rep = open(build_report(out)).read()  # what `oscar ablate` does after the tables
    assert "Recommendation" in rep and "Non-dominated" in rep and "findings" in rep
    for png in ("jensen.png", "deff.png", "error_vs_bits.png"):
        assert os.path.getsize(os.path.join(out, png)) > 1000

    # interrupted run: drop two parts and re-run -> only those are recomputed, same table
    parts = sorted(os.listdir(os.path.join(out, "parts")))
    for p in parts[:2]:
        os.remove(os.path.join(out, "parts", p))
    run_ablation(AblationConfig.preset("smoke", out, progress=False))
    assert json.load(open(os.path.join(out, "run.json")))["resumed_units"] == len(parts) - 2
    pd.testing.assert_frame_equal(pd.read_parquet(paths["ablation"]), df)

    # same DIR, different config: refused, nothing lost
    with pytest.raises(OscarError, match="different config"):
        run_ablation(AblationConfig.preset("smoke", out, seeds=3, progress=False))
    assert len(os.listdir(os.path.join(out, "parts"))) == len(parts)


def test_bad_config():
    with pytest.raises(OscarError, match="unknown regime"):
        AblationConfig(out="x", regimes=["gauss"])
    with pytest.raises(OscarError, match="unknown scheme"):
        AblationConfig(out="x", schemes=["zip"])
    with pytest.raises(OscarError, match="store"):
        AblationConfig(out="x", regimes=["real"])
    with pytest.raises(OscarError, match="bits"):
        AblationConfig(out="x", bits=[1])
    with pytest.raises(OscarError, match="seeds"):
        AblationConfig(out="x", seeds=1)


def test_real_regime_through_ablation(tmp_path):
    from helpers.stores import write_reservoir_store

    store = write_reservoir_store(tmp_path / "s.zarr", D=32, R=128)
    cfg = AblationConfig.preset("smoke", str(tmp_path / "r"), regimes=["isotropic"], seeds=2, progress=False,
                                data=RegimeConfig(store=store), deff_regimes=[])
    df = pd.read_parquet(run_ablation(cfg)["ablation"])
    assert "real" in set(df.regime)


def test_cli_bad_store(tmp_path):
    r = subprocess.run([sys.executable, "-m", "oscar", "ablate", "--smoke", "--out", str(tmp_path / "o"), "--store",
                        str(tmp_path / "missing.zarr")], capture_output=True, text=True)
    assert r.returncode == 2 and "no such path" in r.stderr


@pytest.mark.slow
@pytest.mark.full
def test_quick_cli_end_to_end(tmp_path):
    out = tmp_path / "q"
    r = subprocess.run([sys.executable, "-m", "oscar", "ablate", "--quick", "--out", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    df = pd.read_parquet(out / "ablation.parquet")
    assert COLUMNS <= set(df.columns) and df.seed.nunique() == 30
    assert len(pd.read_parquet(out / "ks.parquet"))
    assert (out / "report.md").stat().st_size > 2000


def test_triton_serving_cache_path(tmp_path, monkeypatch):
    # the uniform-grid schemes through the paged cache's Triton quantizer (interpreter on CPU)
    monkeypatch.delenv("OSCAR_KERNELS", raising=False)
    cfg = AblationConfig.preset("smoke", str(tmp_path / "t"), schemes=["plain", "oscar", "tq_kv"], regimes=["isotropic"],
                                seeds=2, triton_seeds=2, bits=[2], progress=False, deff_regimes=[])
    df = pd.read_parquet(run_ablation(cfg)["ablation"])
    assert "OSCAR_KERNELS" not in os.environ  # restored
    t = df[df.path == "triton"]
    assert set(t.scheme) == {"plain", "oscar"} and t.seed.nunique() == 2
    x = df[df.scheme.isin(["plain", "oscar"])].pivot_table(index=["scheme", "seed", "metric"], columns="path", values="value")
    # same float32 arithmetic and rounding rule as the torch production path
    assert (x.triton - x.production).abs().max() < 1e-5
    assert (t.bits_per_element == 2 + 32 / 32).all()
    ks = pd.read_parquet(tmp_path / "t" / "ks.parquet")
    assert (ks.b.str.endswith(":triton")).any()
