"""Per-layer widths as the simulator reads them: oscar-int2's artifact with each layer's (key, value) widths.

The recipe's widths (oscar/recipe/widths.py) probe and differentiate artifacts whose meta["codec"] is
{"kind": "layers", "widths": [[key bits, value bits] per layer]}: oscar-int2's rotations, key mean and grid, each
layer at its own widths (`derived_artifact`, `layer_spec`). This module reads that codec for the simulator
(`kernels.simulate.register_codec`, so kernels import nothing above them) and reads the calibration store an
artifact came from (`store_layers`). The chosen widths are then written in the cache's own per-layer format
(`oscar.recipe.widths.native_layer_artifact`); validation's codebook formats (tq-int2, sq-int2) are
validate/codebooks.py's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from oscar.common import OscarError
from oscar.kernels.simulate import register_codec
from oscar.quant import FP8_PARAM, QuantSpec, fake_quant
from oscar.stats.artifact import Artifact
from oscar.stats.reduce import LayerStats, ReduceConfig, open_store

LAYERS = "layers"  # the codec kind of per-layer widths


@dataclass
class UniformCodec:
    """One layer's keys or values on oscar-int2's uniform grid at the layer's own width, in the rotated space
    (B, Hkv, T, D)."""

    spec: QuantSpec
    clip: torch.Tensor  # (Hkv, 1, 1) ratio per head

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        return fake_quant(y, self.spec, self.clip)

    def bits_per_element(self, D: int) -> float:
        return self.spec.bits_per_element(D)


def layer_spec(art: Artifact, bits: int) -> QuantSpec:
    """Per-layer widths' per-token grid at `bits`: fp8 scale/zero at the base width (what pays for the
    wider layers), fp16 above it."""
    vs = art.quant.value_spec(art.head_dim)
    return replace(vs, bits=bits, param_dtype=FP8_PARAM) if bits == art.quant.bits else QuantSpec(
        bits=int(bits), group_size=vs.group_size, param_dtype=torch.float16, clip_rule=vs.clip_rule)


def _head_clip(c: torch.Tensor, name: str) -> torch.Tensor:
    if c.dim() != 1:
        raise OscarError(f"per-layer widths take per-head clip ratios; {name} has shape {tuple(c.shape)}")
    return c.float().view(-1, 1, 1)


def layer_codecs(art: Artifact, layer: int) -> tuple[UniformCodec, UniformCodec, None]:
    """(key codec, value codec, no value mean) of layer `layer` of a per-layer widths artifact."""
    kb, vb = art.meta["codec"]["widths"][layer]
    return (UniformCodec(layer_spec(art, kb), _head_clip(art.clip_k[layer], "clip_k")),
            UniformCodec(layer_spec(art, vb), _head_clip(art.clip_v[layer], "clip_v")), None)


def derived_artifact(fitted: Artifact, method: str, codec: dict, extra: dict) -> Artifact:
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


register_codec(LAYERS, layer_codecs)  # the simulator reads per-layer widths through this (kernels import nothing above)
