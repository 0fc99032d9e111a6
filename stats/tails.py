"""Heavy-tail diagnostics: Hill tail index on reservoir rows (kurtosis from the stored power sums:
oscar.pipeline.store.excess_kurtosis)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def hill(x: np.ndarray, frac: float = 0.05, k_min: int = 10) -> float:
    """Hill estimate of the tail index α of positive samples x (upper tail, top frac of the sample)."""
    x = np.sort(np.asarray(x, dtype=np.float64)[np.asarray(x) > 0])[::-1]
    k = max(k_min, int(frac * len(x)))
    if len(x) <= k + 1:
        return float("nan")
    logs = np.log(x[:k]) - np.log(x[k])
    m = logs.mean()
    return float(1.0 / m) if m > 0 else float("inf")


def row_tail_index(rows: np.ndarray, frac: float = 0.05) -> float:
    """Tail index of the norms of centred rows (n, D): ν for a multivariate Student-t."""
    r = rows - rows.mean(0)
    return hill(np.linalg.norm(r, axis=1), frac)


@dataclass
class TailDiag:
    kurtosis: float  # median over channels of the excess kurtosis
    kurtosis_max: float
    alpha: float  # Hill tail index of row norms (nan without reservoir rows)
    heavy: bool


def tail_diag(kurt: np.ndarray, rows: np.ndarray | None, kurt_max: float = 3.0, alpha_max: float = 4.0) -> TailDiag:
    """Heavy when the median channel excess kurtosis > kurt_max or the tail index < alpha_max
    (α < 4: the fourth moment, hence the sample covariance's variance, is infinite)."""
    a = row_tail_index(rows) if rows is not None and len(rows) >= 50 else float("nan")
    km = float(np.median(kurt))
    heavy = bool(km > kurt_max or (np.isfinite(a) and a < alpha_max))
    return TailDiag(kurtosis=km, kurtosis_max=float(np.max(kurt)), alpha=a, heavy=heavy)
