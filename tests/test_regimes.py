"""Each regime's data matches its specification; the real regime reads a store's reservoirs."""

import dataclasses

import numpy as np
import pytest

from oscar.common import OscarError
from helpers.stores import write_reservoir_store
from oscar.validate.ablation.regimes import REGIMES, RegimeConfig, excess_kurtosis, make_regime, measure

CFG = RegimeConfig(D=64, n_calib=4096, n_test=512, n_query=32)


@pytest.mark.parametrize("name", [r for r in REGIMES if r != "real"])
def test_shapes_and_determinism(name):
    c = RegimeConfig(D=32, n_calib=256, n_test=64, n_query=8)
    a, b = make_regime(name, c, 7), make_regime(name, c, 7)
    assert a.calib["k"].shape == (256, 32) and a.test["k"].shape == (64, 32) and a.test["q"].shape == (8, 32)
    for part in ("calib", "test"):
        for n in "qkv":
            np.testing.assert_array_equal(getattr(a, part)[n], getattr(b, part)[n])
    assert not np.allclose(a.calib["q"][: 64], a.calib["k"][: 64])  # never Q = K
    assert not np.array_equal(make_regime(name, c, 8).calib["k"], a.calib["k"])


def test_isotropic_spec():
    m = measure(make_regime("isotropic", CFG, 0))
    assert abs(m["excess_kurtosis"]) < 0.1
    assert m["cond"] < 2.0  # Marchenko–Pastur edge ratio at N/D = 72 is ~1.6


@pytest.mark.parametrize("nu,tol", [(12.0, 0.3), (20.0, 0.2)])
def test_heavy_kurtosis_matches_student_t(nu, tol):
    r = make_regime("heavy", dataclasses.replace(CFG, nu=nu), 0)
    assert r.spec["excess_kurtosis"] == pytest.approx(6 / (nu - 4))
    assert measure(r)["excess_kurtosis"] == pytest.approx(6 / (nu - 4), abs=tol)


def test_heavy_default_is_heavier_than_gaussian():
    r = make_regime("heavy", CFG, 0)
    assert r.spec["excess_kurtosis"] == float("inf")
    assert measure(r)["excess_kurtosis"] > 3.0
    with pytest.raises(ValueError, match="nu > 2"):
        make_regime("heavy", dataclasses.replace(CFG, nu=2.0), 0)


@pytest.mark.parametrize("rank", [4, 8, 13])
def test_lowrank_rank(rank):
    r = make_regime("lowrank", dataclasses.replace(CFG, rank=rank), 0)
    assert measure(r)["rank"] == rank


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
def test_powerlaw_slope(alpha):
    r = make_regime("powerlaw", dataclasses.replace(CFG, alpha=alpha), 0)
    assert measure(r)["alpha"] == pytest.approx(alpha, abs=0.15 * alpha + 0.05)


def test_kv_alignment_angle():
    assert measure(make_regime("kv_aligned", CFG, 0))["angle_deg"] < 5.0
    assert measure(make_regime("kv_misaligned", CFG, 0))["angle_deg"] > 85.0


@pytest.mark.parametrize("factor", [10.0, 30.0, 100.0])
def test_outlier_ratio(factor):
    r = make_regime("outliers", dataclasses.replace(CFG, outlier_factor=factor), 0)
    assert len(r.extra["channels"]) == CFG.n_outliers
    assert measure(r)["outlier_ratio"] == pytest.approx(factor, rel=0.1)


@pytest.mark.parametrize("deg", [20.0, 45.0, 70.0])
def test_shift_angle(deg):
    r = make_regime("shift", dataclasses.replace(CFG, shift_deg=deg), 0)
    assert measure(r)["angle_deg"] == pytest.approx(deg, abs=6.0)


def test_excess_kurtosis_brute_force():
    x = np.random.default_rng(0).standard_normal((50, 3))
    for j in range(3):
        c = x[:, j] - x[:, j].mean()
        assert excess_kurtosis(x)[j] == pytest.approx(np.mean(c**4) / np.mean(c**2) ** 2 - 3)


# ----------------------------------------------------------------------------- real regime

def test_real_regime_reads_reservoirs(tmp_path):
    p = write_reservoir_store(tmp_path / "s.zarr")
    r = make_regime("real", RegimeConfig(store=p, layer=1, head=1, n_test=64, n_query=16), 0)
    assert r.calib["k"].shape == (96 + 86, 16) and r.test["k"].shape == (64, 16) and r.test["q"].shape == (16, 16)
    # queries are the store's q rows (scale 3), not keys (scale 1)
    assert r.test["q"].std() == pytest.approx(3.0, rel=0.2) and r.test["k"].std() == pytest.approx(1.0, rel=0.2)
    assert r.spec["layer"] == 1


def test_real_regime_bad_stores(tmp_path):
    with pytest.raises(ValueError, match="store"):
        make_regime("real", RegimeConfig(), 0)
    p = write_reservoir_store(tmp_path / "s.zarr")
    with pytest.raises(OscarError, match="out of range"):
        make_regime("real", RegimeConfig(store=p, layer=5), 0)
    import zarr

    g = zarr.open_group(str(tmp_path / "other.zarr"), mode="w")
    g.attrs["format"] = "something/2"
    with pytest.raises(OscarError, match="format"):
        make_regime("real", RegimeConfig(store=str(tmp_path / "other.zarr")), 0)
    with pytest.raises(ValueError, match="unknown regime"):
        make_regime("gaussian", RegimeConfig(), 0)
