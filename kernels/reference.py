"""Pure-torch oracle for the paged INT2 cache: page quantization and decode attention.

This module defines the semantics; the Triton kernels (triton_quant.py,
triton_decode.py) are tested against it. It is also the CPU production path
(`dispatch` picks it when tensors are not on CUDA). Everything is built on
`oscar.quant` (same rounding rule: round half up, scale/zero rounded to
cfg.quant.torch_param_dtype first: fp16, or 8-bit e4m3 with directed rounding).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from oscar.kernels.paged import layout
from oscar.quant import choose_qparams, dequantize, pack, pack_planes, quantize, unpack, unpack_planes

if TYPE_CHECKING:
    from oscar.kernels.paged import PagedLayerCache


# ------------------------------------------------------------------ pages
def quantize_page_tensors(cache: PagedLayerCache, x: torch.Tensor, which: str):
    """Quantize whole pages x (N, Hkv, P, D) (rotated, in cfg.dtype) of keys ("k") or values ("v").

    Returns (packed codes (N, Hkv, P, D*bits/8) uint8, scale, zero) with scale/zero
    shaped like the pool's (None in static mode, where they are layer constants).
    """
    cfg, qp = cache.cfg, cache.qp
    if which == "k" and cfg.key_parts:  # split keys: each part its own per-token group, codes as bit planes
        codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)  # channels after the parts: not stored
        ss, zs = [], []
        for j, (a, b, sp) in enumerate(cfg.key_parts):
            part = x[..., a:b].float().contiguous()
            s, z = choose_qparams(part, sp, qp.clip_k[..., j:j + 1])  # (N, Hkv, P, 1)
            codes[..., a:b] = quantize(part, s, z, sp)
            ss.append(s), zs.append(z)
        q = cfg.quant
        return (pack_planes(codes, q.bits, q.key_split, q.key_top, cfg.head_dim - q.key_drop), torch.cat(ss, -1),
                torch.cat(zs, -1))
    spec = qp.k_spec if which == "k" else qp.v_spec
    clip = qp.clip_k if which == "k" else qp.clip_v
    static = qp.k_static if which == "k" else qp.v_static
    if static is not None:  # (Hkv, D) constants broadcast over (N, Hkv, P, D, 1)
        s, z = static[0].unsqueeze(1), static[1].unsqueeze(1)  # (Hkv, 1, D)
        codes = quantize(x, s, z, spec)
        return pack(codes, cfg.quant.bits), None, None
    s, z = choose_qparams(x, spec, clip)  # token: (N, Hkv, P, groups); channel: (N, Hkv, D, 1)
    codes = quantize(x, s, z, spec)
    if spec.axis == "channel":
        s, z = s.squeeze(-1), z.squeeze(-1)  # (N, Hkv, D)
    return pack(codes, cfg.quant.bits), s, z


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
    if which == "k" and cfg.key_parts:
        q, D = cfg.quant, cfg.head_dim
        codes = unpack_planes(cache.k_codes[ids], q.bits, q.key_split, D, q.key_top, D - q.key_drop)  # (N, Hkv, P, D)
        s, z = cache.k_scale[ids], cache.k_zero[ids]  # (N, Hkv, P, parts)
        out = torch.zeros(codes.shape, dtype=torch.float32, device=codes.device)  # not-stored channels read as 0
        for j, (a, b, sp) in enumerate(cfg.key_parts):
            out[..., a:b] = dequantize(codes[..., a:b], s[..., j:j + 1], z[..., j:j + 1], sp)
        return out
    spec = qp.k_spec if which == "k" else qp.v_spec
    codes = unpack(getattr(cache, f"{which}_codes")[ids], cfg.quant.bits)  # (N, Hkv, P, D)
    if cfg.quant.mode == "static":
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
            parts.append(x.transpose(0, 1).reshape(H, lay.num_pages * cfg.quant.page_size, D))
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
def decode_attention_oracle(q: torch.Tensor, cache: PagedLayerCache, seqs: list[int], scale: float | None = None,
                            return_lse: bool = False):
    """The definition: dequantize the whole context, attend, un-rotate.

    q: (B, Hq, D) post-RoPE queries in the model space, Hq = G * Hkv (query head h
    reads KV head h // G). Returns o (B, Hq, D) in q.dtype (and lse (B, Hq) float32,
    the natural-log log-sum-exp of the scaled logits including the key-mean term).
    Math: q_rot = q @ R_Q (= R_K when orthogonal); logit_t = scale * (q_rot . k_rot_t + q . mu);
    o = softmax(logits) @ V_rot @ R_V^T.
    """
    cfg, rot = cache.cfg, cache.rot
    B, Hq, D = q.shape
    H = cfg.num_kv_heads
    G = Hq // H
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf = q.float().reshape(B, H, G, D)
    q_rot = qf if rot.identity else qf @ rot.rot_q.unsqueeze(0)  # (B, Hkv, G, D)
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


_LUTS: dict = {}
_WORK: dict = {}


def _workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused flat buffer: large fresh allocations cost a page fault per 4 KB on CPU,
    as much as the unpacking itself at 8k tokens."""
    key = (name, dtype, device)
    buf = _WORK.get(key)
    if buf is None or buf.numel() < numel:
        buf = _WORK[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def _codes_f32(packed: torch.Tensor, bits: int, name: str = "codes") -> torch.Tensor:
    """unpack() straight to float32 through a 256-entry table of code tuples: one
    index_select instead of shift, mask and convert passes (the CPU hot path).
    The result lives in a reused workspace `name`: valid until the next call with that name."""
    key = (bits, packed.device)
    if key not in _LUTS:
        byte = torch.arange(256, device=packed.device)
        _LUTS[key] = unpack(byte.to(torch.uint8).unsqueeze(-1), bits).float()  # (256, 8 // bits)
    lut = _LUTS[key]
    idx = _workspace(name + ".idx", packed.numel(), torch.int32, packed.device)
    idx.view(packed.shape).copy_(packed)  # one strided pass: uint8 (any layout) -> int32 indices
    out = _workspace(name, packed.numel() * lut.shape[1], torch.float32, packed.device)
    torch.index_select(lut, 0, idx, out=out.view(-1, lut.shape[1]))
    return out.view(*packed.shape[:-1], -1)


def _history(cache: PagedLayerCache, seq: int, q_rot: torch.Tensor):
    """Logits (Hkv, G, n_hist) of q_rot (Hkv, G, D) against the INT2 pages, without
    dequantizing: with k = c * s + z per group, q . k = s (q . c) + z (sum q), so
    scales apply to G x n dot products instead of n x D elements. Also returns a
    function mapping probabilities (Hkv, G, n_hist) to sum_t p_t v_t (Hkv, G, D)."""
    cfg = cache.cfg
    H, D, P = cfg.num_kv_heads, cfg.head_dim, cfg.quant.page_size
    ids = torch.tensor(cache.pages[seq], dtype=torch.int64, device=q_rot.device)
    npg = len(ids)
    n = npg * P
    kpk = torch.index_select(cache.k_codes, 0, ids).transpose(0, 1)  # (Hkv, np, P, packed)
    W, bits, nb = cfg.quant.key_split, cfg.quant.bits, cfg.k_low_dim
    kc = _codes_f32(kpk[..., :nb], bits, "k")  # (Hkv, np, P, D - key_drop): the low bits of every stored channel
    vc = _codes_f32(torch.index_select(cache.v_codes, 0, ids).transpose(0, 1), bits, "v")
    if W:  # split keys: + 2^(bits+p) x bit plane p of the W wide channels; q.k = sum over parts of s_j (q_j . c_j) + z_j sum q_j
        for p in range(cfg.quant.key_top):
            kc[..., :W] += _codes_f32(kpk[..., nb + p * W // 8:nb + (p + 1) * W // 8], 1, "k_top") * (1 << (bits + p))
        nparts = len(cfg.key_parts)
        s = cache.k_scale[ids].float().transpose(0, 1).reshape(H, 1, n, nparts)
        z = cache.k_zero[ids].float().transpose(0, 1).reshape(H, 1, n, nparts)
        kf = kc.reshape(H, n, kc.shape[-1])  # the channels after the parts are not stored: they add nothing
        logits = 0
        for j, (a, b, _) in enumerate(cfg.key_parts):
            dots = q_rot[..., a:b] @ kf[..., a:b].transpose(-1, -2)  # (Hkv, G, n)
            logits = logits + dots * s[..., j] + q_rot[..., a:b].sum(-1, keepdim=True) * z[..., j]
        return logits, _values(cache, ids, vc, n)
    if cfg.quant.mode == "static":  # s, z (Hkv, D): fold the scale into q, the zero is a constant
        s, z = cache.k_scale.float().unsqueeze(1), cache.k_zero.float().unsqueeze(1)  # (Hkv, 1, D)
        logits = (q_rot * s) @ kc.reshape(H, n, D).transpose(-1, -2) + (q_rot * z).sum(-1, keepdim=True)
        vs, vz = cache.v_scale.float().unsqueeze(1), cache.v_zero.float().unsqueeze(1)
        values = lambda p: (p @ vc.reshape(H, n, D)) * vs + p.sum(-1, keepdim=True) * vz  # noqa: E731
        return logits, values
    if cfg.quant.key_axis == "channel":  # s, z per page and channel: fold s into q page by page
        s = cache.k_scale[ids].float().transpose(0, 1)  # (Hkv, np, D)
        z = cache.k_zero[ids].float().transpose(0, 1)
        qs = q_rot.unsqueeze(2) * s.unsqueeze(1)  # (Hkv, G, np, D)
        logits = torch.einsum("hgpd,hptd->hgpt", qs, kc) + torch.einsum("hgd,hpd->hgp", q_rot, z).unsqueeze(-1)
        logits = logits.reshape(H, -1, n)
    else:  # token groups: s, z per token and channel group x
        NG = cfg.groups
        s = cache.k_scale[ids].float().transpose(0, 1).reshape(H, 1, n, NG)
        z = cache.k_zero[ids].float().transpose(0, 1).reshape(H, 1, n, NG)
        qg = q_rot.reshape(H, -1, NG, D // NG)
        if NG == 1:
            dots = q_rot @ kc.reshape(H, n, D).transpose(-1, -2)  # (Hkv, G, n)
            logits = torch.addcmul(q_rot.sum(-1, keepdim=True) * z[..., 0], dots, s[..., 0])
        else:
            dots = torch.einsum("hgxe,hnxe->hgnx", qg, kc.reshape(H, n, NG, D // NG))
            logits = (dots * s).sum(-1) + (qg.sum(-1).unsqueeze(2) * z).sum(-1)
    return logits, _values(cache, ids, vc, n)


def _values(cache: PagedLayerCache, ids: torch.Tensor, vc: torch.Tensor, n: int):
    """p (Hkv, G, n) -> sum_t p_t v_t (Hkv, G, D) over the per-token INT2 value pages `ids` (codes vc as float)."""
    cfg = cache.cfg
    H, D, NG = cfg.num_kv_heads, cfg.head_dim, cfg.groups
    vs = cache.v_scale[ids].float().transpose(0, 1).reshape(H, 1, n, NG)
    vz = cache.v_zero[ids].float().transpose(0, 1).reshape(H, 1, n, NG)
    vcg = vc.reshape(H, n, NG, D // NG)

    def values(p):  # sum_t p_t (s_t c_t + z_t) = sum_t (p_t s_t) c_t + sum_t p_t z_t
        w = p.unsqueeze(-1) * vs  # (Hkv, G, n, NG)
        if NG == 1:
            return w[..., 0] @ vc.reshape(H, n, D) + p @ vz[:, 0]  # + (Hkv, G, n) @ (Hkv, n, 1)
        else:
            o = torch.einsum("hgnx,hnxe->hgxe", w, vcg).reshape(H, -1, D)
        return o + (p.unsqueeze(-1) * vz).sum(2).repeat_interleave(D // NG, -1)

    return values


def decode_attention(q: torch.Tensor, cache: PagedLayerCache, seqs: list[int], scale: float | None = None,
                     return_lse: bool = False):
    """Same contract and result as `decode_attention_oracle` (up to float summation
    order), computed on the codes: the CPU production path."""
    cfg, rot = cache.cfg, cache.rot
    B, Hq, D = q.shape
    H = cfg.num_kv_heads
    G = Hq // H
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf = q.float().reshape(B, H, G, D)
    q_rot = qf if rot.identity else qf @ rot.rot_q.unsqueeze(0)  # (B, Hkv, G, D)
    out = torch.empty(B, H, G, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, G, dtype=torch.float32, device=q.device)
    for b, s in enumerate(seqs):
        lay = layout(cache.lengths[s], cfg)
        slots = (torch.arange(lay.ring_len, device=q.device) + lay.ring_start) % cfg.ring_size
        k16 = torch.cat([cache.sink_k[s, :, : lay.sink_len], cache.ring_k[s][:, slots]], 1).float()  # (Hkv, m, D)
        v16 = torch.cat([cache.sink_v[s, :, : lay.sink_len], cache.ring_v[s][:, slots]], 1).float()
        parts = [q_rot[b] @ k16.transpose(-1, -2)]  # (Hkv, G, m)
        values = None
        if lay.num_pages:
            hist, values = _history(cache, s, q_rot[b])
            parts.append(hist)
        logits = torch.cat(parts, -1) * scale
        if rot.k_mean is not None:
            logits = logits + (qf[b] * rot.k_mean.unsqueeze(1)).sum(-1, keepdim=True) * scale
        lse[b] = torch.logsumexp(logits, -1)
        p = torch.exp(logits - lse[b].unsqueeze(-1))  # softmax, reusing the lse
        m = k16.shape[1]
        o = p[..., :m] @ v16
        if values is not None:
            o = o + values(p[..., m:])
        out[b] = o
    o = out if rot.identity else out @ rot.rot_v.transpose(-1, -2).unsqueeze(0)
    o = o.reshape(B, Hq, D).to(q.dtype)
    return (o, lse.reshape(B, Hq)) if return_lse else o
