"""Intervals, paired tests and three-valued verdicts for model-level figures (numpy only).

- `wilson`: 95 % score interval of a binomial proportion (a needle cell of 0/1 samples).
- `bootstrap_mean`: percentile bootstrap of a mean over samples (fractional scores).
- `newcombe_paired`: interval of the paired difference p1 - p2 of two 0/1 scores on the same
  samples (Newcombe 1998, method 10: Wilson limits combined with the phi correlation); it stays
  honest when no pair disagrees (20/20 vs 20/20 -> about +-16 points, not [0, 0]).
- `mcnemar_exact`: exact two-sided McNemar test (binomial on the discordant pairs).
- `signflip_test`: paired sign-flip randomization test for fractional scores.
- `paired_bootstrap_diff`: percentile bootstrap of a paired mean difference.
- `ratio_bootstrap`: perplexity ratio exp(sum(nll_a - nll_b) / sum(count)) paired by block,
  expanded-percentile bootstrap (Hesterberg 2015: percentiles widened by sqrt(n/(n-1)) and t
  quantiles, so 8 blocks cover close to 95 % instead of the plain percentile's ~88 %).
- `verdict`, `combine`: PASS / MISSED / UNRESOLVED against a threshold. How many samples would resolve an
  UNRESOLVED one: `resolve_n_paired` / `resolve_n_wilson` for 0/1 scores (the observed table or proportion
  held, the interval recomputed at n'), `resolve_n` otherwise (width ~ 1/sqrt(n), estimate held fixed).

Every random draw uses a fixed seed: the same files give the same report.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
from scipy.stats import norm, t

Z95 = 1.959963984540054
PASS, MISSED, UNRESOLVED = "PASS", "MISSED", "UNRESOLVED"
BOOT = 4000  # bootstrap resamples
SEED = 0


def _z(level: float) -> float:
    return NormalDist().inv_cdf(0.5 + level / 2)


def wilson(k: float, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of k successes in n trials, as proportions in [0, 1]."""
    if n <= 0:
        return float("nan"), float("nan")
    z = Z95 if level == 0.95 else _z(level)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def _boot_idx(n: int, b: int = BOOT, seed: int = SEED) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(b, n))  # (b, n)


def bootstrap_mean(x, level: float = 0.95, b: int = BOOT, seed: int = SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(x)."""
    x = np.asarray(x, float)
    if len(x) < 2:
        return float("nan"), float("nan")
    m = x[_boot_idx(len(x), b, seed)].mean(1)
    a = (1 - level) / 2
    return float(np.quantile(m, a)), float(np.quantile(m, 1 - a))


def paired_bootstrap_diff(x, y, level: float = 0.95, b: int = BOOT, seed: int = SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(x - y), x and y scored on the same samples."""
    return bootstrap_mean(np.asarray(x, float) - np.asarray(y, float), level, b, seed)


def is_binary(x) -> bool:
    x = np.asarray(x, float)
    return bool(np.all((x == 0) | (x == 1)))


def newcombe_paired(x, y, level: float = 0.95) -> tuple[float, float]:
    """Interval of mean(x) - mean(y) for paired 0/1 scores (Newcombe's method 10)."""
    x, y = np.asarray(x, bool), np.asarray(y, bool)
    if len(x) == 0:
        return float("nan"), float("nan")
    return newcombe_counts(*_pair_counts(x, y), level)


def _pair_counts(x: np.ndarray, y: np.ndarray) -> tuple[int, int, int, int]:
    """(both 1, only x, only y, both 0) of two paired bool arrays."""
    return int(np.sum(x & y)), int(np.sum(x & ~y)), int(np.sum(~x & y)), int(np.sum(~x & ~y))


def newcombe_counts(a: float, b: float, c: float, d: float, level: float = 0.95) -> tuple[float, float]:
    """Newcombe's method 10 from the 2x2 table of paired 0/1 scores: a both 1, b only the first, c only the
    second, d both 0. Counts may be fractional: `resolve_n_paired` evaluates the table projected to more pairs."""
    n = a + b + c + d
    if n <= 0:
        return float("nan"), float("nan")
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, level)
    l2, u2 = wilson(a + c, n, level)
    den = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(den) if den > 0 else 0.0
    dl = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    du = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return max(-1.0, p1 - p2 - dl), min(1.0, p1 - p2 + du)


def mcnemar_exact(x, y) -> float:
    """Two-sided exact McNemar p-value for paired 0/1 scores: binomial(b + c, 1/2) on the discordant pairs."""
    x, y = np.asarray(x, bool), np.asarray(y, bool)
    b, c = int(np.sum(x & ~y)), int(np.sum(~x & y))
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return float(min(1.0, 2 * tail))


def signflip_test(x, y, b: int = 20000, seed: int = SEED) -> float:
    """Two-sided paired randomization p-value of mean(x - y) = 0 (exact enumeration up to 16 pairs)."""
    d = np.asarray(x, float) - np.asarray(y, float)
    d = d[d != 0]
    n = len(d)
    if n == 0:
        return 1.0
    obs = abs(d.sum())
    if n <= 16:
        signs = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)  # (2^n, n)
    else:
        signs = np.random.default_rng(seed).choice([-1, 1], size=(b, n))
    s = np.abs(signs @ d)
    return float(np.mean(s >= obs - 1e-12))


def paired_test(x, y) -> float:
    """p-value of 'x and y differ' on the same samples: exact McNemar for 0/1 scores, sign-flip otherwise."""
    return mcnemar_exact(x, y) if is_binary(x) and is_binary(y) else signflip_test(x, y)


def ratio_bootstrap(nll_a, nll_b, count, level: float = 0.95, b: int = BOOT, seed: int = SEED) -> tuple[float, float, float]:
    """(ratio, lo, hi): exp(sum(nll_a - nll_b) / sum(count)) paired by block, expanded-percentile bootstrap.

    nll_a, nll_b: summed NLL of each block under the two methods (same tokens); count: tokens per block.
    Fewer than 2 blocks: no interval (nan).
    """
    na, nb, cnt = (np.asarray(v, float) for v in (nll_a, nll_b, count))
    n = len(cnt)
    r = float(math.exp((na.sum() - nb.sum()) / cnt.sum())) if n else float("nan")
    if n < 2:
        return r, float("nan"), float("nan")

    idx = _boot_idx(n, b, seed)  # (b, n)
    lr = ((na - nb)[idx].sum(1)) / cnt[idx].sum(1)  # (b,) log ratio per resample
    a = (1 - level) / 2
    a = float(norm.cdf(math.sqrt(n / (n - 1)) * t.ppf(a, n - 1)))  # expanded percentile
    return r, float(math.exp(np.quantile(lr, a))), float(math.exp(np.quantile(lr, 1 - a)))


# ----------------------------------------------------------------- verdicts


def verdict(lo: float, hi: float, threshold: float, better: str) -> str:
    """PASS when [lo, hi] clears `threshold` on the `better` side ("above": >=, "below": <=),
    MISSED when it lies wholly on the other side, UNRESOLVED when it straddles (or is unknown)."""
    if better not in ("above", "below"):
        raise ValueError(f"better must be 'above' or 'below', got {better!r}")
    if lo != lo or hi != hi:
        return UNRESOLVED
    if better == "above":
        return PASS if lo >= threshold else MISSED if hi < threshold else UNRESOLVED
    return PASS if hi <= threshold else MISSED if lo > threshold else UNRESOLVED


def combine(cell_verdicts: list[str], missed_adjusted: list[str] | None = None) -> str:
    """Verdict of 'every cell meets the threshold' from per-cell verdicts.

    PASS needs every cell's 95 % interval to clear (an intersection-union test: valid at 5 % with
    no multiplicity correction). MISSED needs one cell beyond the threshold after correction for
    the number of cells: `missed_adjusted` are the cell verdicts from (1 - 0.05/m) intervals
    (Holm's first step, which is all 'at least one cell misses' needs). Otherwise UNRESOLVED.
    """
    if not cell_verdicts:
        return UNRESOLVED
    if all(v == PASS for v in cell_verdicts):
        return PASS
    if any(v == MISSED for v in (missed_adjusted if missed_adjusted is not None else cell_verdicts)):
        return MISSED
    return UNRESOLVED


def resolve_n(est: float, lo: float, hi: float, threshold: float, n: int) -> int | None:
    """Samples (or blocks) that would resolve an interval straddling `threshold`: the half-width on
    the threshold's side shrinks as sqrt(n / n'), the estimate held fixed. None: estimate on the threshold."""
    if est != est or lo != lo or hi != hi or n < 1:
        return None
    gap = abs(est - threshold)
    half = (est - lo) if threshold < est else (hi - est)
    if gap <= 0 or half <= 0:
        return None
    return max(n + 1, int(math.ceil(n * (half / gap) ** 2)))


def _resolve_projected(interval_at, est: float, threshold: float, n: int, cap: int = 10 ** 7) -> int | None:
    """Smallest n' > n at which interval_at(n') lies wholly on est's side of `threshold` (PASS or MISSED
    alike); interval_at holds the observed proportions, so only n' changes. None: est on the threshold, or
    not resolved below `cap`. Exponential search, then bisection (the interval narrows as n' grows)."""
    if est != est or est == threshold or n < 1:
        return None

    def clear(m: int) -> bool:
        lo, hi = interval_at(m)
        return lo >= threshold if est > threshold else hi < threshold

    lo, hi = n, 2 * n
    while not clear(hi):
        if hi >= cap:
            return None
        lo, hi = hi, min(cap, 2 * hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if clear(mid) else (mid, hi)
    return hi


def resolve_n_paired(x, y, threshold: float, level: float = 0.95) -> int | None:
    """Pairs that would resolve the Newcombe interval of paired 0/1 scores straddling `threshold` (a
    proportion): the observed 2x2 table scaled to n' pairs. Near 0 or 100 % the interval narrows like 1/n',
    not 1/sqrt(n'): `resolve_n`'s rule asked 20 pairs of 20/20 vs 20/20 for ~1300 where ~190 resolve -2
    points at 95 %."""
    x, y = np.asarray(x, bool), np.asarray(y, bool)
    n = len(x)
    if n == 0:
        return None
    f = np.array(_pair_counts(x, y), float) / n
    return _resolve_projected(lambda m: newcombe_counts(*(f * m), level), float(np.mean(x) - np.mean(y)), threshold, n)


def resolve_n_wilson(k: float, n: int, threshold: float, level: float = 0.95) -> int | None:
    """Samples that would resolve the Wilson interval of k successes in n straddling `threshold` (a
    proportion), the observed proportion held."""
    if n < 1:
        return None
    return _resolve_projected(lambda m: wilson(k / n * m, m, level), k / n, threshold, n)


# ----------------------------------------------------------------------------- multiple testing

def holm(p) -> np.ndarray:
    """Holm–Bonferroni adjusted p-values (family-wise error control)."""
    p = np.asarray(p, float)
    n = len(p)
    o = np.argsort(p)
    adj = np.maximum.accumulate((n - np.arange(n)) * p[o])
    out = np.empty(n)
    out[o] = np.minimum(adj, 1.0)
    return out


def bh(p) -> np.ndarray:
    """Benjamini–Hochberg adjusted p-values (false discovery rate control)."""
    p = np.asarray(p, float)
    n = len(p)
    o = np.argsort(p)
    adj = np.minimum.accumulate((n / np.arange(n, 0, -1) * p[o][::-1]))[::-1]
    out = np.empty(n)
    out[o] = np.minimum(adj, 1.0)
    return out
