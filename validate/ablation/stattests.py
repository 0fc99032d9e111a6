"""Statistical validation (seed 004): KS tests, multiple-testing control, classification,
oracle vs production gap variance, and the d_eff vs calibration-budget study.

The two paths of every scheme (validate/ablation/schemes.py `Ctx`):
- oracle: numpy PCG64 randomness, float64 arithmetic;
- production: torch's MT19937 generator, float32 arithmetic.
- triton (opt-in, `triton_seeds`): production's RNG and precision, with the uniform-grid
  schemes round-tripped through the serving cache (`oscar.kernels.paged`), whose page
  quantizer is the Triton kernel (the CPU interpreter when there is no GPU).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import torch
from scipy.stats import f

from oscar.validate.intervals import bh, holm  # one home for the multiple-testing corrections (the leaf the verdicts use)
from oscar.validate.ablation.metrics import compute_metrics
from oscar.validate.ablation.regimes import make_regime
from oscar.validate.ablation.schemes import Ctx, SQCodec, d_eff_energy, d_eff_gap


# ----------------------------------------------------------------------------- KS

def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """sup_x |F_a(x) - F_b(x)| over the pooled sample (ties handled by right-continuous ECDFs)."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    x = np.concatenate([a, b])
    fa = np.searchsorted(a, x, side="right") / len(a)
    fb = np.searchsorted(b, x, side="right") / len(b)
    return float(np.abs(fa - fb).max())


def kolmogorov_sf(x: float) -> float:
    """P(K > x) for the Kolmogorov distribution: 2 sum_{j>=1} (-1)^(j-1) exp(-2 j^2 x^2)."""
    if x <= 0:
        return 1.0
    if x < 0.2:  # the alternating series converges slowly; the CDF is ~0 there
        return 1.0
    j = np.arange(1, 101)
    return float(min(1.0, max(0.0, 2 * np.sum((-1.0) ** (j - 1) * np.exp(-2 * j**2 * x * x)))))


def _exact_equal_n(n: int, d: float) -> float:
    """P(D_{n,n} >= d) exactly (Gnedenko–Korolyuk): 2 sum_j (-1)^(j+1) C(2n, n-jc) / C(2n, n), c = ceil(n d)."""
    c = math.ceil(n * d - 1e-9)
    if c <= 0:
        return 1.0
    tot = math.comb(2 * n, n)
    s = 0
    for j in range(1, n // c + 1):
        s += (-1) ** (j + 1) * math.comb(2 * n, n - j * c)
    return float(min(1.0, 2 * s / tot))


def ks_2samp(a, b) -> tuple[float, float]:
    """Two-sided two-sample KS: (D, p). Exact for equal sizes, asymptotic otherwise."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) == 0 or len(b) == 0:
        raise ValueError("ks_2samp needs two non-empty samples")
    d = ks_statistic(a, b)
    n, m = len(a), len(b)
    if n == m:
        return d, _exact_equal_n(n, d)
    en = math.sqrt(n * m / (n + m))
    return d, kolmogorov_sf(en * d)


# ----------------------------------------------------------------------------- multiple testing
# holm / bh live in oscar.validate.intervals (imported above), beside the verdict intervals that use them.

def adjust(p, method: str = "holm") -> np.ndarray:
    if method not in ("holm", "bh"):
        raise ValueError(f"multiple-testing method must be 'holm' or 'bh', got {method!r}")
    return holm(p) if method == "holm" else bh(p)


def classify(p_adj: float, alpha: float = 0.05) -> str:
    """A difference is 'systematic' when the adjusted KS p-value rejects, else 'seed variance'."""
    return "systematic" if p_adj < alpha else "seed variance"


# ----------------------------------------------------------------------------- tables from ablation rows

def ks_table(df, metrics: list[str], alpha: float = 0.05, method: str = "holm", pairs: list[tuple[str, str]] | None = None):
    """KS tests over seeds.

    kind="path": oracle vs production of the same (regime, scheme, bits, metric).
    kind="scheme": scheme a vs scheme b (production path) for the given pairs.
    One multiple-testing family per kind.
    """
    rows = []
    d = df[df.metric.isin(metrics)]
    for (reg, sch, bits, met), g in d.groupby(["regime", "scheme", "bits", "metric"]):
        o = g[g.path == "oracle"].value.to_numpy()
        for other in ("production", "triton"):
            p = g[g.path == other].value.to_numpy()
            if len(o) and len(p):
                D, pv = ks_2samp(o, p)
                rows.append(dict(kind="path", regime=reg, bits=bits, metric=met, a=f"{sch}:oracle", b=f"{sch}:{other}",
                                 n_a=len(o), n_b=len(p), mean_a=o.mean(), mean_b=p.mean(), D=D, p=pv))
    prod = d[d.path == "production"]
    for sa, sb in pairs or []:
        for (reg, bits, met), g in prod.groupby(["regime", "bits", "metric"]):
            a, b = g[g.scheme == sa].value.to_numpy(), g[g.scheme == sb].value.to_numpy()
            if len(a) and len(b):
                D, pv = ks_2samp(a, b)
                rows.append(dict(kind="scheme", regime=reg, bits=bits, metric=met, a=sa, b=sb,
                                 n_a=len(a), n_b=len(b), mean_a=a.mean(), mean_b=b.mean(), D=D, p=pv))
    t = pd.DataFrame(rows)
    if t.empty:
        return t
    t["p_adj"] = np.nan
    for kind, idx in t.groupby("kind").groups.items():
        t.loc[idx, "p_adj"] = adjust(t.loc[idx, "p"].to_numpy(), method)
    t["verdict"] = [classify(p, alpha) for p in t.p_adj]
    return t


def gap_table(df, metric: str = "relmse_o"):
    """Per (regime, scheme, bits): variance over seeds of the oracle - production gap on
    the same data (seed 004: the K-path QJL gap variance is the Jensen signature)."""
    d = df[(df.metric == metric)].pivot_table(index=["regime", "scheme", "bits", "seed"], columns="path", values="value")
    if not {"oracle", "production"} <= set(d.columns):
        return pd.DataFrame()
    gap = (d["oracle"] - d["production"]).rename("gap").reset_index()
    return gap.groupby(["regime", "scheme", "bits"]).gap.agg(gap_var="var", gap_mean="mean", n="count").reset_index()


def variance_ratio_test(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """F test for var(x) > var(y): (ratio, one-sided p)."""
    vx, vy = np.var(x, ddof=1), np.var(y, ddof=1)
    r = vx / max(vy, 1e-300)
    return float(r), float(f.sf(r, len(x) - 1, len(y) - 1))


# ----------------------------------------------------------------------------- d_eff study

def deff_study(regimes: list[str], budgets: list[int], seeds: int, cfg, gap: float = 4.0):
    """d_eff (spectral-gap and 95%-energy definitions) vs the number of calibration
    tokens, against the regime's true rank where it has one; plus the output cosine of
    SQU-KV using each definition (a spurious eigenvalue shows up as a collapse)."""
    rows = []
    for reg in regimes:
        for n in budgets:
            for s in range(seeds):
                r = make_regime(reg, dataclasses.replace(cfg, n_calib=n), s)
                lam = np.linalg.eigvalsh(np.cov(r.calib["k"].T))[::-1]
                base = dict(regime=reg, n_calib=n, seed=s, true_rank=r.spec.get("rank", np.nan))
                rows.append(dict(base, metric="d_eff_gap", value=d_eff_gap(lam, gap)))
                rows.append(dict(base, metric="d_eff_energy", value=d_eff_energy(lam)))
                cal = {x: torch.from_numpy(r.calib[x]) for x in "qkv"}
                te = {x: torch.from_numpy(r.test[x]) for x in "qkv"}
                for rule in ("gap", "energy"):
                    ctx = Ctx("oracle", s)
                    kc = SQCodec(2, "uniform", deff=rule, gap=gap).fit(cal, "k", ctx)
                    vc = SQCodec(2, "uniform", deff=rule, gap=gap).fit(cal, "v", ctx)
                    m = compute_metrics(te["q"], te["k"], te["v"], kc.roundtrip(te["k"])[0], vc.roundtrip(te["v"])[0])
                    rows.append(dict(base, metric=f"cos_o_{rule}", value=m["cos_o"]))
    return pd.DataFrame(rows)
