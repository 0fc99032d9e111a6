"""The INT2 latent cache of an MLA model (GLM-5, DeepSeek-V3): semantics, simulator and the absorbed-form reference.

Per token and layer the cache holds the latent c (kv_lora_rank values) and the shared RoPE key k_pe. The first
`sink` and the last `recent` tokens stay in the model dtype; the history stores the rotated, centred latent
c_rot = (c - mean) @ R in INT2 groups of 128 (a scale and a zero per group, each group's range scaled by its clip),
whole pages at a time; k_pe stays 16-bit (stats/artifact.py `LatentArtifact`, `LatentQuant`).

Attention reads it in the absorbed form (R orthogonal, the rows of softmax summing to 1):

    score_h(t, s) = ((q̃_h R) · ĉ_rot,s + q̃_h · mean + q_pe,h · k_pe,s) x scale,   q̃_h = q_nope,h W_UK,h
    out_h(t)      = ((S_h Ĉ_rot) Rᵀ + mean) W_UV,hᵀ

so a kernel rotates the absorbed query once and un-rotates the attention-weighted latent once, never the cache.
`absorbed_attention` is that computation in torch, the oracle of any kernel. `LatentSimCache` is the simulator:
transformers' MLA attention hands its cache the compressed latent (`cache.update(c, k_pe)`) and expands what the
cache returns through kv_b_proj, so a cache that returns the dequantized latent for the history runs the model
exactly as the INT2 latent cache serves it (up to float rounding), through `generate()` unchanged.
"""

from __future__ import annotations

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache

# GLM-5's layers also cache the DSA indexer's keys (transformers >= 5.2x); DeepSeek-V3's need only the latent
_LayerBase = getattr(cache_utils, "DynamicIndexedLayer", cache_utils.DynamicLayer)

from oscar.common import OscarError
from oscar.kernels.protocol import Protocol
from oscar.kernels.simulate import SimQuantLayer
from oscar.quant import QuantSpec, choose_qparams, fake_quant, pack, quantize
from oscar.stats.artifact import LatentArtifact


class LatentLayerQuant:
    """The round trip of one layer's latents (B, 1, T, r) through the INT2 latent format."""

    def __init__(self, art: LatentArtifact, layer: int):
        self.rot = art.rot[layer].float()        # (r, r)
        self.mean = art.mean[layer].float()      # (r,)
        self.clip = art.clip[layer].float()      # (G,) a minmax ratio per group
        self.spec = art.quant.spec()
        self.page = art.quant.page_size

    def to(self, dev: torch.device) -> "LatentLayerQuant":
        if self.rot.device != dev:
            self.rot, self.mean, self.clip = self.rot.to(dev), self.mean.to(dev), self.clip.to(dev)
        return self

    def rotated(self, c: torch.Tensor) -> torch.Tensor:
        """c (..., r) -> the dequantized rotated latent ĉ_rot (..., r), float32 (what the cache stores, decoded)."""
        self.to(c.device)
        x = (c.float() - self.mean) @ self.rot
        return fake_quant(x, self.spec, self.clip)

    def latents(self, c: torch.Tensor) -> torch.Tensor:
        """c (..., r) -> ĉ = ĉ_rot Rᵀ + mean in c's dtype: the latent the history serves."""
        return (self.rotated(c) @ self.rot.T + self.mean).to(c.dtype)

    def quantized_until(self, T: int, sink: int, recent: int) -> int:
        """Tokens [sink, b) are stored quantized once T tokens are written (whole pages leave the recent window)."""
        b = T - recent
        return sink if b <= sink else sink + (b - sink) // self.page * self.page

    # the simulator layer's reading (kernels/simulate.py SimQuantLayer): keys are the latents, values the RoPE keys
    keys = latents

    def values(self, k_pe: torch.Tensor) -> torch.Tensor:
        return k_pe  # k_pe stays 16-bit


class LatentSimLayer(SimQuantLayer, _LayerBase):
    """A cache layer of latents (keys: c (B, 1, T, r)) and RoPE keys (values: k_pe (B, 1, T, rope)) with the
    latents of [sink, T - recent) replaced by their INT2 round trip, page by page, the RoPE keys exact: the per-head
    simulator's layer (kernels/simulate.py) over `LatentLayerQuant`. A new chunk attends to itself exactly; the DSA
    indexer's key cache (GLM-5) is kept as transformers keeps it."""

    def __init__(self, lq: "LatentLayerQuant", sink: int, recent: int):
        super().__init__(lq, Protocol("latent", sink=sink, recent=recent))


def latent_layers(art: LatentArtifact, layer_cls, sink: int | None, recent: int | None) -> list:
    """One `layer_cls(LatentLayerQuant, sink, recent)` per layer; sink and recent default to the artifact's, and a
    recent window of part of a page is refused."""
    sink = art.quant.sink if sink is None else sink
    recent = art.quant.recent if recent is None else recent
    if recent % art.quant.page_size:
        raise OscarError(f"recent window {recent} is not a whole number of pages of {art.quant.page_size}")
    return [layer_cls(LatentLayerQuant(art, l), sink, recent) for l in range(art.num_layers)]


class LatentSimCache(Cache):
    """The simulator of the INT2 latent cache for one MLA model (one artifact), sink and recent window exact."""

    def __init__(self, art: LatentArtifact, *, sink: int | None = None, recent: int | None = None):
        super().__init__(layers=latent_layers(art, LatentSimLayer, sink, recent))


def up_projections(kv_b_proj: torch.Tensor, num_heads: int, nope: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight (H (nope + v), r) -> W_UK (H, nope, r), W_UV (H, v, r)."""
    w = kv_b_proj.view(num_heads, nope + v_dim, -1)
    return w[:, :nope], w[:, nope:]


def absorbed_attention(q: torch.Tensor, c_rot: torch.Tensor, k_pe: torch.Tensor, w_uk: torch.Tensor,
                       w_uv: torch.Tensor, rot: torch.Tensor, mean: torch.Tensor, scale: float,
                       mask: torch.Tensor | None = None, probs_from: torch.Tensor | None = None) -> torch.Tensor:
    """The attention output of an MLA layer read in the absorbed form from a rotated latent cache (float32).

    q (B, H, Tq, nope + rope) the layer's queries (RoPE applied to the last rope dims); c_rot (B, Tk, r) the cached
    rotated centred latents (dequantized, or exact); k_pe (B, Tk, rope); w_uk (H, nope, r), w_uv (H, v, r); rot (r, r)
    orthogonal, mean (r,); mask: None (causal: query i reads keys j <= Tk - Tq + i), or additive / boolean
    (B|1, 1, Tq, Tk) as transformers builds it (the DSA top-k applied); probs_from: the latents the scores read when
    they are not `c_rot` (the value path alone: exact scores over other values). Returns (B, Tq, H, v), the o_proj
    input."""
    nope = w_uk.shape[1]
    qf, cr, kp = q.float(), c_rot.float(), k_pe.float()
    ck = cr if probs_from is None else probs_from.float()
    qa = torch.einsum("bhtd,hdr->bhtr", qf[..., :nope], w_uk.float())               # (B, H, Tq, r) absorbed queries
    s = (torch.einsum("bhtr,bsr->bhts", qa @ rot.float(), ck)                       # rotated query · rotated latent
         + (qa @ mean.float())[..., None]                                            # the mean's logit, per query
         + torch.einsum("bhtd,bsd->bhts", qf[..., nope:], kp)) * scale               # (B, H, Tq, Tk)
    Tq, Tk = s.shape[-2:]
    if mask is None:
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).tril(Tk - Tq)
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    p = torch.softmax(s, dim=-1)
    lat = torch.einsum("bhts,bsr->bhtr", p, cr) @ rot.float().T + mean.float()       # (B, H, Tq, r) un-rotated once
    return torch.einsum("bhtr,hvr->bthv", lat, w_uv.float())                         # (B, Tq, H, v)


def pack_latents(c_rot: torch.Tensor, spec: QuantSpec, clip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The INT2 history's storage of rotated, centred latents c_rot (..., r): codes (..., r / 4) uint8, four per
    byte (oscar.quant.pack), and a scale and a zero per group (..., r / group) in the spec's param dtype: what the
    Triton decode (kernels/triton_latent.py) reads; dequantized, `LatentLayerQuant.rotated`'s values."""
    scale, zero = choose_qparams(c_rot, spec, clip)
    return pack(quantize(c_rot, scale, zero, spec), spec.bits), scale, zero

