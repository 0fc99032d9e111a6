"""Synthetic calibration stores with planted spectra, for tests and benches (bench/fit.py).

Written through the store format's owner (oscar.pipeline.store: an `oscar-calib/2` store
with block checksums) from generated rows, so every sum is the true sum of the rows the
reservoir was drawn from. Planted structure per layer and KV head: a random orthogonal basis and an
eigenvalue profile (rank-r signal + isotropic floor), Gaussian or Student-t rows,
an optional key mean and an optional spurious direction injected into one block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from oscar.pipeline.store import CalibStore, StoreMeta, layer_arrays

STAT_X = ("q", "k", "v", "o")
# what fit reads (`only_fit_arrays` stores hold just these: benches write GBs of them)
FIT_ONLY = ("q_gram", "o_gram", *(f"{x}_{s}" for x in STAT_X for s in ("sum", "m3", "m4", "absmax")),
            "q_res", "k_res", "v_res", "q_count", "kv_count", "nonfinite", "res_count", "qo_res_count")


@dataclass
class SynthSpec:
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 16
    num_q_heads: int = 4
    num_blocks: int = 4
    rows: int = 256  # counted rows per block and KV head (q/o rows: the same rows, see note)
    reservoir: int = 128
    rank: int = 4  # planted signal rank of every covariance
    signal: float = 10.0  # leading eigenvalue; signal eigenvalues decay geometrically by `decay`
    decay: float = 0.7
    floor: float = 0.05  # isotropic noise eigenvalue
    tail: str = "gauss"  # "gauss" | "t"
    nu: float = 3.0
    k_mean: float = 0.0  # norm of the planted key mean
    spurious: tuple[int, int, int, float] | None = None  # (layer, head, block, eigenvalue) injected into q
    unstable: tuple[tuple[int, int], ...] = ()  # (layer, head) whose q basis is redrawn every block
    only_fit_arrays: bool = False  # skip arrays fit never reads (k/v grams... kept small for benches)
    seed: int = 0
    model_name: str = "synthetic"
    fingerprint: str = "synthetic-model"
    sink: int = 4
    seq_len: int = field(init=False)

    def __post_init__(self):
        self.seq_len = self.rows + self.sink


def planted_basis(rng: np.random.Generator, d: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))


def planted_eigs(spec: SynthSpec) -> np.ndarray:
    lam = np.full(spec.head_dim, spec.floor)
    lam[: spec.rank] = spec.signal * spec.decay ** np.arange(spec.rank)
    return lam


def _rows(rng, n, U, lam, tail, nu, mean=None):
    z = rng.standard_normal((n, len(lam)))
    if tail == "t":  # multivariate Student-t, unit covariance scale: z * sqrt((nu-2)/chi2_nu)
        z = z * np.sqrt((nu - 2) / rng.chisquare(nu, size=(n, 1)))
    x = (z * np.sqrt(lam)) @ U.T
    return x + mean if mean is not None else x


def write_synthetic_store(path: str, spec: SynthSpec, progress: bool = False) -> dict:
    """Write the store; returns the planted truth {(l, h): {"U_q", "U_o", "U_k", "U_v", "lam", "k_mean"}}."""
    rng = np.random.default_rng(spec.seed)
    L, H, D, B, N, R = spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.num_blocks, spec.rows, spec.reservoir
    R = min(R, N)
    meta = StoreMeta(
        model={"name": spec.model_name, "fingerprint": spec.fingerprint, "num_layers": L,
               "num_q_heads": spec.num_q_heads, "num_kv_heads": H, "head_dim": D},
        corpus={"name": "synthetic", "fingerprint": f"synthetic-{spec.seed}", "split": "all"},
        seq_len=spec.seq_len, sink=spec.sink, num_blocks=B, seqs_per_block=1, reservoir=R,
        config={"synthetic": True, "seed": spec.seed, "tail": spec.tail, "rank": spec.rank})
    tokens = rng.integers(0, 1000, size=(B, 1, spec.seq_len), dtype=np.int32)
    st = CalibStore.create(path, meta, tokens, np.ones((B, 1, spec.seq_len), np.uint8),
                           arrays=FIT_ONLY if spec.only_fit_arrays else None)
    shapes = {n: (dtype, tail) for n, (dtype, tail) in layer_arrays(H, D, R).items() if n in st.spec}

    lam = planted_eigs(spec)
    truth = {}
    for l in range(L):
        if spec.only_fit_arrays:  # bench path: the whole layer at once, batched over blocks and heads
            arr = {n: np.zeros((B, *tail), dtype) for n, (dtype, tail) in shapes.items()}
            _fast_layer(spec, rng, arr, lam, l, truth)
            for b in range(B):
                st.write_layer(b, l, {n: a[b] for n, a in arr.items()})
            if progress:
                print(f"synthetic store: layer {l + 1}/{L}", flush=True)
            continue
        bases = {}
        for h in range(H):
            U = {x: planted_basis(rng, D) for x in STAT_X}
            mu = rng.standard_normal(D)
            mu = spec.k_mean * mu / np.linalg.norm(mu)
            bases[h] = (U, mu)
            truth[(l, h)] = {f"U_{x}": U[x] for x in STAT_X} | {"lam": lam, "k_mean": mu}
        for b in range(B):
            blk = {n: np.zeros(tail, dtype=dtype) for n, (dtype, tail) in shapes.items()}
            for h in range(H):
                U, mu = bases[h]
                if (l, h) in spec.unstable:  # same spectrum, a new leading subspace in every block
                    U = dict(U, q=planted_basis(rng, D))
                xs = {x: _rows(rng, N, U[x], lam, spec.tail, spec.nu, mu if x == "k" else None) for x in STAT_X}
                if spec.spurious and spec.spurious[:3] == (l, h, b):
                    u = rng.standard_normal(D)
                    u /= np.linalg.norm(u)
                    # a burst along one direction in this block only: pooled eigenvalue ~ spurious[3]
                    xs["q"] = xs["q"] + np.outer(rng.standard_normal(N), u) * np.sqrt(spec.spurious[3] * B)
                    truth[(l, h)]["spurious"] = u
                for x, v in xs.items():
                    blk[f"{x}_gram"][h] = v.T @ v
                    blk[f"{x}_sum"][h] = v.sum(0)
                    blk[f"{x}_m3"][h] = (v**3).sum(0)
                    blk[f"{x}_m4"][h] = (v**4).sum(0)
                    blk[f"{x}_absmax"][h] = np.abs(v).max(0)
                    blk[f"{x}_res"][h] = v[rng.choice(N, R, replace=False)]
                Cq = (U["q"] * lam) @ U["q"].T
                w = np.einsum("nd,de,ne->n", xs["k"], Cq, xs["k"])
                blk["vw_gram"][h] = (xs["v"] * w[:, None]).T @ xs["v"]
                blk["w_sum"][h] = w.sum()
            blk["q_count"][...] = N
            blk["kv_count"][...] = N
            blk["res_count"][...] = R
            blk["qo_res_count"][...] = R  # q/o reservoirs hold R rows too
            st.write_layer(b, l, blk)
        if progress:
            print(f"synthetic store: layer {l + 1}/{L}", flush=True)
    return truth


def _fast_layer(spec: SynthSpec, rng, arr: dict, lam: np.ndarray, l: int, truth: dict) -> None:
    """Gaussian rows for all (block, head) pairs of a layer in a few batched ops (benches)."""
    H, D, B, N = spec.num_kv_heads, spec.head_dim, spec.num_blocks, spec.rows
    import torch  # batched matmuls (numpy's stacked matmul on transposed views takes a slow loop)

    R = arr["q_res"].shape[2]
    for x in STAT_X:
        U = np.stack([planted_basis(rng, D) for _ in range(H)])  # (H, D, D)
        z = torch.from_numpy(rng.standard_normal((B, H, N, D)) * np.sqrt(lam))
        vt = z @ torch.from_numpy(U).transpose(-1, -2)  # (B, H, N, D)
        v = vt.numpy()
        for h in range(H):
            truth.setdefault((l, h), {"lam": lam})[f"U_{x}"] = U[h]
        if f"{x}_gram" in arr:
            arr[f"{x}_gram"][:] = (vt.transpose(-1, -2) @ vt).numpy()
        arr[f"{x}_sum"][:] = v.sum(2)
        v2 = v * v
        arr[f"{x}_m3"][:] = (v2 * v).sum(2)
        arr[f"{x}_m4"][:] = (v2 * v2).sum(2)
        arr[f"{x}_absmax"][:] = np.abs(v).max(2)
        if f"{x}_res" in arr:
            arr[f"{x}_res"][:] = v[:, :, :R].astype(np.float32)  # rows are i.i.d.: the first R are a sample
    for c in ("q_count", "kv_count"):
        arr[c][:] = N
    arr["res_count"][:] = R
    arr["qo_res_count"][:] = R
