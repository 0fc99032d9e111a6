"""Pure-torch oracle for the paged INT2 cache: page quantization and decode attention.

This module defines the semantics; the Triton kernels (triton_quant.py,
triton_decode.py) are tested against it. It is also the CPU production path
(`dispatch` picks it when tensors are not on CUDA). Everything is built on
`oscar.kernels.quant` (same rounding rule: round half up, fp16 scale/zero).
"""

from __future__ import annotations

import math

import torch

from oscar.kernels.paged import PagedLayerCache, layout
from oscar.kernels.quant import choose_qparams, dequantize, pack, quantize, unpack


# ------------------------------------------------------------------ pages
def quantize_page_tensors(cache: PagedLayerCache, x: torch.Tensor, which: str):
    """Quantize whole pages x (N, Hkv, P, D) (rotated, in cfg.dtype) of keys ("k") or values ("v").

    Returns (packed codes (N, Hkv, P, D*bits/8) uint8, scale, zero) with scale/zero
    shaped like the pool's (None in static mode, where they are layer constants).
    """
    cfg, qp = cache.cfg, cache.qp
    spec = qp.k_spec if which == "k" else qp.v_spec
    clip = qp.clip_k if which == "k" else qp.clip_v
    static = qp.k_static if which == "k" else qp.v_static
    if static is not None:  # (Hkv, D) constants broadcast over (N, Hkv, P, D, 1)
        s, z = static[0].unsqueeze(1), static[1].unsqueeze(1)  # (Hkv, 1, D)
        codes = quantize(x, s, z, spec)
        return pack(codes, cfg.bits), None, None
    s, z = choose_qparams(x, spec, clip)  # token: (N, Hkv, P, groups); channel: (N, Hkv, D, 1)
    codes = quantize(x, s, z, spec)
    if spec.axis == "channel":
        s, z = s.squeeze(-1), z.squeeze(-1)  # (N, Hkv, D)
    return pack(codes, cfg.bits), s, z


def quantize_pages(cache: PagedLayerCache, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize pages k, v (N, Hkv, P, D) and write them into the pool at page ids (N,)."""
    for which, x in (("k", k), ("v", v)):
        codes, s, z = quantize_page_tensors(cache, x, which)
        getattr(cache, f"{which}_codes")[ids] = codes
        if s is not None:
            getattr(cache, f"{which}_scale")[ids] = s
            getattr(cache, f"{which}_zero")[ids] = z


def dequantize_pages(cache: PagedLayerCache, ids: torch.Tensor, which: str) -> torch.Tensor:
    """Pages (N,) of the pool back to float32 (N, Hkv, P, D), rotated space."""
    cfg, qp = cache.cfg, cache.qp
    spec = qp.k_spec if which == "k" else qp.v_spec
    codes = unpack(getattr(cache, f"{which}_codes")[ids], cfg.bits)  # (N, Hkv, P, D)
    if cfg.mode == "static":
        s, z = (t.unsqueeze(1) for t in (qp.k_static if which == "k" else qp.v_static))  # (Hkv, 1, D)
    else:
        s, z = getattr(cache, f"{which}_scale")[ids], getattr(cache, f"{which}_zero")[ids]
        if spec.axis == "channel":
            s, z = s.unsqueeze(-1), z.unsqueeze(-1)  # (N, Hkv, D, 1)
    return dequantize(codes, s, z, spec)


# ------------------------------------------------------------------ sequences
def gather_rotated(cache: PagedLayerCache, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's K, V in token order, rotated space, float32: (Hkv, n, D) each.

    Sink and ring tokens are the stored cfg.dtype values, history is dequantized INT2.
    """
    cfg = cache.cfg
    n = cache.lengths[seq]
    lay = layout(n, cfg)
    ids = torch.tensor(cache.pages[seq], dtype=torch.int64, device=cache.k_codes.device)
    parts_k, parts_v = [cache.sink_k[seq, :, : lay.sink_len].float()], [cache.sink_v[seq, :, : lay.sink_len].float()]
    if lay.num_pages:
        H, D = cfg.num_kv_heads, cfg.head_dim
        for parts, w in ((parts_k, "k"), (parts_v, "v")):
            x = dequantize_pages(cache, ids, w)  # (N, Hkv, P, D)
            parts.append(x.transpose(0, 1).reshape(H, lay.num_pages * cfg.page_size, D))
    slots = (torch.arange(lay.ring_len, device=ids.device) + lay.ring_start) % cfg.ring_size
    parts_k.append(cache.ring_k[seq][:, slots].float())
    parts_v.append(cache.ring_v[seq][:, slots].float())
    return torch.cat(parts_k, 1), torch.cat(parts_v, 1)


def dequantize_sequence(cache: PagedLayerCache, seq: int, dtype: torch.dtype | None = None,
                        rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's full K, V (Hkv, n, D) as the cache represents them, in the model space
    (un-rotated, key mean added back) unless rotated=True. For prefill and tests."""
    k, v = gather_rotated(cache, seq)
    if not rotated:
        k, v = cache.rot.unrotate_k(k), cache.rot.unrotate_v(v)
    dtype = dtype or cache.cfg.dtype
    return k.to(dtype), v.to(dtype)


# ------------------------------------------------------------------ attention
def decode_attention(q: torch.Tensor, cache: PagedLayerCache, seqs: list[int], scale: float | None = None,
                     return_lse: bool = False):
    """One query token per sequence attending to its whole cached context.

    q: (B, Hq, D) post-RoPE queries in the model space, Hq = G * Hkv (query head h
    reads KV head h // G). Returns o (B, Hq, D) in q.dtype (and lse (B, Hq) float32,
    the natural-log log-sum-exp of the scaled logits including the key-mean term).
    Math: q_rot = q @ R_K; logit_t = scale * (q_rot . k_rot_t + q . mu);
    o = softmax(logits) @ V_rot @ R_V^T.
    """
    cfg, rot = cache.cfg, cache.rot
    B, Hq, D = q.shape
    H = cfg.num_kv_heads
    G = Hq // H
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf = q.float().reshape(B, H, G, D)
    q_rot = qf if rot.identity else qf @ rot.rot_k.unsqueeze(0)  # (B, Hkv, G, D)
    out = torch.empty(B, H, G, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, G, dtype=torch.float32, device=q.device)
    for b, s in enumerate(seqs):
        k, v = gather_rotated(cache, s)  # (Hkv, n, D)
        logits = (q_rot[b] @ k.transpose(-1, -2)) * scale  # (Hkv, G, n)
        if rot.k_mean is not None:  # q.mu: a per-query constant, exact in the lse
            logits = logits + (qf[b] * rot.k_mean.unsqueeze(1)).sum(-1, keepdim=True) * scale
        lse[b] = torch.logsumexp(logits, -1)
        out[b] = torch.softmax(logits, -1) @ v  # (Hkv, G, D) rotated value space
    o = out if rot.identity else out @ rot.rot_v.transpose(-1, -2).unsqueeze(0)
    o = o.reshape(B, Hq, D).to(q.dtype)
    return (o, lse.reshape(B, Hq)) if return_lse else o
