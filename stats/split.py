"""Split keys: a 3-bit and a 2-bit part of the rotated key, placed by C_Q.

The `scaled` variant spends the key budget continuously (directions stretched by (λ_i/σ_i²)^¼, then
one Hadamard mixes everything into one per-token INT2 group). The `split` format instead cuts the query
eigenbasis U in two: the key_split = D/4 directions that matter most get one bit more, each part is
scaled and Hadamard-mixed within itself (`split_scaled_rotation`) and stored as its own
per-token min/max group (QuantConfig.key_split; the cache: docs/cache-format.md). "Matter most" is
decided per layer on the calibration rows, between the largest λ_i (C_Q's eigenvalues, the first
rule) and the largest λ_i σ_i² (a direction's share of the logit error at equal noise), by the fit's
key objective (stats/clip.py) with each part's clip searched for each candidate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from oscar.quant import QuantSpec, fake_quant, fake_quant_parts
from oscar.stats.clip import choose, refine
from oscar.stats.rotations import importance_scales, mixer

SPLIT_RULES = ("lambda", "lambda*sigma2")

Parts = list[tuple[int, int, QuantSpec]]  # QuantConfig.key_parts: channels [a, b) of the rotated key, their grid


def split_scaled_rotation(U: np.ndarray, lam: np.ndarray, sig2: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The scaled variant per part, for a cache that stores two parts of a key at different widths.

    U (D, D) query eigenvectors (columns), lam / sig2 (D,) as `rotations.importance_scales`; hi: indices of the
    directions of the first (wider) part, the rest the second (`parts_rotation`)."""
    D = U.shape[-1]
    hi = np.asarray(hi, dtype=np.int64)
    return parts_rotation(U, lam, sig2, [np.sort(hi), np.setdiff1d(np.arange(D), hi)], stored=2)


def parts_rotation(U: np.ndarray, lam: np.ndarray, sig2: np.ndarray, groups: list[np.ndarray],
                   stored: int) -> tuple[np.ndarray, np.ndarray]:
    """The scaled variant per part: groups (a partition of range(D), each ascending = U's order) fill the
    rotated channels in turn; the first `stored` are parts of the cache, the others are not stored (their
    directions read as the key mean: unscaled, unmixed). Each stored part p gets
    U_p diag(d_p) H_p P_br with d_p from `rotations.importance_scales` over the part alone, so each part's
    quantization noise is white and weighted as in `scaled`; H_p mixes only inside its part, so a
    rotated coordinate belongs to one part. Returns (R_K, R_Q) (D, D), R_Q = R_K^{-T}: the blocks'
    U_p are orthogonal to each other and H_p is orthogonal, so (q R_Q)·(k R_K) = q·k.
    """
    D = U.shape[-1]
    # a non-positive variance is an estimation artefact (C_K - mu mu^T cancels under Qwen2.5's large key biases:
    # -97 along one u_i on a small store): it takes the whole head's floor before the cut, since a part's own mean
    # could then be <= 0 and `importance_scales` would floor nothing and give NaN scales; positive values keep the
    # per-part floors
    lam = np.where(lam > 0, lam, 1e-3 * max(lam.mean(), 1e-30))
    sig2 = np.where(sig2 > 0, sig2, 1e-3 * max(sig2.mean(), 1e-30))
    rk, rq = np.zeros((D, D)), np.zeros((D, D))
    col = 0
    for j, idx in enumerate(groups):
        n = len(idx)
        if j >= stored:  # not stored: any orthonormal basis of these directions reads the same (as 0)
            rk[:, col:col + n] = rq[:, col:col + n] = U[:, idx]
            col += n
            continue
        d = importance_scales(lam[idx][None], sig2[idx][None])[0]  # (n,)
        M = mixer(n)  # raises HadamardUnsupported for a part size without a Hadamard
        rk[:, col:col + n] = (U[:, idx] * d) @ M
        rq[:, col:col + n] = (U[:, idx] / d) @ M
        col += n
    assert col == D, "groups must partition the D directions"
    return rk, rq


def part_view(clip: torch.Tensor, j: int) -> torch.Tensor:
    """Part j's clip ratios (Hkv,) of clip (Hkv, parts), broadcast onto (..., Hkv, T, 1 group)."""
    return clip[:, j].float().view(-1, 1, 1)


def split_fake_quant(y: torch.Tensor, parts: Parts, clip: torch.Tensor) -> torch.Tensor:
    """Split keys y (..., Hkv, T, D), rotated, round trip: part j under clip[:, j] (`oscar.quant.fake_quant_parts`)."""
    return fake_quant_parts(y, parts, [part_view(clip, j) for j in range(len(parts))])


def part_clips(kr: torch.Tensor, Cq: torch.Tensor, parts: Parts, ratios: np.ndarray,
               per_head_gain: float = 0.02) -> tuple[torch.Tensor, np.ndarray]:
    """Per part, the clip ratio(s) minimising the q-weighted logit MSE of that part alone (the fit's key objective,
    E[(k - k̂) C_Q (k - k̂)ᵀ] / E[k C_Q kᵀ] in the rotated basis), refined and chosen per layer or head as
    stats/clip.py does; then the joint error of both parts at those clips.

    kr (H, N, D) rotated centred keys, Cq (H, D, D) rotated query second moment (float64).
    Returns (clip (H, parts) float32, err (H,))."""
    den = ((kr @ Cq) * kr).sum((-1, -2)).clamp_min(1e-30)  # (H,)

    def err_of(e):  # e (H, N, D) error in the rotated space -> (H,) relative logit MSE
        return (((e @ Cq) * e).sum((-1, -2)) / den).numpy()

    clips = []
    for a, b, sp in parts:
        def part_err(cands, a=a, b=b, sp=sp):
            out = []
            for c in cands:
                e = torch.zeros_like(kr)
                e[..., a:b] = fake_quant(kr[..., a:b].contiguous(), sp, float(c)).to(kr.dtype) - kr[..., a:b]
                out.append(err_of(e))
            return np.stack(out)

        cands, errs = refine(part_err, ratios, float(ratios.min()), float(ratios.max()))
        clips.append(choose(errs, cands, per_head_gain, errs[-1]).clip)
    clip = torch.from_numpy(np.stack(clips, -1)).float()  # (H, parts)
    err = err_of(split_fake_quant(kr.float(), parts, clip).to(kr.dtype) - kr)
    return clip, err


@dataclass
class SplitFit:
    rule: str  # which of the rules placed the wide part
    rot_k: torch.Tensor  # (H, D, D) float64
    rot_q: torch.Tensor  # (H, D, D) = rot_k^{-T}
    clip: torch.Tensor  # (H, parts) searched ratios
    err: np.ndarray  # (H,) calibrated key objective at those clips
    errs: dict[str, float]  # every rule's summed error


def fit_split_keys(U: np.ndarray, lam: np.ndarray, sig2: np.ndarray, kc: torch.Tensor, Cq: np.ndarray, parts: Parts,
                   ratios: np.ndarray, rules: dict[str, np.ndarray] | None = None, per_head_gain: float = 0.02) -> SplitFit:
    """The split-key rotation and clips of one layer's H heads.

    U (H, D, D) query eigenvectors (columns, descending), lam / sig2 (H, D) the query energy and the centred key
    variance along them, kc (H, N, D) centred calibration keys, Cq (H, D, D) the query second moment (model space).
    For each rule (default SPLIT_RULES; {name: score (H, D)} for controls) the parts (consecutive, from channel 0)
    take the directions in descending score, part by part; channels after the last part are not stored (the
    lowest scores, QuantConfig.key_drop). The rule of lower summed error on these rows wins."""
    H, D = U.shape[0], U.shape[-1]
    cuts = [b for _, b, _ in parts] + ([D] if parts[-1][1] < D else [])  # the last group: not stored
    best, errs = None, {}
    for rule, score in (rules or dict(zip(SPLIT_RULES, (lam, lam * sig2)))).items():
        rs = []
        for h in range(H):
            order = np.argsort(-score[h], kind="stable")
            groups = [np.sort(order[a:b]) for a, b in zip([0] + cuts[:-1], cuts)]
            rs.append(parts_rotation(U[h], lam[h], sig2[h], groups, stored=len(parts)))
        rk = torch.from_numpy(np.stack([r[0] for r in rs]))  # (H, D, D)
        rq = torch.from_numpy(np.stack([r[1] for r in rs]))
        Cq_r = rq.transpose(-1, -2) @ torch.from_numpy(np.asarray(Cq, dtype=np.float64)) @ rq  # (H, D, D)
        clip, err = part_clips(kc.double() @ rk, Cq_r, parts, ratios, per_head_gain)
        errs[rule] = float(err.sum())
        if best is None or err.sum() < best.err.sum():
            best = SplitFit(rule, rk, rq, clip, err, errs)
    return best


def layer_inputs(ls, k_mean: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(U (H, D, D), λ (H, D), σ² (H, D)) of a LayerStats: the query eigenbasis, the query energy and the
    variance of keys centred by k_mean (H, D) along it (as the `scaled` variant computes them)."""
    U = ls.eig("q")[1]
    Ck = ls.cov("k") - k_mean[:, :, None] * k_mean[:, None, :]
    lam = np.einsum("hdi,hde,hei->hi", U, ls.cov("q"), U)
    sig2 = np.einsum("hdi,hde,hei->hi", U, Ck, U)
    return U, lam, sig2
