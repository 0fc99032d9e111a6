"""The copy probe to first order through a model (oscar/recipe/widths.py `layer_copy_gradients`): the simulator's
attention written for autograd, with each layer's INT2 error of its stored keys and values as leaves, and each
layer's inner products of their gradients with a wider width's change. The same code runs in one process on the
whole model and on the pipeline stages on their layer ranges (cluster/scoring.py).

    with gradient_mode(model, quants[0], protocol):
        fresh_leaves(L); copy_nll_sum(...).backward(); window_sums(range(L), options, quants, Hkv)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from oscar.kernels.simulate import LayerQuant
from oscar.kernels.protocol import Protocol
from oscar.kernels.window_attention import fresh, group_end

_GRAD: dict = {"quant": None, "protocol": None, "deltas": None, "keys": None, "vdeltas": None, "values": None}


QUERY_BLOCK = 256  # queries per attention call: each reads only the columns its block can see


def _grad_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """The simulator's attention (validate/ppl.py: query i reads key j exactly if fresh, else from INT2), written
    for autograd: flash attention over [K ; K̂] with the fresh mask choosing a half per (i, j). K̂ = K + δ,
    δ the INT2 error as a leaf, so δ's gradient is the copy NLL's total derivative w.r.t. this layer's stored keys
    (the quantizer passes gradients straight through to earlier layers); the same for the stored values.

    Per block of QUERY_BLOCK queries [a, z), only the columns a query there can read: exact, the sinks and the keys
    still fresh for its first query a (fresh(i, j) only turns false as i grows), and stored, the pages already
    stale for its last query z - 1; the boundary pages sit in both, the mask choosing per (i, j). The softmax is
    the one over all 2T columns under one dense (T, 2T) mask (masked columns add exp(-inf) = 0), at ~0.4x its work
    at 2048 tokens and without a (T, T) mask (docs/speed.md)."""
    l = module.layer_idx
    lq, p = _GRAD["quant"][l], _GRAD["protocol"]
    B, Hq, T, D = query.shape
    sink = min(p.sink, T)
    b = lq.quantized_until(T, sink, 0)
    k0 = key[..., sink:b, :].detach()  # (B, Hkv, n, D)
    delta = (lq.keys(k0) - k0).requires_grad_()  # (B, Hkv, n, D): the base width's error, a leaf
    _GRAD["deltas"][l], _GRAD["keys"][l] = delta, k0
    kh = torch.cat([key[..., :sink, :], key[..., sink:b, :] + delta, key[..., b:, :]], 2)  # (B, Hkv, T, D)
    v0 = value[..., sink:b, :].detach()  # (B, Hkv, n, D)
    vdelta = (lq.values(v0) - v0).requires_grad_()  # the values' INT2 error, a leaf too (value widths)
    _GRAD["vdeltas"][l], _GRAD["values"][l] = vdelta, v0
    vh = torch.cat([value[..., :sink, :], value[..., sink:b, :] + vdelta, value[..., b:, :]], 2)
    # Freshness only turns false as the query moves on and group_end(j) is nondecreasing in j, so each block's
    # exact and stored columns are ranges found by binary search.
    pos = torch.arange(T, device=query.device)
    ends = group_end(pos[sink:], sink, lq.key_group).contiguous()  # (T - sink,)
    outs = []
    for a in range(0, T, QUERY_BLOCK):
        z = min(a + QUERY_BLOCK, T)
        lo = min(z, sink + int(torch.searchsorted(ends, a - p.recent)))  # exact columns [0, sink) + [lo, z)
        hi = min(z, sink + int(torch.searchsorted(ends, z - 1 - p.recent)))  # stored columns [sink, hi)
        rows, ex, st = pos[a:z], torch.cat([pos[:sink], pos[lo:z]]), pos[sink:hi]
        ks = torch.cat([key[..., :sink, :], key[..., lo:z, :], kh[..., sink:hi, :]], 2)  # (B, Hkv, m, D)
        vs = torch.cat([value[..., :sink, :], value[..., lo:z, :], vh[..., sink:hi, :]], 2)  # (B, Hkv, m, D)
        mask = torch.cat([fresh(rows, ex, sink, p.recent, lq.key_group) & (ex[None, :] <= rows[:, None]),
                          ~fresh(rows, st, sink, p.recent, lq.key_group) & (st[None, :] <= rows[:, None])], 1)  # (z - a, m)
        outs.append(F.scaled_dot_product_attention(query[..., a:z, :], ks, vs, attn_mask=mask, scale=scaling,
                                                   enable_gqa=True))  # (B, Hq, z - a, D)
    out = torch.cat(outs, 2)  # (B, Hq, T, D)
    return out.transpose(1, 2).contiguous(), None


def layer_quants(arts: list, protocol: Protocol, layers: range | None = None) -> list[list]:
    """quants[o][l]: layer l's quantizer in arts[o] (the artifact with every layer at option o); None for a layer
    outside `layers` (a pipeline stage's: the attention looks its layer up by the model's global index)."""
    return [[LayerQuant(a, l, protocol.pages) if layers is None or l in layers else None for l in range(a.num_layers)]
            for a in arts]


class gradient_mode:
    """Context manager: `model` (a whole model or a pipeline stage's `LayerRange`) attends through
    `_grad_attention` at `quant`'s widths (one LayerQuant per layer) with its weights frozen; restored on exit."""

    def __init__(self, model, quant: list, protocol: Protocol):
        self.model, self.quant, self.protocol = model, quant, protocol

    def __enter__(self):
        AttentionInterface.register("oscar_grad", _grad_attention)
        AttentionMaskInterface.register("oscar_grad", sdpa_mask)
        self.prev = self.model.config._attn_implementation
        self.grads = [p.requires_grad for p in self.model.parameters()]
        self.model.requires_grad_(False)
        self.model.set_attn_implementation("oscar_grad")
        _GRAD.update(quant=self.quant, protocol=self.protocol)
        return self

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.prev)
        for p, r in zip(self.model.parameters(), self.grads):
            p.requires_grad_(r)
        _GRAD.update(quant=None, protocol=None)


def fresh_leaves(num_layers: int) -> None:
    """Room for one window's leaves (δ, K, δv, V per layer), each layer's set by its attention in the forward."""
    _GRAD.update(deltas=[None] * num_layers, keys=[None] * num_layers, vdeltas=[None] * num_layers,
                 values=[None] * num_layers)


def drop_leaves() -> None:
    _GRAD.update(deltas=None, keys=None, vdeltas=None, values=None)


def copy_nll_sum(lm_head, h: torch.Tensor, win: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The differentiated objective: the summed NLL of the copy tokens predicted at `pos` from the final (normed)
    hidden states h (1, T, H) of the window `win` (1, T)."""
    return F.cross_entropy(lm_head(h[0, pos]).float(), win[0, pos + 1], reduction="sum")  # ()


@torch.no_grad()
def window_sums(layers: range, options: tuple, quants: list[list], num_kv_heads: int) -> np.ndarray:
    """(len(layers), Hkv, O): per layer l and option o the window's Σ ⟨∂NLL/∂K̂_l, Q_o(K_l) − Q_0(K_l)⟩ (plus the
    values' term where options[o] widens them), per KV head, in float64, from the leaves of the backward just run."""
    base = tuple(options[0])
    out = np.zeros((len(layers), num_kv_heads, len(options)))  # (layers, Hkv, O)
    for j, l in enumerate(layers):
        g, k0 = _GRAD["deltas"][l].grad, _GRAD["keys"][l]  # (1, Hkv, n, D)
        q0 = k0 + _GRAD["deltas"][l].detach()
        gv, v0 = _GRAD["vdeltas"][l].grad, _GRAD["values"][l]
        p0 = v0 + _GRAD["vdeltas"][l].detach()
        kterm, vterm = {}, {}  # per width, once: key x value options share their key and value terms
        for o in range(1, len(options)):
            kb, vb = options[o]
            if kb != base[0]:
                if kb not in kterm:
                    kterm[kb] = (g.double() * (quants[o][l].keys(k0) - q0).double()).sum((0, 2, 3)).cpu().numpy()
                out[j, :, o] += kterm[kb]
            if vb != base[1]:
                if vb not in vterm:
                    vterm[vb] = (gv.double() * (quants[o][l].values(v0) - p0).double()).sum((0, 2, 3)).cpu().numpy()
                out[j, :, o] += vterm[vb]
    return out
