"""Model-level codebook cache formats: TurboQuant (`tq-int2`) and SpectralQuant, uniform allocation (`sq-int2`).

The synthetic ablation's TQ and SQ codecs (validate/ablation/schemes.py) as cache formats the model-level
simulator (`validate.methods.LayerQuant`) runs like every other method. The quantizers are the
same functions (`schemes.lloyd_max`, `codebook_quant`, `allocate`, `d_eff_gap`; issue 16's `lloyd_fit`,
`lm_fake_quant`, `sparse_fake_quant`, which the ablation's LMCodec / SparseCodec run too); what is added
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

Issue 16's candidates keep oscar-int2's artifact (rotations, key mean, value clips) and change the key format:

oscar-lm-int2     (hypothesis 1, "codebook") per-token fp16 norms of groups of LM_NORM_GROUP rotated
         coordinates, and a 2-bit Lloyd–Max codebook per (layer, KV head, rotated channel) fitted by
         empirical Lloyd iteration (`lloyd_fit`) on the store's calibration reservoir keys, centred,
         rotated and normalised exactly as the cache would (never on validation text). Per-channel
         codebooks because OSCAR's basis is not isotropic (the scaled variant stretches keys along the
         query eigenvectors): one shared codebook would waste levels on the narrow channels; they are
         layer constants, no per-token cost. Values: oscar-int2's format. Bits: 2 + 16/32 = 2.5 per
         key element at groups of 32 (the budget filled, for an equal-bits A/B), values 2.5.
oscar-sparse-int2 (hypothesis 3, "dense and sparse", KVQuant) oscar-int2's keys (per-token min/max,
         fp16 scale+zero, searched clips) plus, per page of `page_size` tokens and KV head, the
         SPARSE_OUT entries of largest |error| in the rotated space kept exact: an fp16 value and its
         index in the page (log2(page_size * D) bits). Entries rather than tokens: the error sits in a
         few clipped coordinates of a token, not in all D of them, and an entry costs 26 bits where a
         token costs D*16. Fixed count per page (not a global threshold) so a page's size is static.
         The trade that pays for it: values store scale+zero in 8-bit e4m3 (oscar.quant FP8_PARAM,
         2.25 bits) instead of fp16 (2.5): the needle loss is in the keys. The count is the most
         entries oscar-int2's own average (2.5 at head_dim 64, BUDGET_BITS) allows (`sparse_outliers`): 9 per 16 x 64 page (0.88 % of entries)
         at SmolLM2/Qwen2.5's head_dim 64.

oscar-mix-int2    (hypothesis 2, "bits across rotated channels") not a codec: the native split-key format
         (QuantConfig.key_split, `oscar fit --variant split`, stats/split.py) built on oscar-int2's key mean,
         value side and store, with the tune factor of `fitted` (`mix_artifact`): the A/B against one group.
oscar-layer-int2  (hypothesis 4, "budget across layers") codec "layers": oscar-int2's grid at (key, value) widths
         per layer chosen by calibrated attention-output error at oscar-int2's mean bits (`layer_artifact`,
         `layer_widths`); oscar-mix-layer-int2 adds the split keys of a layer as one more option.
oscar-tier-int2   (hypothesis 5, reverse water-filling) not a codec: the native tiers format (QuantConfig.key_top 2,
         key_drop, `oscar fit --variant tiers`): split keys' 2.75 key bits spent as D/4 directions at 4 bits,
         5D/8 at 2 and the D/8 of lowest score not stored at all (a key component no query reads shifts all
         of a query's logits alike; it reads as the key mean), built as oscar-mix-int2 (`tier_artifact`; the
         screen of layouts: bench/issue16_tiers.py).

Artifact layout: rot_k / rot_v / k_mean as usual; meta["codec"] names the format; SQ's per-head
v_mean, std and widths go to `extra` (layers.{l}.{v_mean,std_k,std_v,widths_k,widths_v}); LM's levels to
`extra` layers.{l}.levels_k (Hkv, D, 2**bits).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import math
from dataclasses import replace

import numpy as np
import torch

from oscar.common import TIE_REL, OscarError
from oscar.quant import FP8_PARAM, QuantSpec, fake_quant
from oscar.stats.artifact import Artifact, QuantConfig
from oscar.validate.ablation.schemes import (SPARSE_VALUE_BITS, allocate, codebook_quant, d_eff_gap, hadamard, lloyd_fit,
                                             lm_fake_quant, lm_normalise, sparse_fake_quant, sparse_index_bits,
                                             sparse_outliers)
from oscar.validate.ablation.schemes import spec as any_bits_spec

CODECS = ("tq", "sq", "lm", "sparse", "layers")
TQ_HI_BITS, TQ_LO_BITS = 3, 2
SQ_BITS, SQ_TAIL_BITS, SQ_GAP = 2, 1, 4.0
BUDGET_BITS = 2.5  # issue 16: bits per element of the INT2 history, K and V averaged, everything counted
LM_BITS = 2
LAYER_OPTIONS = ((2, 2), (3, 2), (4, 2), (3, 3), (4, 4))  # oscar-layer-int2: (key bits, value bits) per layer
MIX_LAYER_OPTIONS = ((2, 2), ("mix", 2), (3, 2), ("mix", 3), (4, 2), (3, 3), (4, 4))  # + oscar-mix-int2's keys
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

    kind: str  # tq | sq | lm | sparse | uniform (oscar.quant's grid under `spec`)
    segments: list[tuple[int, int, int]] | None = None  # tq
    widths: torch.Tensor | None = None  # sq (Hkv, D) int64
    std: torch.Tensor | None = None  # sq (Hkv, D)
    levels: torch.Tensor | None = None  # lm (Hkv, D, L)
    group: int = 0  # lm: coordinates per fp16 norm
    spec: QuantSpec | None = None  # sparse, uniform
    clip: torch.Tensor | None = None  # sparse, uniform: (Hkv, 1, 1) ratio per head
    n_out: int = 0  # sparse: exact entries per page and head
    page: int = 0  # sparse: tokens per page (key chunks come in whole pages)
    parts: list | None = None  # mix: split keys (QuantConfig.key_parts), clip (Hkv, parts)


    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        if self.kind == "tq":
            return tq_fake_quant(y, self.segments)
        if self.kind == "lm":
            return lm_fake_quant(y, self.levels, self.group)
        if self.kind == "sparse":
            return sparse_fake_quant(y, self.spec, self.clip, self.n_out, self.page)
        if self.kind == "uniform":
            return fake_quant(y, self.spec, self.clip)
        if self.kind == "mix":
            from oscar.stats.split import split_fake_quant

            return split_fake_quant(y, self.parts, self.clip)
        return sq_fake_quant(y, self.widths, self.std)

    def bits_per_element(self, D: int) -> float:
        if self.kind == "tq":
            return (sum((b - a) * bits for a, b, bits in self.segments) + 16 * len(self.segments)) / D
        if self.kind == "lm":
            return math.log2(self.levels.shape[-1]) + 16 / self.group
        if self.kind == "sparse":
            side = self.n_out * (SPARSE_VALUE_BITS + sparse_index_bits(self.page, D)) / (self.page * D)
            return self.spec.bits_per_element(D) + side
        if self.kind == "uniform":
            return self.spec.bits_per_element(D)
        if self.kind == "mix":
            from oscar.quant import parts_bits_per_element

            return parts_bits_per_element(self.parts, D)
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
    if c["kind"] == "layers":  # oscar-layer-int2: oscar-int2's format at each layer's own widths
        kb, vb = c["widths"][layer]
        side = lambda bits, clip, name: LayerCodec("uniform", spec=_layer_spec(art, bits), clip=_head_clip(clip, name))  # noqa: E731
        ck = (LayerCodec("mix", parts=split_parts(art), clip=art.clip_k[layer].float())
              if kb == "mix" else side(kb, art.clip_k[layer], "clip_k"))
        return ck, side(vb, art.clip_v[layer], "clip_v"), None
    if c["kind"] in ("lm", "sparse"):  # oscar-int2's artifact with another key format (issue 16)
        D = art.head_dim
        clip_k, clip_v = (_head_clip(t[layer], name) for t, name in ((art.clip_k, "clip_k"), (art.clip_v, "clip_v")))
        vspec = _value_spec(art, c)
        cv = LayerCodec("uniform", spec=vspec, clip=clip_v)
        if c["kind"] == "lm":
            return LayerCodec("lm", levels=art.extra[f"layers.{layer}.levels_k"].float(), group=int(c["norm_group"])), cv, None
        return LayerCodec("sparse", spec=art.quant.key_spec(D), clip=clip_k, n_out=int(c["n_out"]),
                          page=int(c["page"])), cv, None
    x = art.extra
    ck = LayerCodec("sq", widths=x[f"layers.{layer}.widths_k"].long(), std=x[f"layers.{layer}.std_k"].float())
    cv = LayerCodec("sq", widths=x[f"layers.{layer}.widths_v"].long(), std=x[f"layers.{layer}.std_v"].float())
    return ck, cv, x[f"layers.{layer}.v_mean"].float()[None, :, None, :]


def _head_clip(c: torch.Tensor, name: str) -> torch.Tensor:
    if c.dim() != 1:
        raise OscarError(f"issue-16 key formats take per-head clip ratios; {name} has shape {tuple(c.shape)}")
    return c.float().view(-1, 1, 1)


def _layer_spec(art: Artifact, bits: int) -> QuantSpec:
    """oscar-layer-int2's per-token grid at `bits`: fp8 scale/zero at the base width (what pays for the
    wider layers), fp16 above it."""
    vs = art.quant.value_spec(art.head_dim)
    return replace(vs, bits=bits, param_dtype=FP8_PARAM) if bits == art.quant.bits else any_bits_spec(
        bits, group_size=vs.group_size, param_dtype=torch.float16, clip_rule=vs.clip_rule)


def _value_spec(art: Artifact, codec: dict) -> QuantSpec:
    vs = art.quant.value_spec(art.head_dim)
    return replace(vs, param_dtype=FP8_PARAM) if codec.get("v_params") == "fp8" else vs


def codec_key_group(art: Artifact, flush: int) -> int:
    """Tokens a codebook format quantizes together: whole pages for oscar-sparse-int2 (its side list is
    per page, whatever the protocol's flush), else `flush`."""
    c = art.meta.get("codec") or {}
    return int(c["page"]) if c.get("kind") == "sparse" else flush


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
    from oscar.stats.reduce import LayerStats, ReduceConfig, open_store

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
    from oscar.validate.ablation.schemes import eigbasis

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


def calib_rotated_keys(fitted: Artifact, method: str) -> list[torch.Tensor]:
    """Per layer, the store's calibration reservoir keys (H, N, D) as oscar-int2's cache sees them:
    centred by the artifact's key mean, rotated by its rot_k (float32)."""
    store, _, layers = store_layers(fitted, method)
    out = []
    for l, ls in enumerate(layers):
        k = ls.rows("k")
        if k is None:
            raise OscarError(f"method {method} fits its codebooks on the store's reservoir keys, but {store} has none")
        k = torch.from_numpy(np.ascontiguousarray(k, dtype=np.float32))
        if fitted.k_mean is not None:
            k = k - fitted.k_mean[l].float()[:, None, :]
        out.append(k @ fitted.rot_k[l].float())
    return out


def oscar_bits(fitted: Artifact) -> float:
    """oscar-int2's own bits per element (K and V averaged): the budget of the equal-bits A/B (2.5 at head_dim 64)."""
    D = fitted.head_dim
    return fitted.quant.bits_per_element(D)


def lm_norm_group(fitted: Artifact, bits: int = LM_BITS) -> int:
    """Coordinates per fp16 norm that spend oscar-int2's key bits: 16 / (key bits - code bits), rounded up to
    a divisor of D (32 at head_dim 64: 2 + 16/32 = 2.5)."""
    D = fitted.head_dim
    room = fitted.quant.key_bits(D) - bits
    g = math.ceil(16 / room - 1e-9) if room > 0 else D
    while D % g:
        g += 1
    return g


def lm_artifact(fitted: Artifact, bits: int = LM_BITS, group: int | None = None) -> Artifact:
    """oscar-lm-int2 from oscar-int2's artifact: codebooks fitted on the normalised rotated calibration keys."""
    D = fitted.head_dim
    group = group or lm_norm_group(fitted, bits)
    extra = {}
    for l, y in enumerate(calib_rotated_keys(fitted, "oscar-lm-int2")):
        H = y.shape[0]
        u, _ = lm_normalise(y, group)  # (H, N, D)
        extra[f"layers.{l}.levels_k"] = lloyd_fit(u.permute(0, 2, 1).reshape(H * D, -1), bits).float().reshape(H, D, -1)
    return _derived(fitted, "oscar-lm-int2", {"kind": "lm", "bits": bits, "norm_group": group, "fit": "lloyd, reservoir keys"}, extra)


def sparse_artifact(fitted: Artifact) -> Artifact:
    """oscar-sparse-int2 from oscar-int2's artifact: its keys + a per-page side list, values with fp8 scale/zero."""
    D, page = fitted.head_dim, fitted.quant.page_size
    kspec = fitted.quant.key_spec(D)
    if kspec.axis != "token":
        raise OscarError("oscar-sparse-int2 adds a side list to per-token key groups; the artifact groups keys per channel")
    vspec = replace(fitted.quant.value_spec(D), param_dtype=FP8_PARAM)
    budget = oscar_bits(fitted)  # equal bits: 2.5 = BUDGET_BITS at head_dim 64
    n = sparse_outliers(kspec, vspec, page, D, budget)
    return _derived(fitted, "oscar-sparse-int2", {"kind": "sparse", "n_out": n, "page": page, "v_params": "fp8", "budget": budget,
                                                  "index_bits": sparse_index_bits(page, D), "value_bits": SPARSE_VALUE_BITS}, {})


# ----------------------------------------------------------------- issue 16: bits across channels and across layers


def split_quant(fitted: Artifact, variant: str = "split") -> QuantConfig:
    """oscar-int2's format with split keys (the `split` variant's: D/4 wide channels, 8-bit scale/zero everywhere;
    or the `tiers` variant's)."""
    from oscar.stats.rotations import get_variant

    return get_variant(variant).fmt(fitted.quant, fitted.head_dim)


def split_parts(art: Artifact):
    """The split key parts of oscar-mix-layer-int2's "mix" layers (QuantConfig.key_parts of `split_quant`)."""
    return split_quant(art).key_parts(art.head_dim)


def _rows(ls, max_kv: int = 1024, max_q: int = 128, seed: int = 0):
    """A layer's reservoir rows (H, N, D) float64 tensors, subsampled as the fit's clip search does."""
    q, k, v = ls.rows("q"), ls.rows("k"), ls.rows("v")
    if q is None or k is None or v is None:
        raise OscarError("issue-16 formats place bits by calibration error on the store's reservoir rows; this store has none")
    rng = np.random.default_rng(seed)
    pick = lambda n, m: slice(None) if n <= m else np.sort(rng.choice(n, m, replace=False))  # noqa: E731
    kv = pick(k.shape[1], max_kv)
    T = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))  # noqa: E731
    return T(q[:, pick(q.shape[1], max_q)]), T(k[:, kv]), T(v[:, kv])


def _split_layer(fitted: Artifact, ls, l: int, quant: QuantConfig, ratios: np.ndarray):
    """One layer's split keys from oscar-int2's key mean and the store (stats/split.py): SplitFit."""
    from oscar.stats.split import fit_split_keys, layer_inputs

    mu = fitted.k_mean[l].double().numpy()  # (H, D)
    U, lam, sig2 = layer_inputs(ls, mu)
    _, k, _ = _rows(ls, seed=l)
    return fit_split_keys(U, lam, sig2, k - torch.from_numpy(mu)[:, None, :], ls.cov("q"), quant.key_parts(fitted.head_dim), ratios)


def mix_artifact(fitted: Artifact, variant: str = "split", method: str = "oscar-mix-int2") -> Artifact:
    """oscar-mix-int2 (hypothesis 2) from oscar-int2's artifact and its store: `oscar fit --variant split`'s format
    (QuantConfig.key_split, stats/split.py) built on oscar-int2's key mean and value side, for an A/B on one store.

    Keys: per KV head the query eigenbasis U of the store, split into a 3-bit part of D/4 directions and a
    2-bit part, each scaled and mixed within itself, each its own per-token min/max group with fp8 scale/zero;
    the wide directions per layer by the better of λ_i and λ_i σ_i² on the reservoir rows; clips searched per
    part by the fit's key objective, then scaled by the factor `oscar validate tune` chose for `fitted`.
    Values: oscar-int2's rotation and clips with fp8 scale/zero. 2.75 + 2.25 -> 2.5 bits at head_dim 64.
    variant "tiers": that variant's format instead (`tier_artifact`).
    """
    from oscar.stats.fit import FitConfig

    D = fitted.head_dim
    if fitted.quant.key_axis != "token" or fitted.k_mean is None or fitted.rot_q is None or fitted.quant.key_split:
        raise OscarError(f"{method} splits the scaled variant's per-token keys; --artifact must be an "
                         "`oscar fit --variant scaled` artifact with per-token key groups")
    quant = split_quant(fitted, variant)
    if quant.bits_per_element(D) > oscar_bits(fitted) + 1e-9:
        raise OscarError(f"{method} needs {quant.bits_per_element(D):.3f} bits/element at head_dim {D}, "
                         f"over oscar-int2's {oscar_bits(fitted):.3f}")
    _, _, layers = store_layers(fitted, method)
    factor = float((fitted.meta.get("clip_tuning") or {}).get("chosen_factor", 1.0))
    ratios = np.array(FitConfig().clip_ratios)
    rot_k, rot_q, clip_k, record = [], [], [], []
    for l, ls in enumerate(layers):
        sf = _split_layer(fitted, ls, l, quant, ratios)
        rot_k.append(sf.rot_k.float()), rot_q.append(sf.rot_q.float())
        clip_k.append((sf.clip * factor).clamp(max=1.0))
        record.append({"placement": sf.rule, "err_k": [round(float(e), 6) for e in sf.err],
                       "clip_k": [[round(float(c), 4) for c in row] for row in clip_k[-1]]})
    prov = dict(fitted.meta.get("provenance") or {})
    meta = {**fitted.meta, "variant": method, "base_variant": fitted.meta.get("variant"), "provenance": prov,
            "split": {"built_from": "oscar-int2's artifact and store (validate/codebooks.py mix_artifact)",
                      "tune_factor": factor, "layers": record}}
    return replace(fitted, rot_k=rot_k, rot_q=rot_q, clip_k=clip_k, quant=quant, meta=meta)


def tier_artifact(fitted: Artifact) -> Artifact:
    """oscar-tier-int2 (hypothesis 5): `mix_artifact` in the `tiers` variant's format (QuantConfig.key_top 2,
    key_drop: D/4 key directions at 4 bits, 5D/8 at 2, the D/8 of lowest score not stored; docs/cache-format.md
    "Tiers"), built on oscar-int2's key mean, value side, store and tune factor, for the A/B against split keys."""
    return mix_artifact(fitted, "tiers", "oscar-tier-int2")


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
        raise OscarError(f"oscar-layer-int2: no width per layer fits {budget} bits/element")
    c, out = int(np.argmin(best)), []
    for l in range(L - 1, -1, -1):  # walk back
        o = int(choice[l, c])
        out.append(o)
        c -= units[l, o]
    return out[::-1]


def layer_artifact(fitted: Artifact, options: tuple[tuple, ...] = LAYER_OPTIONS, method: str = "oscar-layer-int2",
                   objective: str = "output", copy_err: np.ndarray | None = None) -> Artifact:
    """oscar-layer-int2 (hypothesis 4) from oscar-int2's artifact and its store; with "mix" among the key
    widths of `options`, oscar-mix-layer-int2 (hypotheses 2 and 4 together).

    oscar-int2's rotations and grid per layer at one of `options` (key width, value width): the base width
    with fp8 scale/zero (2.25 bits), wider ones with fp16 (3.5 / 4.5) and no clip; key width "mix" is
    oscar-mix-int2's split keys for that layer (its own rotation, `stats.split.fit_split_keys`, clips x the tune factor).
    Each layer's error for each option is its relative attention-output error ||Ŝ V̂ − S V||² / ||S V||²
    on the store's reservoir rows (S = softmax of the rows' q·k / sqrt(D)), averaged over KV heads; the
    widths minimise the summed error at oscar-int2's mean bits per element (`layer_widths`).
    objective="top1": the error is instead the share of reservoir query rows whose highest-scoring key changes
    (retrieval: one key must win), the output error only breaking ties.
    objective="copy": `copy_err` (L, options) is the objective, measured through the model outside this module
    (`oscar.validate.tune.layer_copy_errors`: each layer alone at each option, the copied-span NLL change on
    calibration text); the reservoir-row tables are still recorded beside it.
    """
    from oscar.stats.fit import FitConfig

    D, H = fitted.head_dim, fitted.num_kv_heads
    if fitted.quant.key_axis != "token" or fitted.quant.mode != "minmax":
        raise OscarError(f"{method} re-widths oscar-int2's per-token min/max groups; --artifact groups keys otherwise")
    _, _, layers = store_layers(fitted, method)
    from oscar.stats.split import split_fake_quant

    base, squant = fitted.quant.bits, split_quant(fitted)
    sparts = squant.key_parts(D)
    factor = float((fitted.meta.get("clip_tuning") or {}).get("chosen_factor", 1.0))
    use_mix = any(kb == "mix" for kb, _ in options)
    if objective not in ("output", "top1", "copy"):
        raise OscarError(f"{method}: objective must be 'output', 'top1' or 'copy', got {objective!r}")
    if (objective == "copy") != (copy_err is not None):
        raise OscarError(f"{method}: copy_err is the copy objective's table, given with objective='copy' only")
    if copy_err is not None:
        copy_err = np.asarray(copy_err, dtype=float)
        if copy_err.shape != (len(layers), len(options)) or not np.isfinite(copy_err).all() or use_mix:
            raise OscarError(f"{method}: copy_err must be a finite (layers {len(layers)}, options {len(options)}) "
                             f"table over uniform widths, got shape {copy_err.shape}")
    errs, tops, costs, mixes, n_rows = [], [], [], [], 0
    for l, ls in enumerate(layers):
        q, k, v = _rows(ls, seed=l)
        mu = fitted.k_mean[l].double()[:, None, :] if fitted.k_mean is not None else 0.0
        qr = q @ (fitted.rot_q or fitted.rot_k)[l].double()
        kr = (k - mu) @ fitted.rot_k[l].double()
        vr = v @ fitted.rot_v[l].double()
        S = torch.softmax(qr @ kr.transpose(-1, -2) / math.sqrt(D), -1)  # (H, Nq, N)
        o = S @ vr
        den = (o ** 2).sum((-1, -2))
        if use_mix:  # this layer's split keys, as mix_artifact builds them
            sf = _split_layer(fitted, ls, l, squant, np.array(FitConfig().clip_ratios))
            clip_m = (sf.clip * factor).clamp(max=1.0)
            mixes.append((sf.rot_k.float(), sf.rot_q.float(), clip_m))
            kh_mix = split_fake_quant(((k - mu) @ sf.rot_k).float(), sparts, clip_m).double()
            qr_mix = q @ sf.rot_q  # logits q_r·k̂_r = q·k̂ - q·mu: softmax-invariant per query
        top = S.argmax(-1)  # (H, Nq) the key each query row reads most
        n_rows = max(n_rows, top.numel())
        row_e, row_t, row_c = [], [], []
        for kb, vb in options:
            vs = _layer_spec(fitted, vb)
            vh = fake_quant(vr.float(), vs, fitted.clip_v[l].float().view(-1, 1, 1) if vb == base else 1.0).double()
            if kb == "mix":
                Sh = torch.softmax(qr_mix @ kh_mix.transpose(-1, -2) / math.sqrt(D), -1)
                kbits = squant.key_bits(D)
            else:
                ks = _layer_spec(fitted, kb)
                kh = fake_quant(kr.float(), ks, fitted.clip_k[l].float().view(-1, 1, 1) if kb == base else 1.0).double()
                Sh = torch.softmax(qr @ kh.transpose(-1, -2) / math.sqrt(D), -1)
                kbits = ks.bits_per_element(D)
            row_e.append(float(((((Sh @ vh) - o) ** 2).sum((-1, -2)) / den).mean()))
            row_t.append(float((Sh.argmax(-1) != top).double().mean()))
            row_c.append(0.5 * (kbits + vs.bits_per_element(D)))
        errs.append(row_e), tops.append(row_t), costs.append(row_c)
    errs, tops, costs = np.array(errs), np.array(tops), np.array(costs)
    # top1: the output error scaled below one row's share of the layer with most rows, so it only breaks ties
    obj = {"output": errs, "top1": tops + errs / (errs.max() + 1) / n_rows, "copy": copy_err}[objective]
    if objective == "copy":  # float32 NLL changes through the model: kernel-level differences are ties (TIE_REL), and
        # on the rounded table the DP's own rule decides them (the first option, then the lowest cost)
        obj = np.round(obj / (TIE_REL * max(float(np.abs(obj).max()), 1e-30)))
    pick = layer_widths(obj, costs, oscar_bits(fitted))
    widths = [list(options[o]) for o in pick]
    L = len(widths)
    rot_k, rot_q = list(fitted.rot_k), list(fitted.rot_q or fitted.rot_k)
    clip_k, clip_v = _width_clips(fitted, widths)
    for l in range(L):
        if widths[l][0] == "mix":
            rot_k[l], rot_q[l], clip_k[l] = mixes[l]
    rec = {"kind": "layers", "widths": widths, "options": [list(o) for o in options], "base_params": "fp8",
           "wide_params": "fp16", "objective": {"output": "relative attention-output error on reservoir rows",
                                                "top1": "share of reservoir query rows whose top key moves",
                                                "copy": "copied-span NLL change with the layer alone at the width "
                                                        "(calibration text, validate/tune.py)"}[objective],
           "err": [[round(float(e), 6) for e in row] for row in errs],
           "err_total": round(float(errs[np.arange(len(pick)), pick].sum()), 6),
           "err_total_base": round(float(errs[:, 0].sum()), 6), "chosen_by": objective,
           "top1_changed": [[round(float(e), 6) for e in row] for row in tops],
           "top1_total": round(float(tops[np.arange(len(pick)), pick].sum()), 6),
           "top1_total_base": round(float(tops[:, 0].sum()), 6), "top1_rows": int(n_rows),
           **({"copy_err": [[round(float(e), 6) for e in row] for row in copy_err]} if copy_err is not None else {}),
           **({"split": squant.key_split, "tune_factor": factor} if use_mix else {})}
    out = _derived(fitted, method, rec, {})
    return replace(out, rot_k=rot_k, rot_q=rot_q if fitted.rot_q is not None or use_mix else None, clip_k=clip_k, clip_v=clip_v)


def _width_clips(fitted: Artifact, widths) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer (clip_k, clip_v): the fitted clips at the base width, none (ratio 1) at a wider one."""
    base, H = fitted.quant.bits, fitted.num_kv_heads
    return ([fitted.clip_k[l] if kb == base else torch.ones(H) for l, (kb, _) in enumerate(widths)],
            [fitted.clip_v[l] if vb == base else torch.ones(H) for l, (_, vb) in enumerate(widths)])


def widths_artifact(fitted: Artifact, widths, method: str = "oscar-layer-int2", rec: dict | None = None) -> Artifact:
    """`fitted` with layer l's keys and values at widths[l] = (key bits, value bits): layer_artifact's format
    (the base width keeps its clips and fp8 scale/zero, a wider one fp16 and no clip) without its search; what
    a measured objective probes one layer at a time. Split keys ("mix") need layer_artifact."""
    base, L = fitted.quant.bits, fitted.num_layers
    widths = [[int(kb), int(vb)] for kb, vb in widths]
    if len(widths) != L or any(not (base <= b <= 8) for w in widths for b in w):
        raise OscarError(f"{method}: widths must give (key, value) bits in {base}..8 for each of {L} layers, got {widths}")
    clip_k, clip_v = _width_clips(fitted, widths)
    out = _derived(fitted, method, {"kind": "layers", "widths": widths, "base_params": "fp8", "wide_params": "fp16",
                                    **(rec or {})}, {})
    return replace(out, clip_k=clip_k, clip_v=clip_v)


def native_layer_artifact(art: Artifact) -> Artifact:
    """A "layers" codec artifact (oscar-layer-int2, the copy-chosen widths) in the cache's own per-layer format
    (`Artifact.layer_quant`, oscar-artifact/3): a layer's keys at base + 1 or + 2 bits become one wide part
    (key_split = D, key_top, fp16 key params), the base layers and every value keep the base grid with e4m3 params;
    the same grids, clips and rounding as the codec (tested: simulator and OscarCache agree). What OscarCache,
    the Triton kernels and `oscar bench memory --artifact` then serve. Refuses widths the cache has no format for
    (values wider than the base, split-key "mix" layers, keys more than 2 bits wider)."""
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
        if vb != base.bits or kb == "mix" or not base.bits <= int(kb) <= base.bits + 2:
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


def mix_layer_artifact(fitted: Artifact) -> Artifact:
    """oscar-mix-layer-int2: `layer_artifact` with oscar-mix-int2's split keys among each layer's options."""
    return layer_artifact(fitted, MIX_LAYER_OPTIONS, "oscar-mix-layer-int2")


def layer_top1_artifact(fitted: Artifact) -> Artifact:
    """oscar-layer-top1-int2: oscar-layer-int2 with the widths chosen by the share of query rows whose top key changes."""
    return layer_artifact(fitted, LAYER_OPTIONS, "oscar-layer-top1-int2", objective="top1")


def mix_layer_top1_artifact(fitted: Artifact) -> Artifact:
    """oscar-mix-layer-top1-int2: oscar-mix-layer-int2 with the widths chosen by the same top-1 objective."""
    return layer_artifact(fitted, MIX_LAYER_OPTIONS, "oscar-mix-layer-top1-int2", objective="top1")
