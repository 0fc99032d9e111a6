"""Read a calibration store layer by layer and reduce its per-block sums to covariances.

Only the store's public names (docs/store-format.md) are read, one layer at a time,
so peak memory is one layer's arrays whatever the model depth. Estimators across
blocks (each block = one deterministic slice of the corpus):

- ``plain``: Σ_b sums / Σ_b counts (the pooled sample second moment).
- ``mom``: median of means, the element-wise median of the per-block means.
- ``trimmed``: element-wise trimmed mean of the per-block means (``trim`` cut at each end).
Robust results are symmetrised and projected onto the PSD cone. ``oas`` / ``ledoit_wolf``
shrink towards a scaled identity for small samples (eigenvectors unchanged, eigenvalues
pulled together: only d_eff and the recorded spectrum move).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from oscar.common import OscarError
from oscar.pipeline.store import excess_kurtosis, open_verified, store_fingerprint
from oscar.stats.spectrum import analyse
from oscar.stats.tails import tail_diag

ESTIMATORS = ("plain", "mom", "trimmed")


@dataclass
class StoreView:
    """The blocks a fit uses of a store opened through its owner (oscar.pipeline.store)."""
    path: str
    attrs: dict[str, Any]
    blocks: list[int]  # blocks used (all done ones)
    partial: bool = False
    store: Any = field(default=None, repr=False)  # the CalibStore

    @property
    def model(self) -> dict:
        return self.attrs["model"]

    @property
    def num_layers(self) -> int:
        return int(self.model["num_layers"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.model["num_kv_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.model["head_dim"])

    @property
    def fingerprint(self) -> str:
        return store_fingerprint(self.attrs, self.blocks)

    def has(self, l: int, name: str) -> bool:
        return self.store.has(f"layers/{l}/{name}")

    def read(self, name: str) -> np.ndarray:
        """A store array (e.g. `mask`, `layers/0/q_count`) restricted to the used blocks."""
        return self.store.read(name, self.blocks)

    def layer(self, l: int, names: list[str] | tuple[str, ...]) -> dict[str, np.ndarray]:
        """Arrays of layer l restricted to the used blocks, checked finite."""
        out = {}
        for n in names:
            key = f"layers/{l}/{n}"
            if not self.store.has(key):
                raise OscarError(f"{self.path}: store has no array {key!r} (needed by this fit); "
                                 "re-run calibration with a version that writes it")
            x = self.read(key)
            if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
                bad = sorted({int(self.blocks[i]) for i in np.argwhere(~np.isfinite(x))[:, 0]})
                raise OscarError(f"{self.path}: {key} has NaN/Inf in block(s) {bad[:10]}; the store is corrupt "
                                 "there: re-run calibration for those blocks")
            if n.endswith("count"):
                if (x < 0).any() or (np.issubdtype(x.dtype, np.floating) and (x != np.round(x)).any()):
                    raise OscarError(f"{self.path}: {key} has invalid counts {x.tolist()[:10]}")
            out[n] = x
        return out


# what every fit reads per layer (variants may read more, lazily)
FIT_ARRAYS = ("q_gram", "o_gram", "q_count", "kv_count", "q_sum", "q_m3", "q_m4", "o_sum", "o_m3", "o_m4",
              "q_res", "k_res", "v_res", "res_count")


def prefetch(view: "StoreView", pool, l: int, names=FIT_ARRAYS) -> dict:
    """Submit reads of layer l's arrays to a thread pool: {name: Future}; overlaps I/O with compute."""
    return {n: pool.submit(lambda n=n: view.layer(l, [n])[n]) for n in names if view.has(l, n)}


def open_store(path: str, partial: bool = False, log=None) -> StoreView:
    """Open and check a store; refuse an incomplete one unless ``partial`` (then use fully done blocks)."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    st = open_verified(path)  # the store format's owner: format, attributes, every done block's checksums
    if st.meta.latent:
        raise OscarError(f"{path} is a latent store ({st.meta.format}, MLA model {st.meta.model.get('name')!r}): it "
                         "holds the latent c_kv's statistics, not per-head K/V, so the per-head fit cannot read it")
    done = st.done()  # (B, L)
    full = [int(b) for b in np.flatnonzero(done.all(1))]
    if not done.all():
        missing = int((~done).sum())
        if not partial:
            raise OscarError(
                f"{path}: store is incomplete: {len(full)}/{done.shape[0]} blocks done ({missing} block-layer "
                "chunks missing); resume calibration, or pass --partial to fit the done blocks only")
        if not full:
            raise OscarError(f"{path}: no block is done for every layer; nothing to fit even with --partial")
        log(f"WARNING: --partial: fitting {len(full)} of {done.shape[0]} blocks only "
            f"(blocks {full[:8]}{'...' if len(full) > 8 else ''}); the artifact records it")
    return StoreView(path=path, attrs=dict(st.group.attrs), blocks=full, partial=not done.all(), store=st)


def block_means(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per-block means (B, ...) from sums (B, ...) and counts (B,) ; blocks with count 0 dropped."""
    keep = counts > 0
    c = counts[keep].astype(np.float64).reshape(-1, *([1] * (sums.ndim - 1)))
    return sums[keep] / c


def psd(C: np.ndarray) -> np.ndarray:
    """Symmetrise and clip negative eigenvalues (batched over leading dims)."""
    C = torch.from_numpy(np.ascontiguousarray(0.5 * (C + np.swapaxes(C, -1, -2))))
    w, V = torch.linalg.eigh(C)
    return ((V * w.clamp_min(0)[..., None, :]) @ V.transpose(-1, -2)).numpy()


def reduce(sums: np.ndarray, counts: np.ndarray, method: str = "plain", trim: float = 0.1) -> np.ndarray:
    """Reduce per-block sums (B, ...) with counts (B,) to one estimate (...)."""
    counts = np.asarray(counts)
    n = counts.sum()
    if n <= 0:
        raise OscarError("no counted rows in the used blocks")
    if method == "plain":
        return sums.sum(0) / float(n)
    m = block_means(sums, counts)
    if m.shape[0] < 3:  # median/trim of fewer than 3 blocks is the mean
        return sums.sum(0) / float(n)
    if method == "mom":
        est = np.median(m, axis=0)
    elif method == "trimmed":  # cut int(trim * B) blocks at each end, element-wise (as scipy's trim_mean)
        cut = int(trim * m.shape[0])
        est = np.sort(m, axis=0)[cut: m.shape[0] - cut].mean(0)
    else:
        raise OscarError(f"unknown estimator {method!r}; valid: {', '.join(ESTIMATORS)}")
    if est.ndim >= 2 and est.shape[-1] == est.shape[-2]:
        est = psd(est)
    return est


def oas(C: np.ndarray, n: float) -> tuple[np.ndarray, float]:
    """Oracle approximating shrinkage (Chen et al. 2010) towards tr(C)/p · I; returns (C', rho)."""
    p = C.shape[-1]
    tr = np.trace(C)
    tr2 = np.trace(C @ C)
    num = (1 - 2 / p) * tr2 + tr**2
    den = (n + 1 - 2 / p) * (tr2 - tr**2 / p)
    rho = 1.0 if den <= 0 else float(min(1.0, num / den))
    return (1 - rho) * C + rho * tr / p * np.eye(p), rho


def ledoit_wolf(C: np.ndarray, X: np.ndarray) -> tuple[np.ndarray, float]:
    """Ledoit–Wolf shrinkage of the second moment C towards mu·I, its intensity estimated
    on sample rows X (n, p) (e.g. the store's reservoir)."""
    n, p = X.shape
    mu = np.trace(C) / p
    d2 = np.sum((C - mu * np.eye(p)) ** 2)
    b2 = np.mean([np.sum((np.outer(x, x) - C) ** 2) for x in X]) / n
    rho = float(min(1.0, b2 / d2)) if d2 > 0 else 1.0
    return (1 - rho) * C + rho * mu * np.eye(p), rho


# --- one layer, lazily ------------------------------------------------------

_COUNT = {"q": "q_count", "o": "q_count", "k": "kv_count", "v": "kv_count"}


@dataclass
class ReduceConfig:
    estimator: str = "auto"  # auto | plain | mom | trimmed ; auto = mom where tails are heavy
    trim: float = 0.1
    shrinkage: str = "oas"  # oas | lw | none ; applied when rows < shrink_below * D
    shrink_below: float = 10.0
    kurt_max: float = 3.0  # heavy-tail thresholds (stats/tails.py)
    alpha_max: float = 4.0
    gap_min: float = 2.0  # d_eff spectral gap (stats/spectrum.py)
    support_min: float = 0.5


class LayerStats:
    """One layer of a store: arrays loaded on first use, covariances and spectra cached.

    ``x`` names a statistic: q, k, v, o (second moments) or vw (the reference value
    target Σ w v vᵀ / Σ w). Every choice made is recorded in ``self.record``.
    """

    def __init__(self, view: StoreView, l: int, cfg: ReduceConfig, pending: dict | None = None):
        self.view, self.l, self.cfg = view, l, cfg
        self._pending = pending or {}  # name -> Future of the array (prefetched reads)
        self.H, self.D = view.num_kv_heads, view.head_dim
        self._a: dict[str, np.ndarray] = {}
        self._cov: dict = {}
        self._eig: dict = {}
        self._tails: dict = {}
        self.record: dict[str, Any] = {"estimator": {}, "shrinkage": {}}

    def arr(self, name: str) -> np.ndarray:
        if name not in self._a:
            f = self._pending.pop(name, None)
            self._a[name] = f.result() if f is not None else self.view.layer(self.l, [name])[name]
        return self._a[name]

    def has(self, name: str) -> bool:
        return self.view.has(self.l, name)

    def counts(self, x: str) -> np.ndarray:
        return self.arr(_COUNT[x]).astype(np.float64)  # (B,)

    def _sums(self, x: str, h: int) -> tuple[np.ndarray, np.ndarray]:
        if x == "vw":
            return self.arr("vw_gram")[:, h], self.arr("w_sum")[:, h]
        return self.arr(f"{x}_gram")[:, h], self.counts(x)

    def rows(self, x: str) -> np.ndarray | None:
        """Reservoir rows per head (H, N, D) float32 over the used blocks, or None if not stored or empty (a search
        on no rows would pick its most aggressive candidate: clip 0.5 for every head)."""
        if not self.has(f"{x}_res"):
            return None
        r = self.arr(f"{x}_res")  # (B, H, R, D)
        n = self.arr("res_count").astype(int)
        if int(n.sum()) == 0:
            return None
        return np.concatenate([r[b, :, : n[b]] for b in range(len(n))], axis=1)

    def tails(self, x: str) -> list:
        if x not in self._tails:
            if x == "vw":
                self._tails[x] = self.tails("v")
                return self._tails[x]
            n = self.counts(x).sum()
            g = self.arr(f"{x}_gram")
            s2 = np.einsum("bhdd->hd", g)
            s1, s3, s4 = (self.arr(f"{x}_{s}").sum(0) for s in ("sum", "m3", "m4"))
            kurt = excess_kurtosis(n, s1, s2, s3, s4)  # (H, D)
            rows = self.rows(x)
            c = self.cfg
            self._tails[x] = [tail_diag(kurt[h], None if rows is None else rows[h], c.kurt_max, c.alpha_max)
                              for h in range(self.H)]
        return self._tails[x]

    def estimator(self, x: str, h: int) -> str:
        e = self.cfg.estimator
        if e == "auto":
            return "mom" if self.tails(x)[h].heavy and len(self.view.blocks) >= 3 else "plain"
        return e

    def cov(self, x: str) -> np.ndarray:
        """(H, D, D) float64 second moment of x, with the per-head estimator and shrinkage."""
        if x not in self._cov:
            out = np.empty((self.H, self.D, self.D))
            est, shr = [], []
            for h in range(self.H):
                s, c = self._sums(x, h)
                e = self.estimator(x, h)
                C = reduce(s, c, e, self.cfg.trim)
                n = self.counts("q" if x == "vw" else x).sum()
                rho = 0.0
                if self.cfg.shrinkage != "none" and n < self.cfg.shrink_below * self.D:
                    if self.cfg.shrinkage == "lw" and self.rows(x if x != "vw" else "v") is not None:
                        C, rho = ledoit_wolf(C, self.rows(x if x != "vw" else "v")[h].astype(np.float64))
                    else:
                        C, rho = oas(C, n)
                out[h] = C
                est.append(e)
                shr.append(round(rho, 6))
            self._cov[x] = out
            self.record["estimator"][x] = est
            self.record["shrinkage"][x] = shr
        return self._cov[x]

    def block_covs(self, x: str) -> np.ndarray:
        """(B', H, D, D) per-block second moments (blocks with zero count dropped)."""
        if x == "vw":
            g, w = self.arr("vw_gram"), self.arr("w_sum")  # (B,H,D,D), (B,H)
            keep = (w > 0).all(1)
            return g[keep] / w[keep][:, :, None, None]
        return block_means(self.arr(f"{x}_gram"), self.counts(x))

    def mean(self, x: str) -> np.ndarray:
        return self.arr(f"{x}_sum").sum(0) / self.counts(x).sum()  # (H, D)

    def eig(self, x: str, pooled: bool = False):
        """(w (H, D) desc, U (H, D, D) columns, diags [SpectrumDiag] per head) — pruned, with d_eff
        and stability. pooled=True: one decomposition of the head-averaged matrix, repeated."""
        key = (x, pooled)
        if key not in self._eig:
            C, Bc = self.cov(x), self.block_covs(x)
            if pooled:
                U, d = analyse(C.mean(0), Bc.mean(1), self.cfg.gap_min, self.cfg.support_min)
                Us, ds = [U] * self.H, [d] * self.H
            else:
                res = [analyse(C[h], Bc[:, h], self.cfg.gap_min, self.cfg.support_min) for h in range(self.H)]
                Us, ds = [r[0] for r in res], [r[1] for r in res]
            self._eig[key] = (np.stack([d.eigvals for d in ds]), np.stack(Us), ds)
        return self._eig[key]
