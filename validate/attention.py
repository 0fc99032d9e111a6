"""`oscar validate attention`: attention-level needle retrieval to 128k on captured q/k/v.

NOT a model run. Where the model stops at 8k, this asks the narrower question
the INT2 cache must answer at any length: among N real keys, is a needle key
that a real query prefers still ranked first after quantization, and how far
does the attention output move?

For each sampled layer, KV head, length N and trial:
- keys/values: N rows drawn (with replacement, seeded) from the calibration
  store's reservoirs ``layers/{l}/k_res``, ``v_res`` (real post-RoPE rows of
  that head); the first `sink` positions stay exact (strict protocol);
- query: a captured row of ``layers/{l}/q_res`` (a query head of the group);
- needle: at a random position >= sink, a real key moved along q so that its
  exact logit beats the best real key by `margin` standard deviations of the
  logits; its value is another real value row;
- measured: top-1 kept (argmax of q·k̂ is the needle), relative error of the
  attention output ||ô - o|| / ||o||, the needle's attention weight exact and
  quantized.
Reads the public store format (docs/store-format.md) with zarr directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from oscar.validate import DEFAULT_METHODS
from oscar.common import OscarError


@dataclass
class AttnConfig:
    out: str
    store: str
    artifact: str | None = None
    methods: list[str] = field(default_factory=lambda: [m for m in DEFAULT_METHODS if m != "bf16"])
    lengths: list[int] = field(default_factory=lambda: [4096, 16384, 65536, 131072])
    trials: int = 8
    layers: list[int] = field(default_factory=list)  # default: 4 spread over depth
    margin: float = 1.0  # needle logit lead over the best real key, in std of the logits
    sink: int = 64
    seed: int = 0


def _open(store: str):
    import zarr

    if not os.path.exists(store):
        raise OscarError(f"calibration store {store} does not exist")
    from oscar.pipeline.store import READS, CalibStore

    g = zarr.open_group(store, mode="r")
    if g.attrs.get("format") not in READS:
        raise OscarError(f"{store}: not an oscar calibration store (format {g.attrs.get('format')!r})")
    if "checksums" in g:  # verified through the store format's owner: a damaged done block is refused
        CalibStore(store).check()
    return g


def _rows(g, l: int, name: str) -> torch.Tensor:
    """Valid reservoir rows of layer l: (Hkv, n, D) over every done block."""
    a = np.asarray(g[f"layers/{l}/{name}"][:])  # (B, Hkv, R, D)
    cnt = np.asarray(g[f"layers/{l}/res_count"][:])  # (B,)
    done = np.asarray(g["done"][:])[:, l].astype(bool) if "done" in g else np.ones(len(cnt), bool)
    parts = [a[b, :, : int(cnt[b])] for b in range(a.shape[0]) if done[b] and cnt[b] > 0]
    if not parts:
        raise OscarError(f"store has no reservoir rows for layer {l} ({name}); calibrate with --reservoir > 0")
    return torch.from_numpy(np.concatenate(parts, axis=1)).float()


def run_attention(cfg: AttnConfig, progress: bool = True):
    import pandas as pd
    from tqdm import tqdm

    from oscar.stats.artifact import load_artifact
    from oscar.validate.methods import NEEDS_ARTIFACT, LayerQuant, fitted_for, method_artifact, parse_methods, resolve_methods

    methods = parse_methods(cfg.methods)
    if cfg.artifact is None and any(m in NEEDS_ARTIFACT for m in methods):
        raise OscarError("oscar-int2 needs --artifact")
    g = _open(cfg.store)
    mi = g.attrs["model"]
    L, Hkv, D = int(mi["num_layers"]), int(mi["num_kv_heads"]), int(mi["head_dim"])
    shapes = {"num_hidden_layers": L, "num_attention_heads": int(mi["num_q_heads"]), "num_key_value_heads": Hkv,
              "head_dim": D, "hidden_size": int(mi["num_q_heads"]) * D}
    config = _ShapeConfig(shapes)
    fitted = load_artifact(cfg.artifact) if cfg.artifact else None
    if fitted is not None:
        have = (fitted.num_layers, fitted.num_kv_heads, fitted.head_dim)
        from oscar.common import model_mismatch

        fp = fitted.meta.get("model", {}).get("fingerprint")
        if have != (L, Hkv, D) or (fp and mi.get("fingerprint") and model_mismatch(fitted.meta["model"], mi, "artifact")):
            raise OscarError(f"artifact {cfg.artifact} (shapes {have}, model {fp}) was not fitted for the store's "
                             f"model (shapes {(L, Hkv, D)}, model {mi.get('fingerprint')})")
    arts, skipped = resolve_methods(methods, config, fitted, checked=False, out=cfg.out)  # unsupported: skipped
    methods = [m for m in methods if m not in skipped]
    layers = cfg.layers or sorted({0, L // 3, (2 * L) // 3, L - 1})
    bad = [l for l in layers if not 0 <= l < L]
    if bad:
        raise OscarError(f"layers {bad} out of range for a {L}-layer model")
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = []
    total = len(layers) * len(cfg.lengths) * len(methods)
    bar = tqdm(total=total, desc="attention", disable=not progress, dynamic_ncols=True)
    for l in layers:
        kp, vp, qp = _rows(g, l, "k_res"), _rows(g, l, "v_res"), _rows(g, l, "q_res")  # (Hkv, n, D)
        for N in cfg.lengths:
            idx = torch.randint(0, kp.shape[1], (Hkv, N), generator=gen)
            K = torch.gather(kp, 1, idx[..., None].expand(Hkv, N, D))  # (Hkv, N, D)
            V = torch.gather(vp, 1, torch.randint(0, vp.shape[1], (Hkv, N), generator=gen)[..., None].expand(Hkv, N, D))
            trials = []
            for t in range(cfg.trials):
                h = t % Hkv
                q = qp[h, int(torch.randint(0, qp.shape[1], (1,), generator=gen))]  # (D,)
                pos = int(torch.randint(cfg.sink, N, (1,), generator=gen))
                logits = K[h] @ q  # (N,)
                target = logits.max() + cfg.margin * logits.std()
                kr = kp[h, int(torch.randint(0, kp.shape[1], (1,), generator=gen))]
                kn = kr + (target - q @ kr) / (q @ q) * q  # needle key: q·kn = target
                vn = vp[h, int(torch.randint(0, vp.shape[1], (1,), generator=gen))]
                trials.append((h, q, pos, kn, vn))
            for m in methods:
                bar.set_postfix_str(f"layer {l} N={N} {m}")
                lq = LayerQuant(arts[m], l, pages=False)  # every non-sink key INT2 (whole groups for per-channel keys)
                G = lq.key_group
                bk = cfg.sink + (N - cfg.sink) // G * G  # keys quantize in whole groups from the sink on
                Kq, Vq = K.clone(), V.clone()
                Kq[:, cfg.sink:bk] = lq.keys(K[None, :, cfg.sink:bk])[0]  # (Hkv, N, D)
                Vq[:, cfg.sink:] = lq.values(V[None, :, cfg.sink:])[0]
                for t, (h, q, pos, kn, vn) in enumerate(trials):
                    r = trial_metrics(lq, K, V, Kq, Vq, h, q, pos, kn, vn, cfg.sink)
                    rows.append({"layer": l, "head": h, "length": N, "method": m, "trial": t, **r,
                                 "margin_std": cfg.margin, "sink": cfg.sink})
                bar.update(1)
    bar.close()
    df = pd.DataFrame(rows)
    os.makedirs(cfg.out, exist_ok=True)
    df.to_parquet(os.path.join(cfg.out, "attention.parquet"), index=False)
    return df.groupby(["method", "length"])[["top1", "out_rel_err"]].mean().reset_index()


def trial_metrics(lq, K, V, Kq, Vq, h: int, q, pos: int, kn, vn, sink: int) -> dict:
    """One needle trial on head h: K, V (Hkv, N, D) real rows; Kq, Vq their strict-protocol INT2 reading.

    Only the needle's key group and value row are re-quantized (the rest is shared across trials);
    tests check this against quantizing the planted K, V whole.
    """
    N, D = K.shape[1], K.shape[2]
    G = lq.key_group
    bk = sink + (N - sink) // G * G
    s = 1.0 / D ** 0.5
    le = K[h] @ q  # (N,) exact logits with the needle planted at pos
    le[pos] = q @ kn
    pe = torch.softmax(le * s, 0)
    o = pe @ V[h] + pe[pos] * (vn - V[h, pos])
    lh = Kq[h] @ q
    if pos < bk:
        a0 = sink + (pos - sink) // G * G
        grp = K[:, a0:a0 + G].clone()  # (Hkv, G, D); only head h is used
        grp[h, pos - a0] = kn
        lh[a0:a0 + G] = lq.keys(grp[None])[0, h] @ q
    else:  # trailing partial key group: still exact
        lh[pos] = q @ kn
    vrow = V[:, pos:pos + 1].clone()
    vrow[h, 0] = vn
    vq = lq.values(vrow[None])[0, h, 0]
    pq = torch.softmax(lh * s, 0)
    oh = pq @ Vq[h] + pq[pos] * (vq - Vq[h, pos])
    return {"top1": float(int(lh.argmax()) == pos), "out_rel_err": float((oh - o).norm() / o.norm().clamp_min(1e-12)),
            "needle_weight": float(pe[pos]), "needle_weight_int2": float(pq[pos])}


class _ShapeConfig:
    """The store model's attention shapes as a config object (for the baseline methods' identity artifacts)."""

    def __init__(self, d: dict):
        self.__dict__.update(d)

    def to_dict(self):
        return dict(self.__dict__)
