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

Per-layer widths (codec "layers", the recipe's) are read by scoring (oscar/scoring/layer_formats.py), which also
holds the store reader both use (`store_layers`).

Artifact layout: rot_k / rot_v / k_mean as usual; meta["codec"] names the format; SQ's per-head
v_mean, std and widths go to `extra` (layers.{l}.{v_mean,std_k,std_v,widths_k,widths_v}).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from oscar.common import OscarError
from oscar.kernels.simulate import layer_codecs as read_codecs
from oscar.kernels.simulate import register_codec
from oscar.scoring.layer_formats import store_layers
from oscar.stats.artifact import Artifact, QuantConfig
from oscar.validate.ablation.schemes import allocate, codebook_quant, d_eff_gap, eigbasis, hadamard

CODECS = ("tq", "sq")
TQ_HI_BITS, TQ_LO_BITS = 3, 2
SQ_BITS, SQ_TAIL_BITS, SQ_GAP = 2, 1, 4.0


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

    kind: str  # tq | sq
    segments: list[tuple[int, int, int]] | None = None  # tq
    widths: torch.Tensor | None = None  # sq (Hkv, D) int64
    std: torch.Tensor | None = None  # sq (Hkv, D)

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        if self.kind == "tq":
            return tq_fake_quant(y, self.segments)
        return sq_fake_quant(y, self.widths, self.std)

    def bits_per_element(self, D: int) -> float:
        if self.kind == "tq":
            return (sum((b - a) * bits for a, b, bits in self.segments) + 16 * len(self.segments)) / D
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
    x = art.extra
    ck = LayerCodec("sq", widths=x[f"layers.{layer}.widths_k"].long(), std=x[f"layers.{layer}.std_k"].float())
    cv = LayerCodec("sq", widths=x[f"layers.{layer}.widths_v"].long(), std=x[f"layers.{layer}.std_v"].float())
    return ck, cv, x[f"layers.{layer}.v_mean"].float()[None, :, None, :]


def codec_bits_per_element(art: Artifact) -> float | None:
    """Stored bits per K/V element of a codebook artifact (average over layers and heads; per-layer widths too,
    through the simulator's readers); None otherwise."""
    if not art.meta.get("codec"):
        return None
    D, tot = art.head_dim, 0.0
    for l in range(art.num_layers):
        ck, cv, _ = read_codecs(art, l)
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


for _kind in CODECS:  # the simulator reads codebook artifacts through these (kernels import nothing above them)
    register_codec(_kind, layer_codecs)
