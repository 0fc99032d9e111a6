"""Model-level codebook cache formats: TurboQuant (`tq-int2`) and SpectralQuant, uniform allocation (`sq-int2`).

The synthetic ablation's TQ and SQ codecs (validate/ablation/schemes.py) as cache formats the model-level
simulator (`kernels.simulate.LayerQuant`, through `register_codec`) runs like every other method. The quantizers are the
same functions (`schemes.lloyd_max`, `codebook_quant`, `allocate`, `d_eff_gap`); what is added
here is the per-layer, per-KV-head layout and the calibration statistics, read from the same
calibration store as oscar-int2 (the artifact's provenance), so every method sees the same data.

tq-int2  TurboQuant (Zandieh et al. 2025) with its 2.5-bit recipe: the D/4 channels with the most
         calibrated (centred) energy are the outlier set, quantized at 3 bits; the other 3D/4 at 2 bits
         (the paper: 32 of 128 channels). Each set is its own TQ instance: random-sign Walsh–Hadamard
         rotation diag(s) H (seeded signs), fp16 norm of the sub-vector, Beta(d) Lloyd–Max codes of its
         unit direction (d = the set's size). Laid out as one orthogonal rotation per head,
         rot = P · blockdiag(diag(s1) H_{D/4}, diag(s2) H_{3D/4}), P moving the outlier channels first;
         in the rotated space the first D/4 coordinates are the 3-bit instance. Keys are centred by
         the calibrated key mean first (the format carries it: q·μ is a per-head constant).
         Storage: (D/4·3 + 3D/4·2 + 2·16) / D bits per element = 2.75 at D = 64 (2.5 at D = 128).
         No clip search: a Lloyd–Max codebook is already the MSE-optimal quantizer of its density.
sq-int2  SpectralQuant with uniform allocation: per KV head, the eigenbasis U of the centred
         covariance (keys C_K − μμᵀ, values C_V − μ_vμ_vᵀ), d_eff leading dims by spectral gap sharing
         the budget equally (remainder to the leading dims), the tail at 1 bit, per-dim Gaussian
         Lloyd–Max codes scaled by the calibrated std; no per-token metadata: exactly 2 bits/element.
         No clip search (same reason); centring both K and V is part of its format (means are constants).

Per-layer widths keep oscar-int2's artifact (rotations, key mean, clips) and change each layer's widths:
codec "layers", oscar-int2's grid at (key, value) widths per layer chosen on a table measured through the
model (the copy probe, validate/tune.py) within oscar-int2's mean bits (`layer_artifact`, `layer_widths`);
`native_layer_artifact` converts it to the cache's own per-layer format.

Artifact layout: rot_k / rot_v / k_mean as usual; meta["codec"] names the format; SQ's per-head
v_mean, std and widths go to `extra` (layers.{l}.{v_mean,std_k,std_v,widths_k,widths_v}).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import math
from dataclasses import replace

import numpy as np
import torch

from oscar.common import TIE_REL, OscarError
from oscar.kernels.simulate import register_codec
from oscar.quant import FP8_PARAM, QuantSpec, fake_quant
from oscar.stats.artifact import Artifact, QuantConfig
from oscar.stats.reduce import LayerStats, ReduceConfig, open_store
from oscar.validate.ablation.schemes import allocate, codebook_quant, d_eff_gap, eigbasis, hadamard
from oscar.validate.ablation.schemes import spec as any_bits_spec

CODECS = ("tq", "sq", "layers")
TQ_HI_BITS, TQ_LO_BITS = 3, 2
SQ_BITS, SQ_TAIL_BITS, SQ_GAP = 2, 1, 4.0
COPY_OPTIONS = ((2, 2), (3, 2), (4, 2))  # `oscar validate widths`: keys at 2 / 3 / 4 bits, values at 2 (the cache's formats)


# ----------------------------------------------------------------- the quantizers (torch references)


def tq_fake_quant(y: torch.Tensor, segments: list[tuple[int, int, int]]) -> torch.Tensor:
    """TurboQuant round trip of rotated rows y (..., D): per segment [a, b) at `bits`, the fp16 norm
    of y[..., a:b] times the nearest Beta(b - a) Lloyd–Max level of each coordinate of its direction."""
    out = torch.empty_like(y)
    for a, b, bits in segments:
        seg = y[..., a:b]
        nrm = seg.norm(dim=-1, keepdim=True).to(torch.float16).to(y.dtype)  # (..., 1) stored fp16
        _, uq = codebook_quant(seg / nrm.clamp_min(1e-12), bits, "beta", b - a)
        out[..., a:b] = uq * nrm
    return out


def sq_fake_quant(y: torch.Tensor, widths: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """SpectralQuant round trip of eigen-coordinates y (B, Hkv, T, D): dim j of head h at widths[h, j]
    bits, the nearest Gaussian Lloyd–Max level of y / std[h, j], times std (0 bits: the mean, 0)."""
    out = torch.zeros_like(y)
    for h in range(y.shape[1]):
        for bits in widths[h].unique().tolist():
            if bits == 0:
                continue
            cols = (widths[h] == bits).nonzero().flatten()
            s = std[h, cols].to(y.dtype)
            _, v = codebook_quant(y[:, h][..., cols] / s, int(bits), "gaussian")
            out[:, h, :, cols] = v * s
    return out


@dataclass
class LayerCodec:
    """One layer's codebook format for keys or values, applied in the rotated space (B, Hkv, T, D)."""

    kind: str  # tq | sq | uniform (oscar.quant's grid under `spec`)
    segments: list[tuple[int, int, int]] | None = None  # tq
    widths: torch.Tensor | None = None  # sq (Hkv, D) int64
    std: torch.Tensor | None = None  # sq (Hkv, D)
    spec: QuantSpec | None = None  # uniform
    clip: torch.Tensor | None = None  # uniform: (Hkv, 1, 1) ratio per head


    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        if self.kind == "tq":
            return tq_fake_quant(y, self.segments)
        if self.kind == "uniform":
            return fake_quant(y, self.spec, self.clip)
        return sq_fake_quant(y, self.widths, self.std)

    def bits_per_element(self, D: int) -> float:
        if self.kind == "tq":
            return (sum((b - a) * bits for a, b, bits in self.segments) + 16 * len(self.segments)) / D
        if self.kind == "uniform":
            return self.spec.bits_per_element(D)
        return float(self.widths.double().mean())


def layer_codecs(art: Artifact, layer: int) -> tuple[LayerCodec, LayerCodec, torch.Tensor | None] | None:
    """(key codec, value codec, value mean (1, Hkv, 1, D) or None) of a codebook artifact; None otherwise."""
    c = art.meta.get("codec")
    if not c:
        return None
    if c.get("kind") not in CODECS:
        raise OscarError(f"artifact codec {c.get('kind')!r} is unknown; known: {', '.join(CODECS)}")
    if c["kind"] == "tq":
        seg = [tuple(s) for s in c["segments"]]
        return LayerCodec("tq", segments=seg), LayerCodec("tq", segments=seg), None
    if c["kind"] == "layers":  # per-layer widths: oscar-int2's format at each layer's own widths
        kb, vb = c["widths"][layer]
        side = lambda bits, clip, name: LayerCodec("uniform", spec=_layer_spec(art, bits), clip=_head_clip(clip, name))  # noqa: E731
        return side(kb, art.clip_k[layer], "clip_k"), side(vb, art.clip_v[layer], "clip_v"), None
    x = art.extra
    ck = LayerCodec("sq", widths=x[f"layers.{layer}.widths_k"].long(), std=x[f"layers.{layer}.std_k"].float())
    cv = LayerCodec("sq", widths=x[f"layers.{layer}.widths_v"].long(), std=x[f"layers.{layer}.std_v"].float())
    return ck, cv, x[f"layers.{layer}.v_mean"].float()[None, :, None, :]


def _head_clip(c: torch.Tensor, name: str) -> torch.Tensor:
    if c.dim() != 1:
        raise OscarError(f"per-layer widths take per-head clip ratios; {name} has shape {tuple(c.shape)}")
    return c.float().view(-1, 1, 1)


def _layer_spec(art: Artifact, bits: int) -> QuantSpec:
    """Per-layer widths' per-token grid at `bits`: fp8 scale/zero at the base width (what pays for the
    wider layers), fp16 above it."""
    vs = art.quant.value_spec(art.head_dim)
    return replace(vs, bits=bits, param_dtype=FP8_PARAM) if bits == art.quant.bits else any_bits_spec(
        bits, group_size=vs.group_size, param_dtype=torch.float16, clip_rule=vs.clip_rule)


def codec_bits_per_element(art: Artifact) -> float | None:
    """Stored bits per K/V element of a codebook artifact (average over layers and heads); None otherwise."""
    if not art.meta.get("codec"):
        return None
    D, tot = art.head_dim, 0.0
    for l in range(art.num_layers):
        ck, cv, _ = layer_codecs(art, l)
        tot += 0.5 * (ck.bits_per_element(D) + cv.bits_per_element(D))  # every token's codes, norms, side lists
    return tot / art.num_layers


# ----------------------------------------------------------------- building the artifacts


def tq_segments(D: int) -> list[tuple[int, int, int]]:
    """The paper's split: D/4 outlier coordinates at 3 bits, then 3D/4 at 2 bits."""
    n_hi = D // 4
    return [(0, n_hi, TQ_HI_BITS), (n_hi, D, TQ_LO_BITS)]


def tq_rotation(energy: np.ndarray, g: torch.Generator) -> torch.Tensor:
    """(D, D) orthogonal P · blockdiag(diag(s1) H, diag(s2) H): the D/4 highest-energy channels first."""
    D = energy.shape[-1]
    n_hi = D // 4
    order = np.argsort(-energy, kind="stable")  # outlier channels first
    P = torch.zeros(D, D, dtype=torch.float64)
    P[torch.as_tensor(order.copy()), torch.arange(D)] = 1.0  # (x @ P)[:, j] = x[:, order[j]]
    B = torch.zeros(D, D, dtype=torch.float64)
    for a, b in ((0, n_hi), (n_hi, D)):
        s = torch.randint(0, 2, (b - a,), generator=g).double() * 2 - 1
        B[a:b, a:b] = s[:, None] * hadamard(b - a)  # random-sign Walsh–Hadamard
    return P @ B


def _store_of(art: Artifact, method: str) -> str:
    prov = art.meta.get("provenance") or {}
    store = prov.get("store")
    if not store or not os.path.isdir(store):
        raise OscarError(f"method {method} reads its calibration statistics from the store of --artifact, but "
                         f"{'it records none' if not store else f'{store!r} does not exist'}; keep the store")
    return store


def store_layers(art: Artifact, method: str):
    """(store path, its view, LayerStats per layer) of the calibration store `art` was fitted from (as partial
    as the fit read it); a clear error naming `method` when the store is gone."""
    store = _store_of(art, method)
    view = open_store(store, partial=bool((art.meta.get("provenance") or {}).get("partial")))
    return store, view, [LayerStats(view, l, ReduceConfig()) for l in range(view.num_layers)]


def tq_artifact(fitted: Artifact, seed: int = 0) -> Artifact:
    """tq-int2 from the calibration store `fitted` came from (outlier sets and key means)."""
    store, view, layers = store_layers(fitted, "tq-int2")
    D, H = view.head_dim, view.num_kv_heads
    g = torch.Generator().manual_seed(seed)
    rot_k, rot_v, k_mean = [], [], []
    for ls in layers:
        mu = ls.mean("k")  # (H, D)
        ek = np.einsum("hdd->hd", ls.cov("k")) - mu**2  # centred key energy per channel
        ev = np.einsum("hdd->hd", ls.cov("v"))
        rot_k.append(torch.stack([tq_rotation(ek[h], g) for h in range(H)]).float())
        rot_v.append(torch.stack([tq_rotation(ev[h], g) for h in range(H)]).float())
        k_mean.append(torch.from_numpy(mu).float())
    ones = [torch.ones(H) for _ in layers]
    return Artifact(rot_k=rot_k, rot_v=rot_v, clip_k=ones, clip_v=[o.clone() for o in ones], k_mean=k_mean,
                    quant=QuantConfig(bits=2, page_size=fitted.quant.page_size),
                    meta={"variant": "tq-int2", "model": dict(view.model), "codec": {"kind": "tq", "segments": tq_segments(D)},
                          "provenance": {"store": store, "store_fingerprint": view.fingerprint, "seed": seed}})


def sq_artifact(fitted: Artifact) -> Artifact:
    """sq-int2 from the calibration store `fitted` came from (eigenbases, stds, means, d_eff)."""
    store, view, layers = store_layers(fitted, "sq-int2")
    D, H = view.head_dim, view.num_kv_heads
    rot = {"k": [], "v": []}
    extra, k_mean, d_effs = {}, [], {"k": [], "v": []}
    for l, ls in enumerate(layers):
        for side in ("k", "v"):
            mu = ls.mean(side)  # (H, D)
            C = ls.cov(side) - mu[:, :, None] * mu[:, None, :]  # centred covariance (H, D, D)
            Us, stds, widths, de = [], [], [], []
            for h in range(H):
                lam, U = eigbasis(torch.from_numpy(C[h]))
                lam = lam.clamp_min(1e-12)
                d = d_eff_gap(lam.numpy(), SQ_GAP)
                w = torch.full((D,), SQ_TAIL_BITS, dtype=torch.int64)
                w[:d] = allocate(lam[:d].numpy(), SQ_BITS * D - SQ_TAIL_BITS * (D - d), "uniform")
                Us.append(U), stds.append(lam.sqrt()), widths.append(w), de.append(d)
            rot[side].append(torch.stack(Us).float())
            extra[f"layers.{l}.std_{side}"] = torch.stack(stds).float()
            extra[f"layers.{l}.widths_{side}"] = torch.stack(widths)
            d_effs[side].append(de)
            if side == "k":
                k_mean.append(torch.from_numpy(mu).float())
            else:
                extra[f"layers.{l}.v_mean"] = torch.from_numpy(mu).float()
    ones = [torch.ones(H) for _ in layers]
    return Artifact(rot_k=rot["k"], rot_v=rot["v"], clip_k=ones, clip_v=[o.clone() for o in ones], k_mean=k_mean,
                    quant=QuantConfig(bits=2, page_size=fitted.quant.page_size), extra=extra,
                    meta={"variant": "sq-int2", "model": dict(view.model), "d_eff": d_effs,
                          "codec": {"kind": "sq", "alloc": "uniform", "bits": SQ_BITS, "tail_bits": SQ_TAIL_BITS, "gap": SQ_GAP},
                          "provenance": {"store": store, "store_fingerprint": view.fingerprint}})


def _derived(fitted: Artifact, method: str, codec: dict, extra: dict) -> Artifact:
    """`fitted` (oscar-int2: rotations, key mean, clips, pages) with another key format."""
    if fitted.layer_quant is not None:
        raise OscarError(f"method {method} is built on a one-format oscar-int2 artifact; --artifact already stores "
                         f"per-layer widths (layer_quant)")
    prov = dict(fitted.meta.get("provenance") or {})
    return replace(fitted, meta={**fitted.meta, "variant": method, "base_variant": fitted.meta.get("variant"),
                                 "codec": codec, "provenance": prov}, extra={**fitted.extra, **extra})


def oscar_bits(fitted: Artifact) -> float:
    """oscar-int2's own bits per element (K and V averaged): the budget per-layer widths spend (2.5 at head_dim 64)."""
    D = fitted.head_dim
    return fitted.quant.bits_per_element(D)


# ----------------------------------------------------------------- per-layer widths


def _rows(ls, max_kv: int = 1024, max_q: int = 128, seed: int = 0):
    """A layer's reservoir rows (H, N, D) float64 tensors, subsampled as the fit's clip search does."""
    q, k, v = ls.rows("q"), ls.rows("k"), ls.rows("v")
    if q is None or k is None or v is None:
        raise OscarError("per-layer widths record their error tables on the store's reservoir rows; this store has none")
    rng = np.random.default_rng(seed)
    pick = lambda n, m: slice(None) if n <= m else np.sort(rng.choice(n, m, replace=False))  # noqa: E731
    kv = pick(k.shape[1], max_kv)
    T = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))  # noqa: E731
    return T(q[:, pick(q.shape[1], max_q)]), T(k[:, kv]), T(v[:, kv])


def layer_widths(errs: np.ndarray, costs: np.ndarray, budget: float) -> list[int]:
    """The option per layer minimising the summed error with the mean cost <= budget (exact, by dynamic
    programming over costs in units of 1/64 bit). errs, costs (L, options) -> option index per layer."""
    L, O = errs.shape
    units = np.round(costs * 64).astype(int)  # (L, O)
    cap = int(math.floor(budget * L * 64 + 1e-6))
    INF = float("inf")
    best = np.full(cap + 1, INF)
    best[0] = 0.0
    choice = np.zeros((L, cap + 1), dtype=int)
    for l in range(L):
        new = np.full(cap + 1, INF)
        for o in range(O):
            u = units[l, o]
            if u > cap:
                continue
            cand = np.full(cap + 1, INF)
            cand[u:] = best[:cap + 1 - u] + errs[l, o]
            better = cand < new
            new[better], choice[l, better] = cand[better], o
        best = new
    if not np.isfinite(best).any():
        raise OscarError(f"per-layer widths: no width per layer fits {budget} bits/element")
    c, out = int(np.argmin(best)), []
    for l in range(L - 1, -1, -1):  # walk back
        o = int(choice[l, c])
        out.append(o)
        c -= units[l, o]
    return out[::-1]


def layer_artifact(fitted: Artifact, options: tuple[tuple, ...], method: str, copy_err: np.ndarray) -> Artifact:
    """Per-layer widths from oscar-int2's artifact, its store and a table measured through the model.

    oscar-int2's rotations and grid per layer at one of `options` (key width, value width): the base width
    with fp8 scale/zero (2.25 bits), wider ones with fp16 (3.5 / 4.5) and no clip. `copy_err` (L, options) is
    the objective, measured outside this module (`oscar.validate.tune.layer_copy_errors` /
    `layer_copy_gradients`: each layer alone at each option, the copied-span NLL change on calibration text);
    the widths minimise its sum at oscar-int2's mean bits per element (`layer_widths`). Recorded beside it,
    per layer and option, on the store's reservoir rows (S = softmax of the rows' q·k / sqrt(D)): the relative
    attention-output error ||Ŝ V̂ − S V||² / ||S V||² averaged over KV heads, and the share of query rows
    whose highest-scoring key changes.
    """
    D, H = fitted.head_dim, fitted.num_kv_heads
    if fitted.quant.key_axis != "token" or fitted.quant.mode != "minmax":
        raise OscarError(f"{method} re-widths oscar-int2's per-token min/max groups; --artifact groups keys otherwise")
    _, _, layers = store_layers(fitted, method)
    base = fitted.quant.bits
    copy_err = np.asarray(copy_err, dtype=float)
    if copy_err.shape != (len(layers), len(options)) or not np.isfinite(copy_err).all() or any(
            not isinstance(kb, int) for kb, _ in options):
        raise OscarError(f"{method}: copy_err must be a finite (layers {len(layers)}, options {len(options)}) "
                         f"table over uniform widths, got shape {copy_err.shape}")
    errs, tops, costs, n_rows = [], [], [], 0
    for l, ls in enumerate(layers):
        q, k, v = _rows(ls, seed=l)
        mu = fitted.k_mean[l].double()[:, None, :] if fitted.k_mean is not None else 0.0
        qr = q @ (fitted.rot_q or fitted.rot_k)[l].double()
        kr = (k - mu) @ fitted.rot_k[l].double()
        vr = v @ fitted.rot_v[l].double()
        S = torch.softmax(qr @ kr.transpose(-1, -2) / math.sqrt(D), -1)  # (H, Nq, N)
        o = S @ vr
        den = (o ** 2).sum((-1, -2))
        top = S.argmax(-1)  # (H, Nq) the key each query row reads most
        n_rows = max(n_rows, top.numel())
        row_e, row_t, row_c = [], [], []
        for kb, vb in options:
            vs = _layer_spec(fitted, vb)
            vh = fake_quant(vr.float(), vs, fitted.clip_v[l].float().view(-1, 1, 1) if vb == base else 1.0).double()
            ks = _layer_spec(fitted, kb)
            kh = fake_quant(kr.float(), ks, fitted.clip_k[l].float().view(-1, 1, 1) if kb == base else 1.0).double()
            Sh = torch.softmax(qr @ kh.transpose(-1, -2) / math.sqrt(D), -1)
            kbits = ks.bits_per_element(D)
            row_e.append(float(((((Sh @ vh) - o) ** 2).sum((-1, -2)) / den).mean()))
            row_t.append(float((Sh.argmax(-1) != top).double().mean()))
            row_c.append(0.5 * (kbits + vs.bits_per_element(D)))
        errs.append(row_e), tops.append(row_t), costs.append(row_c)
    errs, tops, costs = np.array(errs), np.array(tops), np.array(costs)
    # float32 NLL changes through the model: kernel-level differences are ties (TIE_REL), and on the rounded
    # table the DP's own rule decides them (the first option, then the lowest cost)
    obj = np.round(copy_err / (TIE_REL * max(float(np.abs(copy_err).max()), 1e-30)))
    pick = layer_widths(obj, costs, oscar_bits(fitted))
    widths = [list(options[o]) for o in pick]
    rot_k, rot_q = list(fitted.rot_k), list(fitted.rot_q or fitted.rot_k)
    clip_k, clip_v = _width_clips(fitted, widths)
    rec = {"kind": "layers", "widths": widths, "options": [list(o) for o in options], "base_params": "fp8",
           "wide_params": "fp16", "objective": "copied-span NLL change with the layer alone at the width "
                                                "(calibration text, validate/tune.py)",
           "err": [[round(float(e), 6) for e in row] for row in errs],
           "err_total": round(float(errs[np.arange(len(pick)), pick].sum()), 6),
           "err_total_base": round(float(errs[:, 0].sum()), 6), "chosen_by": "copy",
           "top1_changed": [[round(float(e), 6) for e in row] for row in tops],
           "top1_total": round(float(tops[np.arange(len(pick)), pick].sum()), 6),
           "top1_total_base": round(float(tops[:, 0].sum()), 6), "top1_rows": int(n_rows),
           "copy_err": [[round(float(e), 6) for e in row] for row in copy_err]}
    out = _derived(fitted, method, rec, {})
    return replace(out, rot_k=rot_k, rot_q=rot_q if fitted.rot_q is not None else None, clip_k=clip_k, clip_v=clip_v)


def _width_clips(fitted: Artifact, widths) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer (clip_k, clip_v): the fitted clips at the base width, none (ratio 1) at a wider one."""
    base, H = fitted.quant.bits, fitted.num_kv_heads
    return ([fitted.clip_k[l] if kb == base else torch.ones(H) for l, (kb, _) in enumerate(widths)],
            [fitted.clip_v[l] if vb == base else torch.ones(H) for l, (_, vb) in enumerate(widths)])


def widths_artifact(fitted: Artifact, widths, method: str = "oscar-layer-copy-int2", rec: dict | None = None) -> Artifact:
    """`fitted` with layer l's keys and values at widths[l] = (key bits, value bits): layer_artifact's format
    (the base width keeps its clips and fp8 scale/zero, a wider one fp16 and no clip) without its search; what
    a measured objective probes one layer at a time."""
    base, L = fitted.quant.bits, fitted.num_layers
    widths = [[int(kb), int(vb)] for kb, vb in widths]
    if len(widths) != L or any(not (base <= b <= 8) for w in widths for b in w):
        raise OscarError(f"{method}: widths must give (key, value) bits in {base}..8 for each of {L} layers, got {widths}")
    clip_k, clip_v = _width_clips(fitted, widths)
    out = _derived(fitted, method, {"kind": "layers", "widths": widths, "base_params": "fp8", "wide_params": "fp16",
                                    **(rec or {})}, {})
    return replace(out, clip_k=clip_k, clip_v=clip_v)


def native_layer_artifact(art: Artifact) -> Artifact:
    """A "layers" codec artifact (the copy-chosen widths) in the cache's own per-layer format
    (`Artifact.layer_quant`, oscar-artifact/3): a layer's keys at base + 1 or + 2 bits become one wide part
    (key_split = D, key_top, fp16 key params), the base layers and every value keep the base grid with e4m3 params;
    the same grids, clips and rounding as the codec (tested: simulator and OscarCache agree). What OscarCache,
    the Triton kernels and `oscar bench memory --artifact` then serve. Refuses widths the cache has no format for
    (values wider than the base, keys more than 2 bits wider)."""
    c = art.meta.get("codec") or {}
    if c.get("kind") != "layers":
        raise OscarError(f"native_layer_artifact: the artifact has codec {c.get('kind')!r}, not per-layer widths ('layers')")
    base, D = art.quant, art.head_dim
    if base.key_split or base.key_axis != "token" or base.group_size or base.mode != "minmax" or base.clip_rule != "ratio":
        raise OscarError("native_layer_artifact: per-layer widths are built on one-group per-token min/max keys "
                         f"(key_split 0, key_axis token, group_size None, ratio clips); got {base}")
    q0 = replace(base, param_dtype="float8_e4m3fn")  # the codec's base grid: e4m3 scale/zero (_layer_spec)
    lq = []
    for l, (kb, vb) in enumerate(c["widths"]):
        if vb != base.bits or not base.bits <= int(kb) <= base.bits + 2:
            raise OscarError(f"native_layer_artifact: layer {l} has (key, value) widths ({kb}, {vb}); the cache stores "
                             f"values at {base.bits} bits and keys at {base.bits}..{base.bits + 2}")
        kb = int(kb)
        lq.append(q0 if kb == base.bits else replace(q0, key_split=D, key_top=kb - base.bits, key_param_dtype="float16"))
    # `variant` names the rotation recipe (refits of other methods read it): the base fit's, as the rotations are
    meta = {k: v for k, v in art.meta.items() if k not in ("codec", "base_variant")}
    meta["variant"] = art.meta.get("base_variant") or art.meta.get("variant")
    meta["layer_widths"] = {"method": art.meta.get("variant"),  # what chose them (probe tables, objective)
                            **{k: v for k, v in c.items() if k != "kind"}}
    out = replace(art, quant=q0, layer_quant=lq, meta=meta)
    out.validate()
    return out


for _kind in CODECS:  # the simulator reads codebook artifacts through these (kernels import nothing from validate)
    register_codec(_kind, layer_codecs)
