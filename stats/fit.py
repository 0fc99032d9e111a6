"""`oscar fit`: calibration store -> rotation artifact, streaming one layer at a time.

Per layer: reduce blocks to covariances (robust where tails are heavy), eigendecompose,
d_eff + spurious pruning + stability, build the variant's rotations, fall back to
Hadamard for heads whose leading subspace is unstable across blocks, search clip
thresholds on rotated reservoir rows, record every choice in the metadata.
"""

from __future__ import annotations

import ctypes
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from oscar.common import OscarError
from oscar.constraints import quant_problems
from oscar.stats.artifact import Artifact, QuantConfig
from oscar.stats.clip import ClipSearch, reservoir_rows, search_layer
from oscar.stats.hadamard import hadamard, supported as hadamard_supported
from oscar.stats.reduce import ESTIMATORS, LayerStats, ReduceConfig, open_store, prefetch
from oscar.stats.rotations import Rotations, get_variant, hadamard_rot
from oscar.stats.split import fit_split_keys, layer_inputs, part_clips


@dataclass
class FitConfig:
    variant: str = "oscar"
    quant: QuantConfig = field(default_factory=QuantConfig)
    reduce: ReduceConfig = field(default_factory=ReduceConfig)
    clip: bool = True  # search clip thresholds (else 1.0 / max|x|)
    clip_ratios: tuple[float, ...] = tuple(np.round(np.arange(0.5, 1.0001, 0.05), 4))  # minmax, coarse (refined ±0.025)
    clip_fracs: tuple[float, ...] = tuple(np.round(np.arange(0.04, 1.0001, 0.04), 4))  # static: × max|x|, coarse
    per_head_gain: float = 0.02  # per-head clips only if they cut the layer's error by > 2 %
    clip_rows: int = 1024  # reservoir rows per head used by the search (K and V share them)
    clip_queries: int = 128
    stability_min: float = 0.5  # median mean-cos² of the leading subspace across blocks
    fallback: str = "hadamard"  # rotation for an unstable head: hadamard | none
    partial: bool = False
    # Fit the first N done blocks only (None: all): how a budget study fits prefixes of one calibration
    # (bench/calib_budget.py); the artifact's provenance lists the blocks used.
    blocks: int | None = None
    seed: int = 0
    progress: bool = True
    threads: int | None = None  # torch intra-op threads for the clip search (None: leave as is)

    def __post_init__(self):
        get_variant(self.variant)  # unknown variant: OscarError listing the valid ones
        if self.reduce.estimator not in ESTIMATORS + ("auto",):
            raise OscarError(f"unknown estimator {self.reduce.estimator!r}; valid: auto, {', '.join(ESTIMATORS)}")
        if self.fallback not in ("hadamard", "none"):
            raise OscarError(f"unknown fallback {self.fallback!r}; valid: hadamard, none")


def _release_memory() -> None:
    """Hand freed heap pages back to the OS after each layer: glibc keeps them, and the RSS of a
    92-layer fit grew ~15 MB per layer from fragmentation alone (measured, see docs/decisions/0030-fit-streaming-memory-prefetch-and-malloc-trim.md)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fallbacks(rot: Rotations, ls: LayerStats, cfg: FitConfig, l: int, drops_keys: bool = False) -> list[dict]:
    """Replace the rotation of heads whose source eigenbasis is unstable; return the records. drops_keys (a
    format that does not store some key directions, QuantConfig.key_drop): unstable key heads keep their eigenbasis,
    recorded, since a Hadamard would spread every direction over the not-stored channels and drop part of each."""
    out = []
    if cfg.fallback == "none" or not hadamard_supported(ls.D):
        return out
    had = hadamard_rot(1, ls.D)[0]
    for side, src in (("k", rot.source_k), ("v", rot.source_v)):
        if src is None:
            continue
        if side == "k" and drops_keys:
            diags = ls.eig(*src)[2]
            out += [{"layer": l, "head": h, "side": "k", "to": "kept", "source": src[0],
                     "reason": f"C_{src[0]} subspace unstable (median mean cos² {diags[h].stability:.3f} < "
                               f"{cfg.stability_min}), kept: the format does not store key_drop directions"}
                    for h in range(ls.H) if diags[h].stability < cfg.stability_min]
            continue
        diags = ls.eig(*src)[2]
        R = rot.rot_k if side == "k" else rot.rot_v
        heads = [h for h in range(ls.H) if not (diags[h].stability >= cfg.stability_min)
                 and not math.isnan(diags[h].stability)]
        if src[1] and heads:  # shared rotation: all heads or none
            heads = list(range(ls.H))
        for h in heads:
            d = diags[h]
            R[h] = had
            if side == "k" and rot.rot_q is not None:
                rot.rot_q[h] = had
            out.append({"layer": l, "head": h, "side": side, "to": "hadamard", "source": src[0],
                        "reason": f"leading {d.k_stab}-dim subspace of C_{src[0]} unstable across blocks: "
                                  f"median mean cos² {d.stability:.3f} < {cfg.stability_min} "
                                  f"(median max angle {d.max_angle_deg:.1f}°)"})
    return out


@dataclass
class _Format:
    """The cache format the artifact is fitted for (the variant's own, or the one asked for)."""

    quant: QuantConfig
    fixed: Any  # the variant's fixed format and clip ratios (oscar-ref), else None
    search: ClipSearch  # the clip search at head_dim D: the format's quantizers, the model's attention scale, grids


def _format(store_path: str, view, variant, cfg: FitConfig) -> _Format:
    """The format, refused before any fitting when the cache could not serve it at the store's head_dim."""
    D = view.head_dim
    if variant.name not in ("random", "identity") and not hadamard_supported(D):
        hadamard(D)  # raises the OscarError naming the alternatives
    fixed = variant.fixed  # a variant with its own format and fixed clip ratios (oscar-ref)
    quant = fixed.quant(cfg.quant) if fixed else cfg.quant
    if variant.fmt:  # a variant that only makes sense for its own format (split)
        quant = variant.fmt(quant, D)
    if quant.key_split and variant.name != "split":
        raise OscarError(f"quant.key_split={quant.key_split} needs the split variant's rotation (each key part mixed "
                         f"within itself); variant {variant.name!r} mixes all channels: use --variant split")
    probs = quant_problems(D, quant)  # what the cache will require of this artifact, before any fitting
    if probs:
        raise OscarError(f"{store_path}: the cache format asked for (bits {quant.bits}, group_size {quant.group_size}, "
                         f"keys per {quant.key_axis}, pages of {quant.page_size}) cannot serve head_dim {D}: "
                         f"{'; '.join(probs)}")
    scale = float(view.attrs.get("model", {}).get("attn_scale") or D**-0.5)
    search = ClipSearch(quant.key_spec(D), quant.value_spec(D), scale, np.array(cfg.clip_ratios),
                        np.array(cfg.clip_fracs), cfg.per_head_gain, cfg.clip_rows, cfg.clip_queries)
    return _Format(quant, fixed, search)


def _clips(ls: LayerStats, rot: Rotations, cfg: FitConfig, fmt: _Format, l: int):
    """Clip thresholds of one layer, searched in the rotated space: (clip_k (H,), clip_v (H,), metadata)."""
    H, fixed, quant = ls.H, fmt.fixed, fmt.quant
    Rk, Rv = rot.rot_k, rot.rot_v  # (H, D, D)
    Rq = rot.rot_q if rot.rot_q is not None else Rk  # queries are read in the space dual to the keys'
    q, k, v = ls.rows("q"), ls.rows("k"), ls.rows("v")
    meta_clip = {}
    if fixed:
        ck_t, cv_t = np.full(H, fixed.clip_k), np.full(H, fixed.clip_v)
        meta_clip = {"searched": False, "fixed": {"rule": quant.clip_rule, "k": fixed.clip_k, "v": fixed.clip_v}}
    elif cfg.clip and q is not None and k is not None and v is not None:
        T = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))
        kc = T(k) - (T(rot.k_mean)[:, None, :] if rot.k_mean is not None else 0.0)
        q_r, k_r, v_r = ((x @ T(R)).numpy() for x, R in ((T(q), Rq), (kc, Rk), (T(v), Rv)))  # (H, N, D)
        Cq_r = (T(Rq).transpose(-1, -2) @ T(ls.cov("q")) @ T(Rq)).numpy()  # (H, D, D)
        split = bool(quant.key_split)
        ck, cv = search_layer(q_r, k_r, v_r, Cq_r, fmt.search, seed=cfg.seed + l, keys=not split)
        cv_t = cv.clip
        if split:  # each key part its own clip (H, 2), on the same rows as the search

            rows = reservoir_rows(k_r.shape[1], cfg.clip_rows, np.random.default_rng(cfg.seed + l))
            clip2, err = part_clips(T(k_r[:, rows]), T(Cq_r), quant.key_parts(ls.D), np.array(cfg.clip_ratios),
                                    cfg.per_head_gain)
            ck_t = clip2.numpy().astype(np.float64)
            meta_clip["k"] = {"per_part": True, "err": [round(float(e), 6) for e in err]}
        else:
            ck_t = ck.clip
        for side, c in (("k", ck), ("v", cv)):
            if c is None:
                continue
            meta_clip[side] = {"per_head": c.per_head, "gain_per_head": round(c.gain_per_head, 5),
                               "err": [round(float(e), 6) for e in c.err],
                               "err_noclip": [round(float(e), 6) for e in c.err_noclip]}
    else:
        if cfg.clip and cfg.quant.mode == "static":
            raise OscarError("static mode needs clip thresholds, but the store has no reservoir rows "
                             "(layers/{l}/{q,k,v}_res)")
        ck_t = np.ones((H, 2)) if quant.key_split else np.ones(H)
        cv_t = np.ones(H)
        meta_clip = {"searched": False}
    return ck_t, cv_t, meta_clip


@dataclass
class _LayerFit:
    """One layer's artifact tensors (float32) and its metadata record."""

    rot_k: torch.Tensor  # (H, D, D)
    rot_v: torch.Tensor  # (H, D, D)
    rot_q: torch.Tensor | None  # (H, D, D), variants that rotate queries by another matrix
    k_mean: torch.Tensor | None  # (H, D), variants that centre keys
    clip_k: torch.Tensor  # (H,)
    clip_v: torch.Tensor  # (H,)
    eig_k: torch.Tensor  # (H, D) eigenvalues of the keys' rotation source
    eig_v: torch.Tensor  # (H, D)
    meta: dict
    fallbacks: list[dict]
    eig_order: str


def _place_split(ls: LayerStats, rot: Rotations, cfg: FitConfig, fmt: _Format, l: int) -> dict:
    """The split variant's key rotation: the wide part placed by the rule of lower calibrated key error
    (stats/split.py), on the rows the clip search uses. Returns the record."""
    k = ls.rows("k")
    if k is None:
        raise OscarError(f"variant split places its wide key channels on the store's reservoir keys; layer {l} has none")
    rows = reservoir_rows(k.shape[1], cfg.clip_rows, np.random.default_rng(cfg.seed + l))
    kc = torch.from_numpy(np.ascontiguousarray(k[:, rows], dtype=np.float64)) - torch.from_numpy(rot.k_mean)[:, None, :]
    U, lam, sig2 = layer_inputs(ls, rot.k_mean)
    sf = fit_split_keys(U, lam, sig2, kc, ls.cov("q"), fmt.quant.key_parts(ls.D), np.array(cfg.clip_ratios),
                        per_head_gain=cfg.per_head_gain)
    rot.rot_k, rot.rot_q = sf.rot_k.numpy(), sf.rot_q.numpy()
    return {"rule": sf.rule, "err_by_rule": {r: round(e, 6) for r, e in sf.errs.items()}}


def _fit_layer(ls: LayerStats, l: int, cfg: FitConfig, variant, fmt: _Format, rng) -> _LayerFit:
    rot = variant.build(ls, rng)
    split = _place_split(ls, rot, cfg, fmt, l) if rot.notes.get("split") else None
    fb = _fallbacks(rot, ls, cfg, l, drops_keys=bool(fmt.quant.key_drop))
    # diagnostics always on C_Q and C_S (whatever the variant uses)
    wq, _, dq = ls.eig("q")
    wo, _, do = ls.eig("o")
    src_k = ls.eig(*rot.source_k) if rot.source_k else (wq, None, dq)
    src_v = ls.eig(*rot.source_v) if rot.source_v else (wo, None, do)
    ck_t, cv_t, meta_clip = _clips(ls, rot, cfg, fmt, l)
    tails = {x: ls.tails(x) for x in ("q", "o", "k", "v") if ls.has(f"{x}_gram")}
    meta = {
        "d_eff": {"k": [d.d_eff for d in src_k[2]], "v": [d.d_eff for d in src_v[2]],
                  "q": [d.d_eff for d in dq], "o": [d.d_eff for d in do]},
        "d_gap_raw": {"q": [d.d_gap_raw for d in dq], "o": [d.d_gap_raw for d in do]},
        "pruned": {"q": [d.pruned for d in dq], "o": [d.pruned for d in do]},
        "stability": {"q": [round(d.stability, 5) for d in dq], "o": [round(d.stability, 5) for d in do],
                      "k_src": [round(d.stability, 5) for d in src_k[2]],
                      "v_src": [round(d.stability, 5) for d in src_v[2]]},
        "kurtosis": {x: [round(t.kurtosis, 4) for t in ts] for x, ts in tails.items()},
        "tail_index": {x: [round(t.alpha, 4) for t in ts] for x, ts in tails.items()},
        "heavy": {x: [t.heavy for t in ts] for x, ts in tails.items()},
        "estimator": ls.record["estimator"],
        "shrinkage": ls.record["shrinkage"],
        "clip": meta_clip,
        **({"split": split} if split else {}),
        "clip_k": np.round(np.asarray(ck_t, dtype=np.float64), 6).tolist(),  # (H,), or (H, 2) split keys
        "clip_v": [round(float(c), 6) for c in cv_t],
    }
    return _LayerFit(
        rot_k=torch.from_numpy(rot.rot_k).float(), rot_v=torch.from_numpy(rot.rot_v).float(),
        rot_q=torch.from_numpy(rot.rot_q).float() if rot.rot_q is not None else None,
        k_mean=torch.from_numpy(rot.k_mean).float() if rot.k_mean is not None else None,
        clip_k=torch.from_numpy(np.asarray(ck_t)).float(), clip_v=torch.from_numpy(np.asarray(cv_t)).float(),
        eig_k=torch.from_numpy(np.asarray(rot.notes.get("eig_k", src_k[0]))).float(),
        eig_v=torch.from_numpy(np.asarray(rot.notes.get("eig_v", src_v[0]))).float(),
        meta=meta, fallbacks=fb, eig_order=rot.notes.get("eig_order", "descending"))


def _metadata(store_path: str, view, cfg: FitConfig, variant, fixed, layers: list[_LayerFit], t0: float) -> dict:
    """The artifact's metadata: the fit's settings, the store's provenance, every layer's record."""
    q_count = view.read("layers/0/q_count")
    kv_count = view.read("layers/0/kv_count")
    tokens = int(view.read("mask").sum()) if view.store.has("mask") else None
    layers_meta = [f.meta for f in layers]
    return {
        "variant": cfg.variant,
        "variant_doc": variant.doc,
        "model": dict(view.model),
        "fit": {"reduce": asdict(cfg.reduce), "stability_min": cfg.stability_min, "fallback": cfg.fallback,
                "per_head_gain": cfg.per_head_gain, "clip_searched": bool(cfg.clip) and not fixed, "seed": cfg.seed,
                "eig_order": layers[-1].eig_order if layers else "descending",
                "clip_objective": {"k": "relative q-weighted logit MSE", "v": "relative attention-output MSE"},
                "seconds": round(time.perf_counter() - t0, 3)},
        "provenance": {"store": store_path, "store_fingerprint": view.fingerprint,
                       "corpus": view.attrs.get("corpus"), "blocks": view.blocks,
                       "num_blocks": int(view.attrs.get("num_blocks", len(view.blocks))), "partial": view.partial,
                       "tokens": tokens, "seq_len": int(view.attrs["seq_len"]),  # tokens per calibration window
                       # absolute positions the statistics cover (windows read at offsets: pipeline.calibrate)
                       "positions": int((view.attrs.get("config") or {}).get("positions") or view.attrs["seq_len"]),
                       "counted_q_rows_layer0": int(np.sum(q_count)),
                       "counted_kv_rows_layer0": int(np.sum(kv_count))},
        "d_eff": {"k": [m["d_eff"]["k"] for m in layers_meta], "v": [m["d_eff"]["v"] for m in layers_meta]},
        "fallbacks": [r for f in layers for r in f.fallbacks],
        "layers": layers_meta,
    }


def fit(store_path: str, cfg: FitConfig | None = None) -> Artifact:
    cfg = cfg or FitConfig()
    t0 = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    view = open_store(store_path, partial=cfg.partial, log=_log)
    if cfg.blocks is not None:
        if not 1 <= cfg.blocks <= len(view.blocks):
            raise OscarError(f"--blocks {cfg.blocks}: {store_path} has {len(view.blocks)} done block(s); "
                             f"pass 1..{len(view.blocks)}")
        view.blocks = view.blocks[:cfg.blocks]
    variant = get_variant(cfg.variant)
    L = view.num_layers
    fmt = _format(store_path, view, variant, cfg)
    rng = np.random.default_rng(cfg.seed)

    layers: list[_LayerFit] = []
    it = range(L)
    if cfg.progress:
        it = tqdm(it, desc=f"fit {cfg.variant}", unit="layer", file=sys.stderr)

    pool = ThreadPoolExecutor(4)  # reads of layer l + 1 run while layer l is fitted (2 layers in memory)
    nxt = prefetch(view, pool, 0)
    for l in it:
        cur, nxt = nxt, (prefetch(view, pool, l + 1) if l + 1 < L else {})
        layers.append(_fit_layer(LayerStats(view, l, cfg.reduce, pending=cur), l, cfg, variant, fmt, rng))
        del cur
        _release_memory()
    pool.shutdown()
    meta = _metadata(store_path, view, cfg, variant, fmt.fixed, layers, t0)
    n_had = sum(r["to"] == "hadamard" for r in meta["fallbacks"])
    if n_had:
        _log(f"fit: {n_had} head rotation(s) fell back to Hadamard (see metadata 'fallbacks')")
    if len(meta["fallbacks"]) > n_had:
        _log(f"fit: {len(meta['fallbacks']) - n_had} unstable key head(s) kept their eigenbasis (the format drops key "
             "directions; see metadata 'fallbacks')")

    extra = {}
    for l, f in enumerate(layers):
        extra[f"layers.{l}.eig_k"] = f.eig_k
        extra[f"layers.{l}.eig_v"] = f.eig_v
    rot_q = [f.rot_q for f in layers if f.rot_q is not None]
    k_mean = [f.k_mean for f in layers if f.k_mean is not None]
    art = Artifact(rot_k=[f.rot_k for f in layers], rot_v=[f.rot_v for f in layers], rot_q=rot_q or None,
                   clip_k=[f.clip_k for f in layers], clip_v=[f.clip_v for f in layers], k_mean=k_mean or None,
                   quant=fmt.quant, meta=meta, extra=extra)
    art.validate()
    return art
