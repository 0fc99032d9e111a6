"""KS machinery against scipy and brute force; nominal size; power on a planted bias."""

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from oscar.validate.ablation.stattests import (adjust, bh, classify, gap_table, holm, kolmogorov_sf, ks_2samp, ks_statistic,
                                      ks_table, variance_ratio_test)


@pytest.mark.parametrize("n,m,shift", [(30, 30, 0.0), (30, 30, 0.7), (12, 12, 0.3), (30, 45, 0.4), (100, 37, 0.0)])
def test_ks_matches_scipy(n, m, shift):
    rng = np.random.default_rng(n * 100 + m)
    a, b = rng.standard_normal(n), rng.standard_normal(m) + shift
    d, p = ks_2samp(a, b)
    ref = stats.ks_2samp(a, b, method="exact" if n == m else "asymp")
    assert d == pytest.approx(ref.statistic, abs=1e-12)
    if n == m:
        assert p == pytest.approx(ref.pvalue, rel=1e-6)
    else:  # our asymptotic: the Kolmogorov limit at sqrt(nm/(n+m)) * D
        assert p == pytest.approx(stats.kstwobign.sf(np.sqrt(n * m / (n + m)) * d), rel=1e-6, abs=1e-12)


def test_ks_statistic_brute_force_with_ties():
    a = np.array([1.0, 2.0, 2.0, 3.0, 5.0])
    b = np.array([2.0, 2.0, 4.0, 4.0])
    grid = np.concatenate([a, b])
    brute = max(abs((a <= x).mean() - (b <= x).mean()) for x in grid)
    assert ks_statistic(a, b) == pytest.approx(brute)


def test_kolmogorov_sf_against_scipy():
    for x in (0.3, 0.5, 1.0, 1.36, 2.0):
        assert kolmogorov_sf(x) == pytest.approx(stats.kstwobign.sf(x), abs=1e-9)


def test_equal_distributions_rejected_at_most_nominal_rate():
    rng = np.random.default_rng(0)
    trials, alpha = 400, 0.05
    rej = sum(ks_2samp(rng.standard_t(3, 30), rng.standard_t(3, 30))[1] < alpha for _ in range(trials))
    # binomial upper bound: nominal + 2.5 sd
    assert rej / trials <= alpha + 2.5 * np.sqrt(alpha * (1 - alpha) / trials)


def test_planted_bias_detected():
    rng = np.random.default_rng(1)
    trials = 200
    rej = sum(ks_2samp(rng.standard_normal(30), rng.standard_normal(30) + 1.25)[1] < 0.05 for _ in range(trials))
    assert rej / trials > 0.9


def _brute_holm(p):
    n = len(p)
    o = np.argsort(p)
    out, run = np.empty(n), 0.0
    for i, j in enumerate(o):
        run = max(run, min(1.0, (n - i) * p[j]))
        out[j] = run
    return out


def _brute_bh(p):
    n = len(p)
    return np.array([min(1.0, min(n * p[j] / (np.sum(p <= p[j])) for j in range(n) if p[j] >= p[i])) for i in range(n)])


def test_multiple_testing_brute_force():
    rng = np.random.default_rng(2)
    for _ in range(20):
        p = rng.uniform(0, 0.2, 12)
        np.testing.assert_allclose(holm(p), _brute_holm(p))
        np.testing.assert_allclose(bh(p), _brute_bh(p))
    with pytest.raises(ValueError, match="holm"):
        adjust([0.1], "bonferroni")


def _fake_rows(bias_scheme=None, n=30, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for sch in ("a", "b"):
        for s in range(n):
            x = rng.standard_normal()  # shared data per seed
            for path in ("oracle", "production"):
                v = x + 0.3 * rng.standard_normal() + (1.5 if (path == "production" and sch == bias_scheme) else 0.0)
                rows.append(dict(regime="r", scheme=sch, bits=2, metric="m", value=v, seed=s, path=path))
    return pd.DataFrame(rows)


def test_ks_table_classifies_planted_path_bias():
    t = ks_table(_fake_rows("b"), ["m"], pairs=[("a", "b")])
    path = t[t.kind == "path"].set_index("a")
    assert path.loc["b:oracle", "verdict"] == "systematic"
    assert path.loc["a:oracle", "verdict"] == "seed variance"
    assert (t.p_adj >= t.p).all()
    assert classify(0.01) == "systematic" and classify(0.2) == "seed variance"


def test_gap_variance_and_f_test():
    df = _fake_rows()
    g = gap_table(df, "m")
    assert set(g.scheme) == {"a", "b"} and (g.n == 30).all()
    rng = np.random.default_rng(3)
    r, p = variance_ratio_test(rng.standard_normal(40) * 3, rng.standard_normal(40))
    assert r > 3 and p < 1e-3
    r, p = variance_ratio_test(rng.standard_normal(40), rng.standard_normal(40))
    assert p > 0.01
