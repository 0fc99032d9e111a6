"""The "oscar" attention function OscarCache serves through, and its mask function.

`register_attention` registers both (transformers: an attention name without a registered mask function silently
gets no padding mask). The function finds the cache layer through the tag `OscarLayer.update` leaves on the new
keys and lets it attend (kernels/cache.py); for any other cache (DynamicCache, no cache) it is transformers' SDPA.
"""

from __future__ import annotations

from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from oscar.common import OscarError
from oscar.constraints import SLIDING_WINDOW

ATTN_NAME = "oscar"


def oscar_mask(*args, **kwargs):
    """Mask function paired with the "oscar" attention: SDPA's boolean (B, 1, Tq, Tk) mask (True = attend),
    None when it is a plain causal mask without padding."""

    return sdpa_mask(*args, **kwargs)


def register_attention() -> None:
    """Register the "oscar" attention function and its mask function (idempotent)."""

    AttentionInterface.register(ATTN_NAME, oscar_attention)
    AttentionMaskInterface.register(ATTN_NAME, oscar_mask)


def oscar_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs):
    """transformers attention function: (B, Hq, Tq, D) post-RoPE q -> ((B, Tq, Hq, D), None)."""
    layer = getattr(key, "_oscar_layer", None)
    if layer is None:  # not an OscarCache (e.g. DynamicCache, or no cache): plain SDPA

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    key._oscar_layer = None  # one attention call per update
    if kwargs.get("sliding_window"):

        raise OscarError(f"layer {layer.idx} uses sliding-window attention: {SLIDING_WINDOW}")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return layer.attend(module, query, attention_mask, scaling), None
