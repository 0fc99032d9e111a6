"""Clip-threshold search on reservoir rows in the rotated space, attention-aware.

K objective: relative logit error weighted by the captured queries,
    E_k[(k - k̂) C_Q (k - k̂)ᵀ] / E_k[k C_Q kᵀ]   (C_Q in the rotated basis),
i.e. the mean squared error of q·k over real queries q. V objective: relative
attention-output error ||S (V - V̂)||² / ||S V||² with S = softmax(q kᵀ · scale)
of reservoir queries over reservoir keys. Both use the exact quantizer of the
artifact's QuantConfig (oscar.quant.fake_quant), so the clip is optimal
for the format the kernel stores.

Candidates: minmax mode, ratios in (0, 1]; static mode, absolute thresholds
f · max|x| of the layer; a coarse grid, then the midpoints next to the best coarse
candidates (layer-wide and per head). A layer gets one threshold for all heads unless per-head
thresholds lower the summed error by more than ``per_head_gain`` (relative).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from oscar.common import tied_best
from oscar.quant import QuantSpec, fake_quant


@dataclass
class ClipChoice:
    clip: np.ndarray  # (H,) chosen thresholds
    per_head: bool
    err: np.ndarray  # (H,) error at the chosen thresholds
    err_noclip: np.ndarray  # (H,) error at clip = 1 (minmax) / max|x| (static)
    gain_per_head: float  # relative error reduction of per-head over per-layer thresholds
    candidates: np.ndarray  # (C,)


def candidates(spec: QuantSpec, x: torch.Tensor, ratios: np.ndarray, fracs: np.ndarray) -> np.ndarray:
    if spec.mode == "static":
        return fracs * float(x.abs().max())
    return ratios


def _fq(x: torch.Tensor, spec: QuantSpec, c: float | torch.Tensor) -> torch.Tensor:
    if spec.axis == "channel":  # token groups along the reservoir rows; drop the ragged tail
        T = x.shape[-2] // spec.group_size * spec.group_size
        x = x[..., :T, :]
    return x, fake_quant(x, spec, clip=c)


def key_errors(k: torch.Tensor, Cq: torch.Tensor, spec: QuantSpec, cands: np.ndarray) -> np.ndarray:
    """k (H, N, D) rotated (centred) keys, Cq (H, D, D) rotated query second moment -> (C, H) errors."""
    out = []
    den = None
    for c in cands:
        kk, kh = _fq(k, spec, float(c))
        if den is None:
            den = ((kk @ Cq) * kk).sum((-1, -2)).clamp_min(1e-30)  # (H,)
        e = kh - kk  # (H, N, D)
        out.append((((e @ Cq) * e).sum((-1, -2)) / den).numpy())
    return np.stack(out)


def attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """S (H, Nq, Nk) = softmax(q kᵀ · scale) over reservoir rows."""
    return torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1)


def value_errors(v: torch.Tensor, S: torch.Tensor, spec: QuantSpec, cands: np.ndarray) -> np.ndarray:
    """v (H, N, D) rotated values, S (H, Nq, N) attention -> (C, H) relative output errors."""
    out = []
    o = S @ v
    den = (o**2).sum((-1, -2)).clamp_min(1e-30)
    for c in cands:
        vv, vh = _fq(v, spec, float(c))
        Sx = S[..., : vv.shape[-2]]
        out.append((((Sx @ (vh - vv)) ** 2).sum((-1, -2)) / den).numpy())
    return np.stack(out)


def refine(err_fn, coarse: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Evaluate err_fn on the coarse grid, then on the midpoints next to the layer's and each
    head's best coarse candidate; returns (candidates (C,), errors (C, H)) sorted by candidate."""
    e = err_fn(coarse)
    step = float(np.min(np.diff(coarse))) if len(coarse) > 1 else 0.0
    best = {_argmin(e.sum(1), coarse)} | {_argmin(e[:, h], coarse) for h in range(e.shape[1])}
    fine = sorted({round(float(coarse[i]) + s * step / 2, 6) for i in best for s in (-1, 1)} - set(coarse.tolist()))
    fine = np.array([f for f in fine if lo <= f <= hi])
    if len(fine):
        coarse, e = np.concatenate([coarse, fine]), np.concatenate([e, err_fn(fine)])
    order = np.argsort(coarse, kind="stable")
    return coarse[order], e[order]


def _argmin(err: np.ndarray, cands: np.ndarray) -> int:
    """The candidate with the lowest error; errors within TIE_REL are ties (float32 objectives that the host's GEMM
    kernels round differently: oscar.common.TIE_REL), won by the largest candidate (the least clipping)."""
    tied = tied_best(err)
    return max(tied, key=lambda i: (float(cands[i]), i))


def choose(errs: np.ndarray, cands: np.ndarray, per_head_gain: float, noclip: np.ndarray) -> ClipChoice:
    """errs (C, H): one threshold per layer unless per-head choice gains > per_head_gain."""
    H = errs.shape[1]
    i = _argmin(errs.sum(1), cands)
    j = np.array([_argmin(errs[:, h], cands) for h in range(H)], dtype=int)  # (H,)
    layer_err, head_err = errs[i], errs[j, np.arange(H)]
    gain = float(1 - head_err.sum() / max(layer_err.sum(), 1e-30))
    per_head = gain > per_head_gain
    clip = cands[j] if per_head else np.full(H, cands[i])
    return ClipChoice(clip=clip.astype(np.float64), per_head=per_head, err=head_err if per_head else layer_err,
                      err_noclip=noclip, gain_per_head=gain, candidates=np.asarray(cands))


@dataclass
class ClipSearch:
    """The clip search of a fit, apart from each layer's rows: the format's quantizers, grids, budgets."""

    key_spec: QuantSpec  # QuantConfig.key_spec: the cache's own quantizer
    value_spec: QuantSpec
    scale: float  # attention logit scale (softmax of q kᵀ · scale for the V objective)
    ratios: np.ndarray  # minmax candidates, coarse grid in (0, 1]
    fracs: np.ndarray  # static candidates, coarse grid of fractions of max|x|
    per_head_gain: float = 0.02  # per-head thresholds only if they cut the summed error by more (relative)
    max_rows: int = 1024  # reservoir rows per head (K and V share them)
    max_queries: int = 128


def search_layer(q: np.ndarray, k: np.ndarray, v: np.ndarray, Cq: np.ndarray, search: ClipSearch,
                 seed: int = 0, keys: bool = True) -> tuple[ClipChoice | None, ClipChoice]:
    """K and V clips for one layer. q, k, v: rotated reservoir rows (H, N, D); keys already centred
    if the artifact centres them. Cq: rotated query second moment (H, D, D). keys=False: values only
    (split keys search their parts themselves, stats/split.py), the key choice is None."""
    rng = np.random.default_rng(seed)
    pick = lambda n_have, n: reservoir_rows(n_have, n, rng)  # noqa: E731  the same rows for k and v
    kv_rows = pick(k.shape[1], search.max_rows)
    kt = torch.from_numpy(np.ascontiguousarray(k[:, kv_rows])).float()
    vt = torch.from_numpy(np.ascontiguousarray(v[:, kv_rows])).float()
    qt = torch.from_numpy(np.ascontiguousarray(q[:, pick(q.shape[1], search.max_queries)])).float()
    Cqt = torch.from_numpy(Cq).float()
    ks, vs = search.key_spec, search.value_spec
    gain = search.per_head_gain
    ck = None
    if keys:
        kc = candidates(ks, kt, search.ratios, search.fracs)
        kc, ek = refine(lambda c: key_errors(kt, Cqt, ks, c), kc, kc.min(), kc.max())
        ck = choose(ek, kc, gain, ek[-1])  # the no-clip reference is the largest candidate (ratio 1 / max|x|)
    S = attention_probs(qt, kt, search.scale)
    vc = candidates(vs, vt, search.ratios, search.fracs)
    vc, ev = refine(lambda c: value_errors(vt, S, vs, c), vc, vc.min(), vc.max())
    return ck, choose(ev, vc, gain, ev[-1])


def reservoir_rows(n_have: int, n: int, rng: np.random.Generator):
    """The rows of a reservoir of n_have the search uses: all, or n sorted at random (K and V share them)."""
    return slice(None) if n_have <= n else np.sort(rng.choice(n_have, n, replace=False))
