"""The latent (MLA) fit: one r x r rotation per layer for the latent c_kv, its mean and per-group clips.

The cache stores c_rot = (c - mean) @ R in INT2 groups of 128; the absorbed query is rotated the same way
(q̃ c = (q̃ R)(c_rot)ᵀ + q̃ mean, R orthogonal) and the attention-weighted latent is un-rotated before W_UV, so the
rotation only decides where the quantization error falls. Variants (`LATENT_VARIANTS`):

    attention   R = U_Q̃ P_br H_blk, U_Q̃ the eigenvectors of the absorbed queries' second moment Σ q̃ q̃ᵀ (what the
                logits read of the latent, the latent analogue of OSCAR's C_Q), the calibrated mean subtracted
    reference   R = U_c P_br H_blk, U_c the eigenvectors of the latent's own second moment Σ c cᵀ, no centring:
                the public OSCAR MLA recipe
    hadamard    R = H_blk (block Hadamard alone)
    identity    R = I

P_br is the bit-reversal permutation (it deals the leading directions out across the groups) and H_blk the
normalised Hadamard of each 128-value group (it spreads each group's energy over its values). Clips: one minmax
ratio per group, searched on the reservoir rows for the smallest attention-weighted error — the logit error through
Σ q̃ q̃ᵀ plus the value error through Σ_h W_UV,hᵀ W_UV,h, each relative to its signal — the same candidates, tie rule
(the least clipping among ties) and robust block estimators as the per-head fit. Diagnostics per layer: d_eff by
spectral gap (spurious leading eigenvalues pruned against the blocks) and the leading subspace's stability across
blocks, as for per-head statistics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from oscar.common import OscarError, tied_best
from oscar.pipeline.store import open_verified, store_fingerprint
from oscar.quant import fake_quant
from oscar.stats.artifact import LatentArtifact, LatentQuant
from oscar.stats.hadamard import bitrev_perm, hadamard, perm_matrix
from oscar.stats.reduce import ESTIMATORS, reduce
from oscar.stats.rotations import LATENT_VARIANTS
from oscar.stats.spectrum import analyse

RATIOS = np.round(np.linspace(0.5, 1.0, 11), 6)  # minmax clip candidates per group (coarse; midpoints refine)


@dataclass
class LatentFitConfig:
    variant: str = "attention"
    quant: LatentQuant = field(default_factory=LatentQuant)
    estimator: str = "plain"     # across blocks: plain, mom (median of means), trimmed (stats.reduce)
    clip: bool = True            # search a clip per group (False: ratio 1, plain minmax)
    max_rows: int = 1024         # reservoir rows the clip search reads
    gap_min: float = 2.0
    seed: int = 0

    def __post_init__(self):
        if self.variant not in LATENT_VARIANTS:
            raise OscarError(f"unknown latent variant {self.variant!r}; valid: {', '.join(LATENT_VARIANTS)}")
        if self.estimator not in ESTIMATORS:
            raise OscarError(f"unknown estimator {self.estimator!r}; valid: {', '.join(ESTIMATORS)}")


def block_hadamard(r: int, group: int) -> np.ndarray:
    """(r, r): the normalised Hadamard of order `group` on each diagonal block."""
    return np.kron(np.eye(r // group), hadamard(group))


def mixer(r: int, group: int) -> np.ndarray:
    """P_br H_blk (r, r): the fixed factor after the eigenbasis."""
    return perm_matrix(bitrev_perm(r)) @ block_hadamard(r, group)


def group_errors(x: torch.Tensor, weights: list[torch.Tensor], quant: LatentQuant, ratios: np.ndarray) -> np.ndarray:
    """x (N, r) rotated (centred) latents, weights [(r, r)] rotated weighting matrices -> (C, G) errors: per group g
    and candidate ratio, Σ_w E[e_g W_gg e_gᵀ] / E[x W xᵀ], e_g the group's quantization error (its diagonal block:
    groups are quantized independently)."""
    spec, g = quant.spec(), quant.group
    G = x.shape[1] // g
    dens = [((x @ W) * x).sum().clamp_min(1e-30) for W in weights]
    out = np.zeros((len(ratios), G))
    for i, c in enumerate(ratios):
        e = fake_quant(x, spec, clip=float(c)) - x                                 # (N, r): groups independent
        for j in range(G):
            s = slice(j * g, (j + 1) * g)
            out[i, j] = sum(float(((e[:, s] @ W[s, s]) * e[:, s]).sum() / d) for W, d in zip(weights, dens))
    return out


def _choose(errs: np.ndarray, ratios: np.ndarray) -> np.ndarray:
    """Per group the ratio of least error; ties (oscar.common.TIE_REL) go to the least clipping."""
    return np.array([max(tied_best(errs[:, j]), key=lambda i: float(ratios[i])) for j in range(errs.shape[1])])


def search_clips(x: torch.Tensor, weights: list[torch.Tensor], quant: LatentQuant) -> tuple[np.ndarray, dict]:
    """Per-group ratios (G,) on a coarse grid, then the midpoints next to each group's best; and the errors."""
    errs = group_errors(x, weights, quant, RATIOS)
    best = _choose(errs, RATIOS)
    step = float(RATIOS[1] - RATIOS[0])
    fine = sorted({round(float(RATIOS[i]) + s * step / 2, 6) for i in set(best.tolist()) for s in (-1, 1)}
                  - set(RATIOS.tolist()))
    fine = np.array([f for f in fine if RATIOS[0] <= f <= 1.0])
    cands, e = RATIOS, errs
    if len(fine):
        cands, e = np.concatenate([RATIOS, fine]), np.concatenate([errs, group_errors(x, weights, quant, fine)])
    order = np.argsort(cands, kind="stable")
    cands, e = cands[order], e[order]
    pick = _choose(e, cands)
    G = e.shape[1]
    return cands[pick], {"err": e[pick, np.arange(G)].tolist(), "err_noclip": e[-1].tolist()}


def _blocks(st, name: str, l: int, blocks: list[int]) -> np.ndarray:
    return np.asarray(st.array(f"layers/{l}/{name}")[:])[blocks]


def fit_layer(st, l: int, blocks: list[int], cfg: LatentFitConfig, rng: np.random.Generator) -> tuple[dict, dict]:
    """One layer's rot, mean, clip (torch tensors) and its diagnostics."""
    q = cfg.quant
    count, q_count = _blocks(st, "count", l, blocks), _blocks(st, "q_count", l, blocks)
    c_gram, qa_gram = _blocks(st, "c_gram", l, blocks), _blocks(st, "qa_gram", l, blocks)
    r = c_gram.shape[-1]
    Cc = reduce(c_gram, count, cfg.estimator)                                      # (r, r)
    Cq = reduce(qa_gram, q_count, cfg.estimator)                                   # (r, r)
    M = _blocks(st, "uv_gram", l, blocks).sum(0) / count.sum()                     # (r, r) Σ_h W_UV,hᵀ W_UV,h
    block_c = c_gram / np.maximum(count, 1)[:, None, None]
    block_q = qa_gram / np.maximum(q_count, 1)[:, None, None]
    mean = np.zeros(r)
    diag: dict = {}
    if cfg.variant in ("attention", "reference"):
        C, blk = (Cq, block_q) if cfg.variant == "attention" else (Cc, block_c)
        U, sd = analyse(C, blk, cfg.gap_min)
        R = U @ mixer(r, q.group)
        diag = {"d_eff": sd.d_eff, "d_gap_raw": sd.d_gap_raw, "pruned": sd.pruned, "stability": sd.stability,
                "max_angle_deg": sd.max_angle_deg}
        if cfg.variant == "attention":
            mean = _blocks(st, "c_sum", l, blocks).sum(0) / count.sum()
    elif cfg.variant == "hadamard":
        R = block_hadamard(r, q.group)
    else:
        R = np.eye(r)
    clip = np.ones(r // q.group)
    if cfg.clip:
        rows = np.asarray(st.array(f"layers/{l}/c_res")[:])[blocks]                  # (B, R, r)
        n_res = _blocks(st, "res_count", l, blocks)
        x = np.concatenate([b[: int(n)] for b, n in zip(rows, n_res)])             # (N, r)
        if len(x) > cfg.max_rows:
            x = x[np.sort(rng.choice(len(x), cfg.max_rows, replace=False))]
        if not len(x):
            raise OscarError(f"layer {l}: no reservoir rows to search clips on (calibrate with --reservoir > 0, or "
                             "fit with clips off)")
        xr = torch.from_numpy((x - mean) @ R).float()                              # (N, r) rotated, centred
        weights = [torch.from_numpy(R.T @ W @ R).float() for W in (Cq, M)]
        clip, errs = search_clips(xr, weights, q)
        diag.update(errs)
    diag["clip"] = clip.tolist()
    return {"rot": torch.from_numpy(R), "mean": torch.from_numpy(mean), "clip": torch.from_numpy(clip)}, diag


def fit_latent(store_path: str, cfg: LatentFitConfig | None = None, partial: bool = False) -> LatentArtifact:
    """Fit the latent artifact of a latent store (every layer; `partial`: the fully done blocks of an incomplete one)."""
    cfg = cfg or LatentFitConfig()
    t0 = time.perf_counter()
    st = open_verified(store_path)
    if not st.meta.latent:
        raise OscarError(f"{store_path} is a per-head store ({st.meta.format}): the latent fit reads "
                         "oscar-calib-latent stores (MLA models); `oscar fit` fits it with the per-head recipe")
    done = st.done()
    blocks = [int(b) for b in np.flatnonzero(done.all(1))]
    if not done.all() and not partial:
        raise OscarError(f"{store_path}: store is incomplete: {len(blocks)}/{done.shape[0]} blocks done; resume "
                         "calibration, or pass --partial to fit the done blocks only")
    if not blocks:
        raise OscarError(f"{store_path}: no block is done for every layer; nothing to fit")
    r = st.D
    if r % cfg.quant.group:
        raise OscarError(f"{store_path}: kv_lora_rank {r} is not a whole number of {cfg.quant.group}-value groups")
    rng = np.random.default_rng(cfg.seed)
    rot, mean, clip, layers = [], [], [], []
    for l in range(st.num_layers):
        t, d = fit_layer(st, l, blocks, cfg, rng)
        rot.append(t["rot"].float())
        mean.append(t["mean"].float())
        clip.append(t["clip"].float())
        layers.append(d)
    m = st.meta.model
    meta = {"model": {k: m.get(k) for k in ("name", "fingerprint", "config_fingerprint", "num_layers", "latent")},
            "variant": cfg.variant, "centering": cfg.variant == "attention", "estimator": cfg.estimator,
            "layers": layers, "provenance": {"store": str(store_path), "blocks": blocks, "partial": not done.all(),
                                             "store_fingerprint": store_fingerprint(dict(st.group.attrs), blocks),
                                             "seq_len": st.meta.seq_len, "positions": st.meta.config.get("positions")},
            "fit": {"seconds": round(time.perf_counter() - t0, 2)}}
    return LatentArtifact(rot=rot, mean=mean, clip=clip, quant=cfg.quant, meta=meta)
