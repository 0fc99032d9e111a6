"""`oscar validate latent-attention`: the attention-level test of an MLA model's INT2 latent cache.

NOT a needle run. On held-out text (validate/heldout.py, checked disjoint from the store's calibration tokens) the
model runs once; per layer its own attention inputs are recorded: the queries (RoPE applied), the latents (the
kv_a_layernorm output), the RoPE keys and the mask (the DSA top-k applied as the model applies it). Each variant's
latent artifact (fitted from the same store: the attention-aware fit, the public OSCAR reference, Hadamard alone,
identity) then reads the history [sink, T - recent) from INT2 (kernels/latent.py), and per layer and sequence:

    score error   ||(q̃ R)·(ĉ_rot - c_rot)||² / ||q̃·c||²   over every query and history key, every head: the error
                  of the logits' latent part relative to it (k_pe is exact, its part cancels)
    value error   ||P (Ĉ - C) W_UVᵀ||² / ||P C W_UVᵀ||²   with the exact attention P: the value path alone
    output error  ||ô - o||² / ||o||²   the o_proj input read in the absorbed form from the INT2 cache, P included

Each is a sum over (query, head) pairs, so a layer-sequence pair is one unit; the summary gives each variant's mean
relative error with a 95 % interval over units, and the attention-aware fit against the reference paired by unit
(the ratio of their errors, a t-interval on its log). Writes DIR/latent_attention.parquet (one row per variant,
layer and sequence) and DIR/latent_attention.json.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import torch
from scipy import stats as sps

from oscar.common import OscarError, config_fingerprint
from oscar.kernels.latent import LatentLayerQuant, absorbed_attention, up_projections
from oscar.pipeline import capture as C
from oscar.pipeline.models import load_model
from oscar.pipeline.store import open_verified
from oscar.stats.latent import LatentFitConfig, fit_latent
from oscar.stats.rotations import LATENT_VARIANTS
from oscar.validate.heldout import check_disjoint, heldout_sequences


@dataclass
class LatentAttnConfig:
    store: str                        # the latent store the variants are fitted on
    out: str
    model: str | None = None          # default: the store's
    seq_len: int = 512
    sequences: int = 2
    variants: list[str] = field(default_factory=lambda: list(LATENT_VARIANTS))
    sink: int | None = None           # default: the artifact's (64 / 256 at the deployed layout)
    recent: int | None = None

    def __post_init__(self):
        unknown = [v for v in self.variants if v not in LATENT_VARIANTS]
        if unknown:
            raise OscarError(f"unknown latent variant(s) {unknown}; valid: {', '.join(LATENT_VARIANTS)}")
        if self.seq_len < 2 or self.sequences < 1:
            raise OscarError(f"--seq-len must be >= 2 and --sequences >= 1, got {self.seq_len}, {self.sequences}")


def layer_errors(rec: dict, lq: LatentLayerQuant, sink: int, recent: int) -> dict[str, float]:
    """The three relative errors of one recorded layer (one sequence) under one variant's latent format."""
    m = rec["module"]
    w_uk, w_uv = up_projections(m.kv_b_proj.weight.detach().float(), m.num_heads, m.qk_nope_head_dim, m.v_head_dim)
    c = rec["c"][0].float()                                                          # (T, r)
    T = c.shape[0]
    b = lq.quantized_until(T, sink, recent)
    exact = (c - lq.mean) @ lq.rot                                                   # (T, r) rotated, centred
    cq = torch.cat([exact[:sink], lq.rotated(c[sink:b]), exact[b:]])                 # what the cache stores, decoded
    q, kp, mask, scale = rec["q"].float(), rec["k_pe"].float(), rec["mask"], rec["scale"]
    nope = m.qk_nope_head_dim
    qa = torch.einsum("bhtd,hdr->bhtr", q[..., :nope], w_uk)                         # (1, H, T, r) absorbed queries
    hist = slice(sink, b)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[:, hist]                      # (T, n) keys a query reads
    s_e = qa @ c[hist].T                                                             # (1, H, T, n) the latent part
    s_d = (qa @ lq.rot) @ (cq[hist] - exact[hist]).T                                 # its INT2 error (rotated)
    score = float((s_d.square() * causal).sum() / (s_e.square() * causal).sum().clamp_min(1e-30))
    out_e = absorbed_attention(q, exact[None], kp, w_uk, w_uv, lq.rot, lq.mean, scale, mask)     # (1, T, H, v)
    out_q = absorbed_attention(q, cq[None], kp, w_uk, w_uv, lq.rot, lq.mean, scale, mask)
    # the exact attention's probabilities over the value path alone: P (Ĉ - C) W_UVᵀ against P C W_UVᵀ
    d_lat = absorbed_attention(q, (cq - exact)[None], kp, w_uk, w_uv, lq.rot, torch.zeros_like(lq.mean), scale, mask,
                               probs_from=exact[None])
    val = float(d_lat.square().sum() / out_e.square().sum().clamp_min(1e-30))
    out = float((out_q - out_e).square().sum() / out_e.square().sum().clamp_min(1e-30))
    return {"score_err": score, "value_err": val, "output_err": out, "history": b - sink, "tokens": T}


def record_layers(model, seqs: list[np.ndarray]) -> list[list[dict]]:
    """Per sequence, per layer: the attention's own inputs (queries, latents, RoPE keys, mask, scale)."""
    out = []
    for s in seqs:
        cap = C.LatentRowCapture()
        ids = torch.from_numpy(np.asarray(s, dtype=np.int64))[None]
        with cap.batch(torch.ones_like(ids)):
            C.base_model(model)(input_ids=ids, use_cache=False)
        out.append(cap.rows)
    return out


def _interval(x: np.ndarray) -> tuple[float, float, float]:
    """Mean and 95 % t-interval over units."""
    n = len(x)
    m = float(np.mean(x))
    if n < 2:
        return m, float("nan"), float("nan")
    h = float(sps.t.ppf(0.975, n - 1) * np.std(x, ddof=1) / math.sqrt(n))
    return m, m - h, m + h


def summarize(df: pd.DataFrame) -> dict:
    out: dict = {"variants": {}}
    for v, g in df.groupby("variant", sort=False):
        out["variants"][v] = {k: dict(zip(("mean", "lo", "hi"), _interval(g[k].to_numpy())))
                              for k in ("score_err", "value_err", "output_err")} | {"units": len(g)}
    if {"attention", "reference"} <= set(df["variant"]):
        a = df[df.variant == "attention"].set_index(["layer", "sequence"])
        r = df[df.variant == "reference"].set_index(["layer", "sequence"]).loc[a.index]
        out["attention_vs_reference"] = {}
        for k in ("score_err", "value_err", "output_err"):
            lr = np.log(a[k].to_numpy() / r[k].to_numpy())
            m, lo, hi = _interval(lr)
            verdict = "UNRESOLVED" if not (hi < 0 or lo > 0) else ("attention lower" if hi < 0 else "reference lower")
            out["attention_vs_reference"][k] = {"ratio": math.exp(m), "lo": math.exp(lo) if lo == lo else None,
                                                "hi": math.exp(hi) if hi == hi else None, "verdict": verdict}
    return out


def run_latent_attention(cfg: LatentAttnConfig) -> dict:
    st = open_verified(cfg.store)
    if not st.meta.latent:
        raise OscarError(f"{cfg.store} is a per-head store ({st.meta.format}): `oscar validate attention` tests it")
    model_spec = cfg.model or st.meta.model["source"]
    model, tok, info = load_model(model_spec, attn_implementation="eager", latent=True)
    if info.config_fingerprint != st.meta.model.get("config_fingerprint"):
        raise OscarError(f"model {model_spec!r} (config {info.config_fingerprint}) is not the store's "
                         f"{st.meta.model.get('name')!r} (config {st.meta.model.get('config_fingerprint')})")
    held = heldout_sequences(tok, cfg.seq_len * cfg.sequences, cfg.seq_len)
    seqs = [s for s in held.seqs if len(s) == cfg.seq_len][: cfg.sequences] or held.seqs[:1]
    disjoint = check_disjoint(seqs, st.group["tokens"][:], st.group["mask"][:])
    arts = {v: fit_latent(cfg.store, LatentFitConfig(variant=v)) for v in cfg.variants}
    C.install(model, "eager")
    rows = record_layers(model, seqs)
    recs = []
    for v, art in arts.items():
        sink = art.quant.sink if cfg.sink is None else cfg.sink
        recent = art.quant.recent if cfg.recent is None else cfg.recent
        for si, layers in enumerate(rows):
            for rec in layers:
                lq = LatentLayerQuant(art, rec["layer"])
                recs.append({"variant": v, "layer": rec["layer"], "sequence": si,
                             **layer_errors(rec, lq, sink, recent)})
    df = pd.DataFrame(recs)
    os.makedirs(cfg.out, exist_ok=True)
    df.to_parquet(os.path.join(cfg.out, "latent_attention.parquet"), index=False)
    summary = {"config": asdict(cfg), "model": info.name, "config_fingerprint": config_fingerprint(model.config),
               "heldout": held.info, "disjoint": disjoint, **summarize(df)}
    with open(os.path.join(cfg.out, "latent_attention.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return summary
