"""Synthetic regimes (one structural assumption each) and the real regime from a store.

Every regime yields calibration and test sets of (q, k, v), each (N, D) float64,
and a `spec`: the property it is built to have (kurtosis, rank, angle, ratio...).
`measure(regime)` estimates the same properties from the generated data; tests
check the two agree. Data is drawn from numpy PCG64 seeded by (regime, seed), so
both validation paths see the same data (docs/decisions/0004-ablation-harness.md).

Scale: K and V are normalised so E|x|^2 = D; queries are independent draws of
their own distribution (never Q = K) times `q_gain`, so logits q.k/sqrt(D) have a
spread of a few units, like real attention.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from oscar.common import OscarError
from oscar.pipeline.store import open_verified


@dataclass
class RegimeConfig:
    D: int = 64
    n_calib: int = 2048
    n_test: int = 512  # keys/values in the test context (a multiple of 32 for KIVI groups)
    n_query: int = 64  # test queries attending over the whole test context
    q_gain: float = 2.0
    nu: float = 3.0  # Student-t degrees of freedom (heavy)
    rank: int = 8  # lowrank / kv subspace rank
    noise: float = 0.05  # lowrank noise std relative to signal
    alpha: float = 1.0  # power-law eigenvalue decay exponent
    n_outliers: int = 4
    outlier_factor: float = 30.0
    shift_deg: float = 45.0
    store: str | None = None  # calibration store for the `real` regime
    layer: int | None = None  # None: middle layer
    head: int = 0


@dataclass
class Regime:
    name: str
    calib: dict[str, np.ndarray]
    test: dict[str, np.ndarray]
    spec: dict[str, float]
    extra: dict = field(default_factory=dict)


def _orth(rng: np.random.Generator, D: int) -> np.ndarray:
    Q, R = np.linalg.qr(rng.standard_normal((D, D)))
    return Q * np.sign(np.diag(R))  # Haar-distributed orthogonal


def _gauss(rng, n, lam, U):
    """n rows with covariance U diag(lam) U^T."""
    return (rng.standard_normal((n, len(lam))) * np.sqrt(lam)) @ U.T


def _norm_lam(lam: np.ndarray) -> np.ndarray:
    return lam * (len(lam) / lam.sum())


def _split(cfg: RegimeConfig, draw: Callable[[int, str], np.ndarray]) -> tuple[dict, dict]:
    calib = {n: draw(cfg.n_calib, n) for n in "qkv"}
    test = {"q": draw(cfg.n_query, "q"), "k": draw(cfg.n_test, "k"), "v": draw(cfg.n_test, "v")}
    for d in (calib, test):
        d["q"] = d["q"] * cfg.q_gain
    return calib, test


def isotropic(cfg, rng):
    calib, test = _split(cfg, lambda n, _: rng.standard_normal((n, cfg.D)))
    return Regime("isotropic", calib, test, {"excess_kurtosis": 0.0, "cond": 1.0})


def heavy(cfg, rng):
    """Student-t(nu) latent coordinates, standardised, with a power-law spectrum in a random basis."""
    if cfg.nu <= 2:
        raise ValueError(f"heavy regime needs nu > 2 for a finite variance, got {cfg.nu}")
    U = _orth(rng, cfg.D)
    lam = _norm_lam(np.arange(1, cfg.D + 1) ** -cfg.alpha)

    def draw(n, _):
        z = rng.standard_t(cfg.nu, (n, cfg.D)) / math.sqrt(cfg.nu / (cfg.nu - 2))
        return (z * np.sqrt(lam)) @ U.T

    calib, test = _split(cfg, draw)
    ek = 6 / (cfg.nu - 4) if cfg.nu > 4 else math.inf
    return Regime("heavy", calib, test, {"excess_kurtosis": ek}, {"U": U, "lam": lam})


def lowrank(cfg, rng):
    U = _orth(rng, cfg.D)
    lam = np.zeros(cfg.D)
    lam[: cfg.rank] = np.linspace(2.0, 1.0, cfg.rank)
    lam = _norm_lam(lam + cfg.noise**2 * lam[: cfg.rank].mean())
    calib, test = _split(cfg, lambda n, _: _gauss(rng, n, lam, U))
    return Regime("lowrank", calib, test, {"rank": cfg.rank}, {"U": U, "lam": lam})


def powerlaw(cfg, rng):
    U = _orth(rng, cfg.D)
    lam = _norm_lam(np.arange(1, cfg.D + 1) ** -cfg.alpha)
    calib, test = _split(cfg, lambda n, _: _gauss(rng, n, lam, U))
    return Regime("powerlaw", calib, test, {"alpha": cfg.alpha}, {"U": U, "lam": lam})


def _kv_subspace(cfg, rng, angle_deg: float, name: str):
    """K and queries in a rank-r subspace U_K; V in cos(a) U_K + sin(a) U_perp (principal angle a)."""
    r = cfg.rank
    if 2 * r > cfg.D:
        raise ValueError(f"kv subspace regime needs 2*rank <= D, got rank {r}, D {cfg.D}")
    B = _orth(rng, cfg.D)
    Uk, Up = B[:, :r], B[:, r: 2 * r]
    a = math.radians(angle_deg)
    Uv = math.cos(a) * Uk + math.sin(a) * Up
    lam = np.linspace(2.0, 1.0, r)
    lam = lam * (cfg.D / lam.sum())
    sn = cfg.noise * math.sqrt(lam.mean())

    def draw(n, role):
        Us = Uv if role == "v" else Uk
        return (rng.standard_normal((n, r)) * np.sqrt(lam)) @ Us.T + sn * rng.standard_normal((n, cfg.D))

    calib, test = _split(cfg, draw)
    return Regime(name, calib, test, {"angle_deg": angle_deg, "rank": r}, {"Uk": Uk, "Uv": Uv})


def kv_aligned(cfg, rng):
    return _kv_subspace(cfg, rng, 0.0, "kv_aligned")


def kv_misaligned(cfg, rng):
    return _kv_subspace(cfg, rng, 90.0, "kv_misaligned")


def outliers(cfg, rng):
    """Isotropic keys/values with a few channels scaled by `outlier_factor` (as in real keys)."""
    ch = rng.choice(cfg.D, cfg.n_outliers, replace=False)
    s = np.ones(cfg.D)
    s[ch] = cfg.outlier_factor
    s = s * math.sqrt(cfg.D / (s**2).sum())

    def draw(n, role):
        x = rng.standard_normal((n, cfg.D))
        return x * s if role in "kv" else x

    calib, test = _split(cfg, draw)
    return Regime("outliers", calib, test, {"outlier_ratio": cfg.outlier_factor, "n_outliers": cfg.n_outliers}, {"channels": np.sort(ch)})


def shift(cfg, rng):
    """Calibration and test share a power-law spectrum; the test basis is rotated by
    `shift_deg` in the planes (i, i + D/2), so the top eigenvector moves by that angle."""
    U = _orth(rng, cfg.D)
    lam = _norm_lam(np.arange(1, cfg.D + 1) ** -cfg.alpha)
    h = cfg.D // 2
    a = math.radians(cfg.shift_deg)
    G = np.eye(cfg.D)
    i = np.arange(h)
    G[i, i] = G[i + h, i + h] = math.cos(a)
    G[i + h, i], G[i, i + h] = math.sin(a), -math.sin(a)
    U2 = U @ G
    calib = {n: _gauss(rng, cfg.n_calib, lam, U) for n in "qkv"}
    test = {"q": _gauss(rng, cfg.n_query, lam, U2), "k": _gauss(rng, cfg.n_test, lam, U2), "v": _gauss(rng, cfg.n_test, lam, U2)}
    for d in (calib, test):
        d["q"] = d["q"] * cfg.q_gain
    return Regime("shift", calib, test, {"angle_deg": cfg.shift_deg}, {"U": U, "U2": U2})


def real(cfg, rng):
    """Reservoir samples of a calibration store (`layers/{l}/{q,k,v}_res`): real captured
    queries. Calibration = first half of the blocks, test = a random draw from the rest."""
    if not cfg.store:
        raise ValueError("the real regime needs a calibration store (--store)")

    st = open_verified(cfg.store)  # the store format's owner: format, attributes, checksums of done blocks
    layer = st.num_layers // 2 if cfg.layer is None else cfg.layer
    # q rows pool every query head of the group (counted by qo_res_count where the store has it)
    rows = {n: [r.astype(np.float64) for r in st.reservoir(layer, n, cfg.head)] for n in "qkv"}
    cnt = np.array([len(r) for r in rows["k"]])
    B = len(cnt)
    if B < 2 or cnt.min() == 0:
        raise OscarError(f"{cfg.store}: the real regime needs >= 2 blocks with reservoir rows (counts {cnt.tolist()})")
    h = max(1, B // 2)
    cal = {n: np.concatenate(rows[n][:h]) for n in "qkv"}
    rest = {n: np.concatenate(rows[n][h:]) for n in "qkv"}
    nt = min(cfg.n_test, len(rest["k"])) // 32 * 32
    if nt == 0:
        raise OscarError(f"{cfg.store}: too few held-out reservoir rows ({len(rest['k'])}) for a test context")
    it = rng.choice(len(rest["k"]), nt, replace=False)
    iq = rng.choice(len(rest["q"]), min(cfg.n_query, len(rest["q"])), replace=False)
    test = {"q": rest["q"][iq], "k": rest["k"][it], "v": rest["v"][it]}
    return Regime("real", cal, test, {"layer": layer, "head": cfg.head, "D": cal["k"].shape[1]}, {"store": cfg.store})


REGIMES: dict[str, Callable[[RegimeConfig, np.random.Generator], Regime]] = {
    "isotropic": isotropic, "heavy": heavy, "lowrank": lowrank, "powerlaw": powerlaw,
    "kv_aligned": kv_aligned, "kv_misaligned": kv_misaligned, "outliers": outliers,
    "shift": shift, "real": real,
}


def make_regime(name: str, cfg: RegimeConfig, seed: int) -> Regime:
    if name not in REGIMES:
        raise ValueError(f"unknown regime {name!r}; known: {', '.join(REGIMES)}")
    rng = np.random.Generator(np.random.PCG64([zlib.crc32(name.encode()), seed]))
    return REGIMES[name](cfg, rng)


# ----------------------------------------------------------------------------- spec checks

def excess_kurtosis(x: np.ndarray, axis=0) -> np.ndarray:
    x = x - x.mean(axis, keepdims=True)
    return (x**4).mean(axis) / (x**2).mean(axis) ** 2 - 3


def principal_angle_deg(A: np.ndarray, B: np.ndarray) -> float:
    """Largest principal angle between the column spans of A and B (orthonormal columns)."""
    s = np.linalg.svd(A.T @ B, compute_uv=False)
    return float(np.degrees(np.arccos(np.clip(s.min(), -1, 1))))


def _top(x: np.ndarray, r: int) -> np.ndarray:
    w, U = np.linalg.eigh(np.cov(x.T))
    return U[:, ::-1][:, :r]


def measure(reg: Regime) -> dict[str, float]:
    """The data's own estimate of each spec entry."""
    k = np.concatenate([reg.calib["k"], reg.test["k"]])
    out: dict[str, float] = {}
    if "excess_kurtosis" in reg.spec:
        z = k @ reg.extra["U"] / np.sqrt(reg.extra["lam"]) if "U" in reg.extra else k
        out["excess_kurtosis"] = float(np.median(excess_kurtosis(z)))
    if "cond" in reg.spec:
        w = np.linalg.eigvalsh(np.cov(k.T))
        out["cond"] = float(w.max() / w.min())
    if "rank" in reg.spec:
        w = np.linalg.eigvalsh(np.cov(k.T))[::-1]
        out["rank"] = int((w > 0.1 * w[0]).sum())
    if "alpha" in reg.spec:
        w = np.linalg.eigvalsh(np.cov(k.T))[::-1]
        i = np.arange(1, len(w) // 2 + 1)
        out["alpha"] = float(-np.polyfit(np.log(i), np.log(w[: len(i)]), 1)[0])
    if reg.name.startswith("kv_"):
        r = int(reg.spec["rank"])
        out["angle_deg"] = principal_angle_deg(_top(reg.calib["k"], r), _top(reg.calib["v"], r))
    if reg.name == "shift":
        a, b = _top(reg.calib["k"], 1), _top(reg.test["k"], 1)
        out["angle_deg"] = float(np.degrees(np.arccos(min(1.0, abs(float(a[:, 0] @ b[:, 0]))))))
    if "outlier_ratio" in reg.spec:
        sd = k.std(0)
        ch = reg.extra["channels"]
        rest = np.setdiff1d(np.arange(k.shape[1]), ch)
        out["outlier_ratio"] = float(np.median(sd[ch]) / np.median(sd[rest]))
    return out
