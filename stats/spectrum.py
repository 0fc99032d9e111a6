"""Eigendecompositions, effective dimension, spurious-eigenvalue pruning, subspace stability.

All float64. Conventions: eigenvalues in descending order, eigenvectors as the
*columns* of U (so ``C = U diag(w) Uᵀ``), each column's sign fixed so that its
largest-magnitude entry is positive (deterministic output across LAPACK builds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def eigh_desc(C: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Batched symmetric eigendecomposition (..., D, D) -> w (..., D) descending, U (..., D, D)."""
    # cannot be limited without extra packages and oversubscribes badly on a shared machine)

    C = 0.5 * (np.asarray(C, dtype=np.float64) + np.swapaxes(C, -1, -2))
    w, U = (t.numpy() for t in torch.linalg.eigh(torch.from_numpy(np.ascontiguousarray(C))))
    w, U = w[..., ::-1], U[..., :, ::-1]
    idx = np.abs(U).argmax(-2)[..., None, :]  # (..., 1, D) row of each column's largest entry
    sign = np.sign(np.take_along_axis(U, idx, -2))
    sign[sign == 0] = 1
    return w.copy(), U * sign


def gap_rank(w: np.ndarray, gap_min: float = 2.0, floor_rel: float = 1e-9) -> int:
    """Spectral-gap criterion: the k maximising λ_k / λ_{k+1}, if that ratio ≥ gap_min, else D.

    Eigenvalues below floor_rel · λ_1 are treated as floor_rel · λ_1 (an exactly
    rank-deficient matrix has an infinite gap at its rank, which is the right answer).
    """
    D = len(w)
    if D < 2 or w[0] <= 0:
        return D
    v = np.maximum(w, floor_rel * w[0])
    r = v[:-1] / v[1:]  # r[i] = λ_{i+1} / λ_{i+2} in 1-based terms -> candidate k = i + 1
    i = int(np.argmax(r))
    return i + 1 if r[i] >= gap_min else D


@dataclass
class SpectrumDiag:
    """What the fit learned about one covariance (one layer, one head)."""

    eigvals: np.ndarray  # (D,) after pruning, descending
    d_eff: int
    d_gap_raw: int  # gap criterion before pruning
    pruned: list[int] = field(default_factory=list)  # raw indices (0-based) of pruned eigenvalues
    stability: float = float("nan")  # median over blocks of mean cos² of principal angles (1 = identical)
    max_angle_deg: float = float("nan")  # median over blocks of the largest principal angle
    k_stab: int = 0  # subspace dimension the stability was measured on


def block_support(U: np.ndarray, w: np.ndarray, block_covs: np.ndarray) -> np.ndarray:
    """Median over blocks of the Rayleigh quotient u_iᵀ C_b u_i, per eigenvector (D,)."""
    rq = ((block_covs @ U) * U).sum(-2)  # (B, D): u_iᵀ C_b u_i
    return np.median(rq, axis=0)


def prune_spurious(w: np.ndarray, U: np.ndarray, block_covs: np.ndarray | None, k: int,
                   support_min: float = 0.5) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Among the leading k eigenpairs, an eigenvalue whose direction is not supported by the
    typical block (median Rayleigh quotient over blocks < support_min · λ) is spurious:
    its eigenvalue is replaced by that median and the pairs are re-sorted."""
    if block_covs is None or len(block_covs) < 3:
        return w, U, []
    med = block_support(U, w, block_covs)
    bad = [i for i in range(k) if w[i] > 0 and med[i] < support_min * w[i]]
    if not bad:
        return w, U, []
    w2 = w.copy()
    w2[bad] = med[bad]
    order = np.argsort(-w2, kind="stable")
    return w2[order], U[:, order], bad


def principal_cos2(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """cos² of the principal angles between the column spaces of orthonormal A (D, k), B (D, k)."""
    s = np.linalg.svd(A.T @ B, compute_uv=False)
    return np.clip(s, 0, 1) ** 2


def stability(U: np.ndarray, k: int, block_covs: np.ndarray | None) -> tuple[float, float]:
    """Agreement of the leading-k subspace of U with each block's own leading-k subspace.

    Returns (median over blocks of mean cos², median over blocks of the largest angle in degrees).
    """
    if block_covs is None or len(block_covs) < 2 or k < 1:
        return float("nan"), float("nan")
    _, Ub = eigh_desc(block_covs)  # (B, D, D)
    c2 = np.stack([principal_cos2(U[:, :k], Ub[b][:, :k]) for b in range(len(Ub))])  # (B, k)
    ang = np.degrees(np.arccos(np.sqrt(c2.min(1))))
    return float(np.median(c2.mean(1))), float(np.median(ang))


def analyse(C: np.ndarray, block_covs: np.ndarray | None, gap_min: float = 2.0,
            support_min: float = 0.5) -> tuple[np.ndarray, SpectrumDiag]:
    """Eigendecompose C (D, D): prune spurious leading eigenvalues, d_eff by spectral gap,
    stability of the leading subspace across blocks. Returns (U (D, D) columns desc, diag)."""
    w, U = eigh_desc(C)
    D = len(w)
    k_raw = gap_rank(w, gap_min)
    w, U, bad = prune_spurious(w, U, block_covs, min(k_raw, D), support_min)
    k = gap_rank(w, gap_min) if bad else k_raw
    k_stab = k if k < D else max(1, D // 4)  # no gap: check the top quarter
    st, ang = stability(U, k_stab, block_covs)
    return U, SpectrumDiag(eigvals=w, d_eff=k, d_gap_raw=k_raw, pruned=bad, stability=st, max_angle_deg=ang, k_stab=k_stab)
