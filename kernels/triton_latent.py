"""Triton decode attention over an MLA model's INT2 latent cache, in the absorbed form (kernels/latent.py).

One query token per sequence, all H heads of a layer. Every head reads the same latent, so a program takes a block
of BLOCK_H heads and each latent tile it loads (and dequantizes in registers: x = code * scale + zero, per 128-value
group) serves all of them. Three launches:

1. torch, once per step: the absorbed rotated queries q̃_h R (H, r) and the mean's logit q̃_h · mean (the kernel
   never un-rotates the cache: q̃ · c = (q̃ R) · c_rot + q̃ · mean, R orthogonal).
2. `_latent_split_kernel` (B, H / BLOCK_H, 1 + splits): flash-decoding. Split 0 reads the sequence's exact tokens
   (sinks + recent window, rotated and centred as the history is), splits 1.. each a contiguous range of its INT2
   history. Logits s = ((q̃ R) · ĉ_rot + q̃ · mean + q_pe · k_pe) x scale, online softmax in base 2; each split
   writes its normalised attention-weighted rotated latent (BLOCK_H, r) and its log-sum-exp.
3. `_merge_kernel` (B, H): the log-sum-exp merge of the splits. The caller un-rotates once, adds the mean and
   applies W_UV (torch): o_h = (Σ_s p_s ĉ_rot,s) Rᵀ + mean, then W_UV,h.

Layout (contiguous per sequence; `LatentDecodeInputs`): codes (B, N, r / 4) uint8, four 2-bit codes per byte, low
bits first (oscar.quant.pack); scale, zero (B, N, r / 128) float32; k_pe (B, N, rope); the exact segment
c_exact (B, M, r) rotated and centred, k_pe_exact (B, M, rope); per-sequence lengths n_hist (B,), n_exact (B,).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from oscar.kernels.triton_common import pow2_at_least

LOG2E = 1.4426950408889634


@dataclass
class LatentDecodeInputs:
    codes: torch.Tensor      # (B, N, r / 4) uint8
    scale: torch.Tensor      # (B, N, r / group) float32
    zero: torch.Tensor       # (B, N, r / group) float32
    k_pe: torch.Tensor       # (B, N, rope)
    n_hist: torch.Tensor     # (B,) int32 history tokens of each sequence
    c_exact: torch.Tensor    # (B, M, r) float32, rotated and centred
    k_pe_exact: torch.Tensor  # (B, M, rope)
    n_exact: torch.Tensor    # (B,) int32 exact tokens of each sequence
    group: int = 128


@triton.jit
def _online_step(qa, qpe, s_lat, k_pe_tile, valid, m_i, l_i, acc, c_tile, qmu, QK_SCALE):
    """One online-softmax step (base 2) for BLOCK_H heads over a tile of BLOCK_N tokens: s_lat (H, N) the latent
    logits, k_pe_tile (N, P) the RoPE keys, c_tile (N, r) the tile's rotated latents (the values)."""
    s = (s_lat + tl.dot(qpe, tl.trans(k_pe_tile), input_precision="ieee") + qmu[:, None]) * QK_SCALE
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))                       # m_i starts finite (-1e30): no inf - inf
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])                              # (H, N)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, c_tile, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _latent_split_kernel(QA, QPE, QMU, CODES, SCALE, ZERO, KPE, NHIST, CEX, KPEX, NEX, OUT, LSE,
                         num_splits, H, N_MAX, M_MAX, QK_SCALE,
                         R: tl.constexpr, P: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, R)
    offs_p = tl.arange(0, BLOCK_P)
    h_mask = offs_h < H
    p_mask = offs_p < P
    qa = tl.load(QA + (b * H + offs_h[:, None]) * R + offs_r[None, :], mask=h_mask[:, None], other=0.0)   # (H, R)
    qpe = tl.load(QPE + (b * H + offs_h[:, None]) * P + offs_p[None, :], mask=h_mask[:, None] & p_mask[None, :],
                  other=0.0)                                                                              # (H, P)
    qmu = tl.load(QMU + b * H + offs_h, mask=h_mask, other=0.0)                                           # (H,)
    m_i = tl.full((BLOCK_H,), -1e30, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, R), tl.float32)
    if sp == 0:  # the exact segment: sinks and the recent window
        n = tl.load(NEX + b)
        for t0 in range(0, n, BLOCK_N):
            offs_n = t0 + tl.arange(0, BLOCK_N)
            valid = offs_n < n
            c = tl.load(CEX + (b * M_MAX + offs_n[:, None]) * R + offs_r[None, :], mask=valid[:, None], other=0.0)
            kp = tl.load(KPEX + (b * M_MAX + offs_n[:, None]) * P + offs_p[None, :],
                         mask=valid[:, None] & p_mask[None, :], other=0.0).to(tl.float32)
            s_lat = tl.dot(qa, tl.trans(c), input_precision="ieee")                                      # (H, N)
            m_i, l_i, acc = _online_step(qa, qpe, s_lat, kp, valid, m_i, l_i, acc, c, qmu, QK_SCALE)
    else:  # INT2 history: this split's contiguous share of the sequence's tokens
        n = tl.load(NHIST + b)
        per = tl.cdiv(tl.cdiv(n, num_splits - 1), BLOCK_N) * BLOCK_N
        lo = (sp - 1) * per
        hi = tl.minimum(lo + per, n)
        byte = offs_r // 4
        shift = (offs_r % 4) * 2                                          # code j of a byte at bits 2j (oscar.quant.pack)
        grp = offs_r // GROUP
        for t0 in range(lo, hi, BLOCK_N):
            offs_n = t0 + tl.arange(0, BLOCK_N)
            valid = offs_n < hi
            row = b * N_MAX + offs_n
            packed = tl.load(CODES + row[:, None] * (R // 4) + byte[None, :], mask=valid[:, None], other=0)
            code = ((packed.to(tl.int32) >> shift[None, :]) & 3).to(tl.float32)                            # (N, R)
            sc = tl.load(SCALE + row[:, None] * (R // GROUP) + grp[None, :], mask=valid[:, None], other=0.0)
            zr = tl.load(ZERO + row[:, None] * (R // GROUP) + grp[None, :], mask=valid[:, None], other=0.0)
            c = code * sc + zr                                            # the dequantized rotated latent
            kp = tl.load(KPE + row[:, None] * P + offs_p[None, :], mask=valid[:, None] & p_mask[None, :],
                         other=0.0).to(tl.float32)
            s_lat = tl.dot(qa, tl.trans(c), input_precision="ieee")
            m_i, l_i, acc = _online_step(qa, qpe, s_lat, kp, valid, m_i, l_i, acc, c, qmu, QK_SCALE)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    base = (b * H + offs_h) * num_splits + sp
    tl.store(OUT + base[:, None] * R + offs_r[None, :], out, mask=h_mask[:, None])
    tl.store(LSE + base, lse, mask=h_mask)


@triton.jit
def _merge_kernel(OUT, LSE, O, num_splits, R: tl.constexpr, BLOCK_S: tl.constexpr):
    """o = Σ_s 2^(lse_s - lse) o_s over the splits of one (sequence, head); empty splits (lse = -inf) add nothing."""
    bh = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, R)
    s_mask = offs_s < num_splits
    lse = tl.load(LSE + bh * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.math.exp2(lse - m)                                             # (S,)
    w = w / tl.sum(w, axis=0)
    o = tl.load(OUT + (bh * num_splits + offs_s[:, None]) * R + offs_r[None, :], mask=s_mask[:, None], other=0.0)
    tl.store(O + bh * R + offs_r, tl.sum(o * w[:, None], axis=0))


def latent_decode(qa_rot: torch.Tensor, q_pe: torch.Tensor, qmu: torch.Tensor, cache: LatentDecodeInputs,
                  scale: float, num_splits: int = 4, block_h: int = 16, block_n: int = 32) -> torch.Tensor:
    """The attention-weighted rotated latent (B, H, r), float32, of one decode step: qa_rot (B, H, r) = q̃ R,
    q_pe (B, H, rope) the queries' RoPE part, qmu (B, H) = q̃ · mean; `scale` the layer's logit scale."""
    B, H, R = qa_rot.shape
    P = q_pe.shape[-1]
    N, M = cache.codes.shape[1], cache.c_exact.shape[1]
    assert cache.codes.shape == (B, N, R // 4) and cache.codes.dtype == torch.uint8, cache.codes.shape
    assert cache.scale.shape == cache.zero.shape == (B, N, R // cache.group), cache.scale.shape
    assert cache.k_pe.shape == (B, N, P) and cache.k_pe_exact.shape == (B, M, P) and cache.c_exact.shape == (B, M, R)
    assert q_pe.shape == (B, H, P) and qmu.shape == (B, H) and R % cache.group == 0 and R == pow2_at_least(R)
    assert num_splits >= 1
    dev = qa_rot.device
    S = 1 + num_splits
    out = torch.empty(B, H, S, R, dtype=torch.float32, device=dev)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=dev)
    f32 = lambda t: t.float().contiguous()  # noqa: E731
    block_h = max(16, min(block_h, pow2_at_least(H)))  # tl.dot's tiles are at least 16 wide
    grid = (B, triton.cdiv(H, block_h), S)
    _latent_split_kernel[grid](
        f32(qa_rot), f32(q_pe), f32(qmu), cache.codes.contiguous(), f32(cache.scale), f32(cache.zero),
        cache.k_pe.contiguous(), cache.n_hist.to(torch.int32).contiguous(), f32(cache.c_exact),
        cache.k_pe_exact.contiguous(), cache.n_exact.to(torch.int32).contiguous(), out, lse,
        S, H, N, M, float(scale) * LOG2E,
        R=R, P=P, GROUP=cache.group, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_P=max(16, pow2_at_least(P)))
    o = torch.empty(B, H, R, dtype=torch.float32, device=dev)
    _merge_kernel[(B * H,)](out, lse, o, S, R=R, BLOCK_S=pow2_at_least(S))
    return o
