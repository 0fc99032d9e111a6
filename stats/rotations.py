"""Rotation variants: a registry of named recipes, each building one layer's rotations.

Row-vector convention, ``x_rot = x @ R``. ``oscar`` is the product's recipe (docs/reference-recipe.md),
``R_K = U_Q H P_br`` and ``R_V = U_S H P_br`` per KV head (U: eigenvectors as columns,
descending). A variant is a function ``build(ls: LayerStats, rng) -> Rotations``;
add one with ``@register_variant("name", "one-line doc")``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from oscar.common import OscarError
from oscar.stats.hadamard import bitrev_perm, hadamard, perm_matrix


@dataclass
class Rotations:
    rot_k: np.ndarray  # (H, D, D) float64; orthogonal unless rot_q is set
    rot_v: np.ndarray  # (H, D, D) orthogonal
    k_mean: np.ndarray | None = None  # (H, D) when the variant centres keys
    # statistic whose eigenbasis each side uses, for diagnostics and fallbacks: ("q", pooled) or None
    source_k: tuple[str, bool] | None = None
    source_v: tuple[str, bool] | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    # query transform when rot_k is not orthogonal: rot_q = rot_k^{-T}, so (q rot_q)·(k rot_k) = q·k.
    # None: rot_q = rot_k (orthogonal).
    rot_q: np.ndarray | None = None


@dataclass(frozen=True)
class FixedFormat:
    """A variant that brings its own cache format and fixed clip ratios (no clip search)."""

    quant: Callable[[Any], Any]  # QuantConfig (the user's, for bits) -> the QuantConfig the variant stores with
    clip_k: float
    clip_v: float


@dataclass(frozen=True)
class Variant:
    name: str
    build: Callable[..., Rotations]
    doc: str
    fixed: FixedFormat | None = None
    # a variant whose rotation only makes sense for one cache format: (the user's QuantConfig, head_dim) ->
    # the QuantConfig it stores with (split: key_split set, 8-bit scale/zero)
    fmt: Callable[[Any, int], Any] | None = None


VARIANTS: dict[str, Variant] = {}


def register_variant(name: str, doc: str, fixed: FixedFormat | None = None, fmt: Callable | None = None):
    def deco(fn):
        VARIANTS[name] = Variant(name, fn, doc, fixed, fmt)
        return fn
    return deco


def get_variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise OscarError(f"unknown variant {name!r}; valid: {', '.join(sorted(VARIANTS))}")
    return VARIANTS[name]


def mixer(D: int, bitrev: bool = True) -> np.ndarray:
    """H P_br (D, D): the fixed factor after the eigenbasis."""
    Hm = hadamard(D)
    return Hm @ perm_matrix(bitrev_perm(D)) if bitrev else Hm


def compose(U: np.ndarray, bitrev: bool = True) -> np.ndarray:
    """U (H, D, D) -> U H P_br per head."""
    return U @ mixer(U.shape[-1], bitrev)


def hadamard_rot(H: int, D: int) -> np.ndarray:
    return np.broadcast_to(mixer(D), (H, D, D)).copy()


def random_orthogonal(rng: np.random.Generator, H: int, D: int) -> np.ndarray:
    """Haar-distributed orthogonal matrices (H, D, D) (QR with sign correction)."""
    q, r = np.linalg.qr(rng.standard_normal((H, D, D)))
    return q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[:, None, :]


def _eig_rot(ls, x: str, pooled: bool = False, bitrev: bool = True) -> np.ndarray:
    return compose(ls.eig(x, pooled)[1], bitrev)


@register_variant("oscar", "R_K = U_Q H P_br, R_V = U_S H P_br per KV head (docs/reference-recipe.md)")
def _oscar(ls, rng) -> Rotations:
    return Rotations(_eig_rot(ls, "q"), _eig_rot(ls, "o"), source_k=("q", False), source_v=("o", False))


@register_variant("shared-layer", "as oscar, one rotation per layer from the head-averaged C_Q / C_S")
def _shared(ls, rng) -> Rotations:
    return Rotations(_eig_rot(ls, "q", True), _eig_rot(ls, "o", True), source_k=("q", True), source_v=("o", True))


@register_variant("ref-value-target", "as oscar, V target = Σ w v vᵀ / Σ w with w = k C_Q kᵀ (published code)")
def _refv(ls, rng) -> Rotations:
    return Rotations(_eig_rot(ls, "q"), _eig_rot(ls, "vw"), source_k=("q", False), source_v=("vw", False))


@register_variant("centered", "as oscar, keys centred by the calibrated key mean before rotation")
def _centered(ls, rng) -> Rotations:
    r = _oscar(ls, rng)
    r.k_mean = ls.mean("k")
    return r


def importance_scales(lam: np.ndarray, sig2: np.ndarray, floor: float = 1e-3) -> np.ndarray:
    """(H, D) scales d_i = (λ_i / σ_i²)^(1/4) along the query eigenvectors u_i, energy-normalised.

    λ_i = u_iᵀ C_Q u_i, σ_i² = u_iᵀ C_K u_i (centred keys). With keys stored as k U diag(d) H P
    and queries read as q U diag(1/d) H P, per-token quantization noise is white after H, so the
    logit error is ∝ (Σ d_i² σ_i²)(Σ λ_i / d_i²); Cauchy–Schwarz puts its minimum at
    d_i² ∝ √λ_i / σ_i, where it is (Σ σ_i √λ_i)² instead of (Σ σ_i²)(Σ λ_i) for d = 1.
    Both spectra are floored at ``floor`` × their mean so that a direction no query reads
    does not get an unbounded scale.
    """
    lam = np.maximum(lam, floor * lam.mean(-1, keepdims=True))
    sig2 = np.maximum(sig2, floor * sig2.mean(-1, keepdims=True))
    d = (lam / sig2) ** 0.25  # (H, D)
    return d * np.sqrt(sig2.sum(-1, keepdims=True) / (d**2 * sig2).sum(-1, keepdims=True))  # Σ d² σ² = Σ σ²


@register_variant("scaled", "as centered, keys scaled along u_i by (λ_i/σ_i²)^¼ before H P_br, queries by the "
                  "inverse: R_K = U_Q diag(d) H P_br, R_Q = U_Q diag(1/d) H P_br (logit-error optimal)")
def _scaled(ls, rng) -> Rotations:
    r = _centered(ls, rng)
    U = ls.eig("q")[1]  # (H, D, D) columns u_i, descending
    mu = r.k_mean
    Ck = ls.cov("k") - mu[:, :, None] * mu[:, None, :]  # centred key covariance
    lam = np.einsum("hdi,hde,hei->hi", U, ls.cov("q"), U)
    sig2 = np.einsum("hdi,hde,hei->hi", U, Ck, U)
    d = importance_scales(lam, sig2)  # (H, D)
    M = mixer(ls.D)
    r.rot_k, r.rot_q = (U * d[:, None, :]) @ M, (U / d[:, None, :]) @ M
    return r


def _split_format(q, D: int):
    """The split format of `split`: D/4 wide key channels (stats/split.py), 8-bit scale/zero for every part and
    the values, so that the history stays at the INT2 budget (2.5 bits per element at D = 64)."""
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.stats.artifact import split_width

    return replace(q, key_split=split_width(D), param_dtype="float8_e4m3fn")


@register_variant("split", "as scaled, but keys in two parts of the query eigenbasis: the D/4 directions of largest "
                  "lambda or lambda*sigma^2 (per layer, by calibration error) one bit wider, each part scaled and "
                  "Hadamard-mixed within itself; 8-bit scale/zero (stats/split.py)", fmt=_split_format)
def _split(ls, rng) -> Rotations:
    r = _scaled(ls, rng)  # key mean, and a full-width rotation until the fit places the parts (fit._place_split)
    r.notes["split"] = True
    return r


@register_variant("hadamard", "R_K = R_V = H P_br (no eigenbasis)")
def _had(ls, rng) -> Rotations:
    return Rotations(hadamard_rot(ls.H, ls.D), hadamard_rot(ls.H, ls.D))


@register_variant("hadamard-centered", "as hadamard, keys centred by the calibrated key mean first (hadamard-clip-int2)")
def _had_c(ls, rng) -> Rotations:
    r = _had(ls, rng)
    r.k_mean = ls.mean("k")
    return r


@register_variant("k-eig", "R_K = U_K H P_br from the key covariance; R_V as oscar")
def _keig(ls, rng) -> Rotations:
    return Rotations(_eig_rot(ls, "k"), _eig_rot(ls, "o"), source_k=("k", False), source_v=("o", False))


@register_variant("v-eig", "R_V = U_V H P_br from the value covariance; R_K as oscar")
def _veig(ls, rng) -> Rotations:
    return Rotations(_eig_rot(ls, "q"), _eig_rot(ls, "v"), source_k=("q", False), source_v=("v", False))


@register_variant("no-bitrev", "R_K = U_Q H, R_V = U_S H (oscar without P_br)")
def _nobr(ls, rng) -> Rotations:
    return Rotations(_eig_rot(ls, "q", bitrev=False), _eig_rot(ls, "o", bitrev=False),
                     source_k=("q", False), source_v=("o", False))


@register_variant("random", "independent Haar-random orthogonal R_K, R_V per head (seeded)")
def _random(ls, rng) -> Rotations:
    return Rotations(random_orthogonal(rng, ls.H, ls.D), random_orthogonal(rng, ls.H, ls.D))


@register_variant("identity", "no rotation (naive quantization baseline)")
def _identity(ls, rng) -> Rotations:
    eye = np.broadcast_to(np.eye(ls.D), (ls.H, ls.D, ls.D)).copy()
    return Rotations(eye, eye.copy())


def _ref_format(q):
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.stats.reference_recipe import reference_quant_config

    return reference_quant_config(bits=q.bits)


@register_variant("oscar-ref", "the published OSCAR code's recipe: per-layer U H P from plain C_Q / Σ w v vᵀ / Σ w, "
                  "eigh ascending, fixed row-quantile clips K 0.96 V 0.92, float32 scale/zero, pages of 8",
                  fixed=FixedFormat(_ref_format, 0.96, 0.92))
def _oscar_ref(ls, rng) -> Rotations:
    # late: keeps torch (2.1 s) out of `oscar --help`
    import torch

    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.stats import reference_recipe as rr

    if not ls.has("vw_gram") or not ls.has("w_sum"):
        raise OscarError(f"variant oscar-ref needs layers/{ls.l}/vw_gram and w_sum in the store "
                         "(the published value target); recalibrate with a capture that writes them")
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float64))  # noqa: E731
    ref = rr.layer_rotations(t(ls.arr("q_gram")), t(ls.counts("q")), t(ls.arr("vw_gram")), t(ls.arr("w_sum")))
    rep = lambda x: np.broadcast_to(x.numpy(), (ls.H,) + tuple(x.shape)).copy()  # noqa: E731
    return Rotations(rep(ref.rot_k), rep(ref.rot_v),
                     notes={"eig_k": rep(ref.eig_k), "eig_v": rep(ref.eig_v), "eig_order": "ascending"})


# The latent (MLA) fit's rotations (stats/latent.py), listed here with the per-head variants (`oscar variants`).
LATENT_VARIANTS = {
    "attention": "R = U_Q̃ P_br H_blk from the absorbed queries' second moment, the calibrated latent mean subtracted",
    "reference": "R = U_c P_br H_blk from the latent's own second moment, no centring (the public OSCAR MLA recipe)",
    "hadamard": "R = H_blk, the block Hadamard alone",
    "identity": "R = I",
}
