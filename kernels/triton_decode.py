"""Triton kernel (b): fused paged decode attention over the mixed-precision cache.

One query token per sequence, B sequences of different lengths. Three launches:

1. `_rotate_q_kernel` (B, Hkv): q_rot = q @ R_Q and the key-mean term q . mu, once per
   query (row vectors; q . k = q_rot . k_rot + q . mu since R_Q = R_K^{-T} — R_K itself
   when orthogonal — and the cache stores k_rot = (k - mu) @ R_K).
2. `_decode_split_kernel` (B, Hkv, 1 + num_splits): flash-decoding. Split 0 reads the
   sequence's cfg.dtype segments (sink + ring), splits 1.. each read a contiguous range
   of its INT2 pages. Every program handles all G query heads of a KV head, so each
   K/V tile loaded (and unpacked / dequantized in registers: x = code * scale + zero)
   serves G heads. Online softmax in base 2; each split writes its normalised output
   and its log-sum-exp.
3. `_merge_kernel` (B, Hkv): log-sum-exp merge of the splits, then the one
   multiplication by R_V^T that takes the output back to the model space.

Context layout per sequence is recomputed from its length (paged.layout), so the
kernel only needs lengths, block tables and sequence slots.

Split keys (QuantConfig.key_split = W, K_MODE 3): codes = the INT2 plane of the stored channels + 2^(2+p) x bit
plane p < key_top of the W wide channels, two per-token (scale, zero) pairs, the logit factored per part (see the
kernel); the key_drop channels after the parts are not stored and add nothing (they read as the key mean).
W = D - key_drop is one part (a layer's keys at 2 + key_top bits: per-layer widths), one pair per token.

8-bit scale/zero (cfg.quant.torch_param_dtype = float8_e4m3fn: V_FP8, torch_key_param_dtype: K_FP8) are read as bytes
through a uint8 view and decoded to fp32 in registers (a few integer ops per parameter,
i.e. per token and group, or per channel and page for KIVI keys): no native fp8 type is
needed, so the same kernel runs on any GPU and in the interpreter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from oscar.kernels.triton_common import MODE_CHANNEL, MODE_SPLIT, MODE_STATIC, MODE_TOKEN, e4m3_value, pow2_at_least
from oscar.quant import FP8_PARAM

if TYPE_CHECKING:
    from oscar.kernels.paged import PagedLayerCache

LOG2E = 1.4426950408889634


@dataclass
class DecodeConfig:
    """Launch parameters.

    num_splits=None: enough programs to fill the device (about 4 per SM over B * Hkv). The
    split count depends on the device, the batch and the KV heads only, never on the context
    length, and it reaches the kernels as a runtime argument: a growing context (or batch)
    reuses the compiled kernels. A sequence uses only as many of its splits as give each at
    least min_pages_per_split pages; the others see an empty range and write lse = -inf
    (skipped by the merge). The floor is there because each active split writes and reads
    back G x D fp32 partials."""

    block_n: int = 64  # tokens per tile
    num_splits: int | None = None
    min_pages_per_split: int = 64  # 1k tokens at P=16: keeps the fp32 partials (G x D per split) small
    max_splits: int = 128
    num_warps: int = 4
    num_stages: int = 2
    dot_fp16: bool = True  # fp16 tensor-core dots (fp32 accumulate); False: fp32 IEEE dots

    def splits_for(self, batch: int, kv_heads: int, device: torch.device) -> int:
        if self.num_splits is not None:
            return max(1, self.num_splits)
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            sms = 2  # interpreter: keep the grid small
        want = triton.cdiv(4 * sms, batch * kv_heads)
        return max(1, min(want, self.max_splits))


@triton.jit
def _rotate_q_kernel(Q, R, MEAN, QROT, QMU, stride_qb, stride_qh,
                     D: tl.constexpr, GROUP: tl.constexpr, ROTATE: tl.constexpr, CENTER: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    heads = h * GROUP + offs_g  # query heads of this KV head
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # (BLOCK_G, BLOCK_D)
    if ROTATE:
        r = tl.load(R + h * D * D + offs_d[:, None] * D + offs_d[None, :], mask=d_mask[:, None] & d_mask[None, :], other=0.0)
        q_rot = tl.dot(q, r, input_precision="ieee")
    else:
        q_rot = q
    out = (b * (GROUP * tl.num_programs(1)) + heads)
    tl.store(QROT + out[:, None] * D + offs_d[None, :], q_rot, mask=g_mask[:, None] & d_mask[None, :])
    if CENTER:
        mu = tl.load(MEAN + h * D + offs_d, mask=d_mask, other=0.0)
        tl.store(QMU + out, tl.sum(q * mu[None, :], axis=1), mask=g_mask)
    else:
        tl.store(QMU + out, tl.zeros((BLOCK_G,), tl.float32), mask=g_mask)


@triton.jit
def _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, qmu, DOT_FP16: tl.constexpr):
    """One online-softmax step (base 2) for all G heads over a tile of BLOCK_N tokens.

    q (G, D) pre-scaled by scale*log2(e); k, v (N, D) float32; valid (N,).
    """
    if DOT_FP16:
        s = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16)))  # (G, N) fp32 accumulate
    else:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = tl.where(valid[None, :], s + qmu[:, None], float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # m_i starts finite (-1e30): no inf - inf
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])  # (G, N)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP16:
        pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
    else:
        pv = tl.dot(p, v, input_precision="ieee")
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    QROT, QMU, SEQ_LENS, SLOTS, BLOCK_TABLES,
    SINK_K, SINK_V, RING_K, RING_V,
    K_CODES, V_CODES, K_SCALE, K_ZERO, V_SCALE, V_ZERO,
    O_PART, LSE_PART,
    qk_scale,
    num_splits,  # runtime: the split count never recompiles the kernel
    stride_bt,  # block table row (indexed by sequence slot)
    stride_sb, stride_sh, stride_st,  # sink (max_seqs, Hkv, S, D); ring has the same strides but its own token count
    stride_rb, stride_rh, stride_rt,
    stride_cn, stride_ch, stride_ct,  # key codes (pool, Hkv, P, D/4 [+ W/8 top-bit bytes for split keys]): INT2 only
    stride_vcn, stride_vch, stride_vct,  # value codes (pool, Hkv, P, D/4)
    stride_ksn, stride_ksh, stride_kst,  # key params: token (pool, Hkv, P, NG) | channel (pool, Hkv, D) | static (Hkv, D)
    stride_vsn, stride_vsh, stride_vst,  # value params: token | static
    D: tl.constexpr, GROUP: tl.constexpr, P: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
    G_SIZE: tl.constexpr, K_MODE: tl.constexpr, V_MODE: tl.constexpr,
    MIN_PAGES: tl.constexpr, DOT_FP16: tl.constexpr, K_FP8: tl.constexpr, V_FP8: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
    W: tl.constexpr = 0,  # split keys (K_MODE 3): the first W channels have 2 + TOP bits, their top bit planes after the low plane
    TOP: tl.constexpr = 1,
    STORED: tl.constexpr = 0,  # key channels [0, STORED) are stored (D; split keys: D - key_drop, a low plane of STORED/4 bytes)
    NPARTS: tl.constexpr = 2,  # split keys: per-token (scale, zero) pairs, 1 when W = STORED (every stored channel wide)
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    HKV = tl.num_programs(1)
    RING: tl.constexpr = RECENT + P

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    heads = b * (GROUP * HKV) + h * GROUP + offs_g  # flat (B, Hq) index
    qmu = tl.load(QMU + heads, mask=g_mask, other=0.0) * qk_scale

    # layout(n): sink, full pages, ring (paged.layout)
    n = tl.load(SEQ_LENS + b)
    slot = tl.load(SLOTS + b).to(tl.int64)
    m_tok = tl.maximum(n - SINK, 0)
    n_pages = tl.where(m_tok >= RECENT, (m_tok - RECENT) // P, 0)
    ring_len = m_tok - n_pages * P
    ring_start = (n_pages * P) % RING

    m_i = tl.full((BLOCK_G,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)

    if split == 0:
        q = tl.load(QROT + heads[:, None] * D + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        q = q * qk_scale  # logits in base 2: s = log2(e) * scale * q.k
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        # cfg.dtype segments: sink tokens [0, min(n, SINK)) then the ring's valid slots
        sink_len = tl.minimum(n, SINK)
        sbase = slot * stride_sb + h * stride_sh
        for start in range(0, sink_len, BLOCK_N):
            t = start + offs_n
            valid = t < sink_len
            ptr = sbase + t[:, None] * stride_st + offs_d[None, :]
            mask2 = valid[:, None] & d_mask[None, :]
            k = tl.load(SINK_K + ptr, mask=mask2, other=0.0).to(tl.float32)
            v = tl.load(SINK_V + ptr, mask=mask2, other=0.0).to(tl.float32)
            m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, qmu, DOT_FP16)
        rbase = slot * stride_rb + h * stride_rh
        n_ring = tl.where(ring_len > 0, RING, 0)
        for start in range(0, n_ring, BLOCK_N):
            sl = start + offs_n
            valid = (sl < RING) & (((sl - ring_start + RING) % RING) < ring_len)  # softmax ignores token order
            ptr = rbase + sl[:, None] * stride_rt + offs_d[None, :]
            mask2 = valid[:, None] & d_mask[None, :]
            k = tl.load(RING_K + ptr, mask=mask2, other=0.0).to(tl.float32)
            v = tl.load(RING_V + ptr, mask=mask2, other=0.0).to(tl.float32)
            m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, qmu, DOT_FP16)
        _store_part(O_PART, LSE_PART, heads * (num_splits + 1) + split, acc, m_i, l_i, offs_d[None, :], g_mask,
                    d_mask, D)
    else:
        # INT2 history: pages [p0, p1) of this sequence. Codes are read as whole packed rows
        # (D/4 contiguous bytes per token: vectorised loads) and unpacked into 4 strided
        # sub-tiles, sub-tile i holding channels 4j + i. Then q.k = sum_i q[:, 4j+i] . k_i
        # and the output accumulates per sub-tile: no reshape, no repeated byte loads.
        # Where the scale is per token (token groups of D) or per channel (static), it is
        # factored out of the dots, which then run on the raw codes (x = c * s + z):
        #   per token:   q.k_t = s_t (q . c_t) + z_t sum(q);   sum_t p_t v_t = (p * s) @ c + p @ z
        #   per channel: q.k_t = (q * s) . c_t + q . z;       sum_t p_t v_t = s * (p @ c) + z * sum(p)
        # so the inner loop is shift, mask, convert and the dot: no per-element scaling.
        K_FACT: tl.constexpr = K_MODE == 2 or (K_MODE == 0 and G_SIZE == D)
        V_FACT: tl.constexpr = V_MODE == 2 or (V_MODE == 0 and G_SIZE == D)
        # at least MIN_PAGES pages per split: short contexts leave the last splits empty
        per_split = tl.maximum(tl.cdiv(n_pages, num_splits), MIN_PAGES)
        p0 = (split - 1) * per_split
        p1 = tl.minimum(p0 + per_split, n_pages)
        offs_b = tl.arange(0, BLOCK_B)
        b_mask = offs_b < D // 4
        c0, c1, c2, c3 = offs_b * 4, offs_b * 4 + 1, offs_b * 4 + 2, offs_b * 4 + 3
        qm = g_mask[:, None] & b_mask[None, :]
        qrow = QROT + heads[:, None] * D
        q0 = tl.load(qrow + c0[None, :], mask=qm, other=0.0) * qk_scale  # (BLOCK_G, BLOCK_B)
        q1 = tl.load(qrow + c1[None, :], mask=qm, other=0.0) * qk_scale
        q2 = tl.load(qrow + c2[None, :], mask=qm, other=0.0) * qk_scale
        q3 = tl.load(qrow + c3[None, :], mask=qm, other=0.0) * qk_scale
        qsum = tl.sum(q0 + q1 + q2 + q3, axis=1)  # (BLOCK_G,) multiplies per-token zeros
        if K_MODE == 3:
            # split keys, two per-token pairs: q.k_t = s_w (q_w . c_t) + s_n (q_n . c_t) + z_w sum(q_w) + z_n sum(q_n),
            # q_w = q on the wide channels (c < W, codes lo2 + 4 top), q_n = q on the rest; still no per-element scaling
            # (channels from STORED on are not stored: they read as the key mean, already in q . mu)
            w0, w1, w2, w3 = (c0 < W)[None, :], (c1 < W)[None, :], (c2 < W)[None, :], (c3 < W)[None, :]
            q0w, q1w, q2w, q3w = tl.where(w0, q0, 0.0), tl.where(w1, q1, 0.0), tl.where(w2, q2, 0.0), tl.where(w3, q3, 0.0)
            q0n = tl.where((c0 < STORED)[None, :], q0 - q0w, 0.0)
            q1n = tl.where((c1 < STORED)[None, :], q1 - q1w, 0.0)
            q2n = tl.where((c2 < STORED)[None, :], q2 - q2w, 0.0)
            q3n = tl.where((c3 < STORED)[None, :], q3 - q3w, 0.0)
            qsum_w = tl.sum(q0w + q1w + q2w + q3w, axis=1)
            qsum_n = tl.sum(q0n + q1n + q2n + q3n, axis=1)
        if K_MODE == 2:  # static: fold the per-channel scale into q, the zero into a constant
            ks0, kz0 = _static_params(K_SCALE, K_ZERO, h, stride_ksh, c0, b_mask)
            ks1, kz1 = _static_params(K_SCALE, K_ZERO, h, stride_ksh, c1, b_mask)
            ks2, kz2 = _static_params(K_SCALE, K_ZERO, h, stride_ksh, c2, b_mask)
            ks3, kz3 = _static_params(K_SCALE, K_ZERO, h, stride_ksh, c3, b_mask)
            qz = tl.sum(q0 * kz0 + q1 * kz1 + q2 * kz2 + q3 * kz3, axis=1)
            q0, q1, q2, q3 = q0 * ks0, q1 * ks1, q2 * ks2, q3 * ks3
        acc0 = tl.zeros((BLOCK_G, BLOCK_B), tl.float32)
        acc1 = tl.zeros((BLOCK_G, BLOCK_B), tl.float32)
        acc2 = tl.zeros((BLOCK_G, BLOCK_B), tl.float32)
        acc3 = tl.zeros((BLOCK_G, BLOCK_B), tl.float32)
        accz = tl.zeros((BLOCK_G,), tl.float32)  # sum_t p_t z_t (per-token value zeros)
        for start in range(p0 * P, p1 * P, BLOCK_N):
            t = start + offs_n  # token index within the history
            valid = t < p1 * P
            page = tl.load(BLOCK_TABLES + slot * stride_bt + t // P, mask=valid, other=0).to(tl.int64)
            row = t % P
            m2 = valid[:, None] & b_mask[None, :]
            krow = page[:, None] * stride_cn + h * stride_ch + row[:, None] * stride_ct
            kb = tl.load(K_CODES + krow + offs_b[None, :], mask=m2 & (offs_b < STORED // 4)[None, :],
                         other=0).to(tl.int32)  # (BLOCK_N, BLOCK_B) packed
            vptr = page[:, None] * stride_vcn + h * stride_vch + row[:, None] * stride_vct + offs_b[None, :]
            vb = tl.load(V_CODES + vptr, mask=m2, other=0).to(tl.int32)
            if K_MODE == 3:
                sp = page * stride_ksn + h * stride_ksh + row * stride_kst
                k0 = _split_code(kb, 0, K_CODES, krow, c0, m2, STORED // 4, W, TOP)
                k1 = _split_code(kb, 1, K_CODES, krow, c1, m2, STORED // 4, W, TOP)
                k2 = _split_code(kb, 2, K_CODES, krow, c2, m2, STORED // 4, W, TOP)
                k3 = _split_code(kb, 3, K_CODES, krow, c3, m2, STORED // 4, W, TOP)
                dw = _dot_t(q0w, k0, DOT_FP16) + _dot_t(q1w, k1, DOT_FP16) + _dot_t(q2w, k2, DOT_FP16) + _dot_t(q3w, k3, DOT_FP16)
                s_w, z_w = _param(K_SCALE, sp, valid, K_FP8), _param(K_ZERO, sp, valid, K_FP8)
                sc = dw * s_w[None, :] + qsum_w[:, None] * z_w[None, :]
                if NPARTS == 2:  # the narrow part's pair (NPARTS 1: W = STORED, every stored channel wide)
                    dn = _dot_t(q0n, k0, DOT_FP16) + _dot_t(q1n, k1, DOT_FP16) + _dot_t(q2n, k2, DOT_FP16) + _dot_t(q3n, k3, DOT_FP16)
                    s_n, z_n = _param(K_SCALE, sp + 1, valid, K_FP8), _param(K_ZERO, sp + 1, valid, K_FP8)
                    sc += dn * s_n[None, :] + qsum_n[:, None] * z_n[None, :]
            elif K_FACT:
                sc = _dot_t(q0, _code(kb, 0), DOT_FP16) + _dot_t(q1, _code(kb, 1), DOT_FP16)
                sc += _dot_t(q2, _code(kb, 2), DOT_FP16) + _dot_t(q3, _code(kb, 3), DOT_FP16)
                if K_MODE == 0:
                    sp = page * stride_ksn + h * stride_ksh + row * stride_kst
                    s_t = _param(K_SCALE, sp, valid, K_FP8)
                    z_t = _param(K_ZERO, sp, valid, K_FP8)
                    sc = sc * s_t[None, :] + qsum[:, None] * z_t[None, :]
                else:
                    sc = sc + qz[:, None]
            else:  # KIVI keys or several channel groups: dequantize each sub-tile in registers
                k0 = _dequant(kb, 0, c0, b_mask, K_SCALE, K_ZERO, page, row, valid, h,
                              stride_ksn, stride_ksh, stride_kst, K_MODE, G_SIZE, D, K_FP8)
                k1 = _dequant(kb, 1, c1, b_mask, K_SCALE, K_ZERO, page, row, valid, h,
                              stride_ksn, stride_ksh, stride_kst, K_MODE, G_SIZE, D, K_FP8)
                k2 = _dequant(kb, 2, c2, b_mask, K_SCALE, K_ZERO, page, row, valid, h,
                              stride_ksn, stride_ksh, stride_kst, K_MODE, G_SIZE, D, K_FP8)
                k3 = _dequant(kb, 3, c3, b_mask, K_SCALE, K_ZERO, page, row, valid, h,
                              stride_ksn, stride_ksh, stride_kst, K_MODE, G_SIZE, D, K_FP8)
                sc = _dot_t(q0, k0, DOT_FP16) + _dot_t(q1, k1, DOT_FP16)
                sc += _dot_t(q2, k2, DOT_FP16) + _dot_t(q3, k3, DOT_FP16)
            sc = tl.where(valid[None, :], sc + qmu[:, None], float("-inf"))  # (BLOCK_G, BLOCK_N), base 2
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            pr = tl.math.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            m_i = m_new
            if V_FACT:
                pw = pr
                if V_MODE == 0:
                    sp = page * stride_vsn + h * stride_vsh + row * stride_vst
                    s_t = _param(V_SCALE, sp, valid, V_FP8)
                    z_t = _param(V_ZERO, sp, valid, V_FP8)
                    pw = pr * s_t[None, :]
                    accz = accz * alpha + tl.sum(pr * z_t[None, :], axis=1)
                acc0 = acc0 * alpha[:, None] + _dot(pw, _code(vb, 0), DOT_FP16)
                acc1 = acc1 * alpha[:, None] + _dot(pw, _code(vb, 1), DOT_FP16)
                acc2 = acc2 * alpha[:, None] + _dot(pw, _code(vb, 2), DOT_FP16)
                acc3 = acc3 * alpha[:, None] + _dot(pw, _code(vb, 3), DOT_FP16)
            else:
                v0 = _dequant(vb, 0, c0, b_mask, V_SCALE, V_ZERO, page, row, valid, h,
                              stride_vsn, stride_vsh, stride_vst, V_MODE, G_SIZE, D, V_FP8)
                v1 = _dequant(vb, 1, c1, b_mask, V_SCALE, V_ZERO, page, row, valid, h,
                              stride_vsn, stride_vsh, stride_vst, V_MODE, G_SIZE, D, V_FP8)
                v2 = _dequant(vb, 2, c2, b_mask, V_SCALE, V_ZERO, page, row, valid, h,
                              stride_vsn, stride_vsh, stride_vst, V_MODE, G_SIZE, D, V_FP8)
                v3 = _dequant(vb, 3, c3, b_mask, V_SCALE, V_ZERO, page, row, valid, h,
                              stride_vsn, stride_vsh, stride_vst, V_MODE, G_SIZE, D, V_FP8)
                acc0 = acc0 * alpha[:, None] + _dot(pr, v0, DOT_FP16)
                acc1 = acc1 * alpha[:, None] + _dot(pr, v1, DOT_FP16)
                acc2 = acc2 * alpha[:, None] + _dot(pr, v2, DOT_FP16)
                acc3 = acc3 * alpha[:, None] + _dot(pr, v3, DOT_FP16)
        if V_MODE == 2:  # o = s * (p @ c) + z * sum(p), before normalising by l
            vs0, vz0 = _static_params(V_SCALE, V_ZERO, h, stride_vsh, c0, b_mask)
            vs1, vz1 = _static_params(V_SCALE, V_ZERO, h, stride_vsh, c1, b_mask)
            vs2, vz2 = _static_params(V_SCALE, V_ZERO, h, stride_vsh, c2, b_mask)
            vs3, vz3 = _static_params(V_SCALE, V_ZERO, h, stride_vsh, c3, b_mask)
            acc0 = acc0 * vs0 + l_i[:, None] * vz0
            acc1 = acc1 * vs1 + l_i[:, None] * vz1
            acc2 = acc2 * vs2 + l_i[:, None] * vz2
            acc3 = acc3 * vs3 + l_i[:, None] * vz3
        elif V_FACT:  # + sum_t p_t z_t, the same for every channel
            acc0, acc1 = acc0 + accz[:, None], acc1 + accz[:, None]
            acc2, acc3 = acc2 + accz[:, None], acc3 + accz[:, None]
        part = heads * (num_splits + 1) + split
        _store_part(O_PART, LSE_PART, part, acc0, m_i, l_i, c0[None, :], g_mask, b_mask, D)
        _store_part(O_PART, LSE_PART, part, acc1, m_i, l_i, c1[None, :], g_mask, b_mask, D)
        _store_part(O_PART, LSE_PART, part, acc2, m_i, l_i, c2[None, :], g_mask, b_mask, D)
        _store_part(O_PART, LSE_PART, part, acc3, m_i, l_i, c3[None, :], g_mask, b_mask, D)


@triton.jit
def _code(packed, I: tl.constexpr):
    """Sub-tile I of packed INT2 rows: the codes of channels 4j + I, as float (exact)."""
    return ((packed >> (2 * I)) & 3).to(tl.float32)


@triton.jit
def _split_code(packed, I: tl.constexpr, K_CODES, krow, chan, m2, NB: tl.constexpr, W: tl.constexpr, TOP: tl.constexpr):
    """Sub-tile I of split keys: the low 2 bits of channels chan = 4j + I from the packed row, plus 2^(2+p) x bit
    plane p of the wide ones (chan < W: bit chan % 8 of byte NB + p W/8 + chan // 8 of the same row, NB the low
    plane's bytes), as float (exact)."""
    wide = chan < W
    code = (packed >> (2 * I)) & 3
    for p in tl.static_range(TOP):
        tb = tl.load(K_CODES + krow + NB + p * (W // 8) + (chan // 8)[None, :], mask=m2 & wide[None, :], other=0).to(tl.int32)
        code += ((tb >> (chan % 8)[None, :]) & 1) << (2 + p)
    return code.to(tl.float32)


@triton.jit
def _static_params(S, Z, h, sh, chan, c_mask):
    """Static mode's per-channel (scale, zero) for channels `chan`: (1, BLOCK_B) each."""
    s = tl.load(S + h * sh + chan, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    z = tl.load(Z + h * sh + chan, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    return s, z


@triton.jit
def _store_part(O_PART, LSE_PART, part, acc, m_i, l_i, cols, g_mask, c_mask, D: tl.constexpr):
    """A split's normalised output (columns `cols`) and its log2-sum-exp (-inf when it saw no token)."""
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(O_PART + part[:, None] * D + cols, o, mask=g_mask[:, None] & c_mask[None, :])
    lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
    tl.store(LSE_PART + part, lse, mask=g_mask)


@triton.jit
def _param(PTR, off, mask, FP8: tl.constexpr):
    """Scale or zero values at PTR + off as fp32 (0 where masked): fp16/fp32 as stored, or e4m3 bytes decoded."""
    if FP8:
        return e4m3_value(tl.load(PTR + off, mask=mask, other=0).to(tl.int32))
    return tl.load(PTR + off, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _dequant(packed, I: tl.constexpr, chan, c_mask, S, Z, page, row, valid, h, sn, sh, st,
             MODE: tl.constexpr, G_SIZE: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr):
    """Sub-tile I of packed rows (BLOCK_N, BLOCK_B): channels chan = 4j + I, x = code * scale + zero."""
    code = ((packed >> (2 * I)) & 3).to(tl.float32)
    if MODE == 2:  # static: layer constants (Hkv, D)
        s = tl.load(S + h * sh + chan, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        z = tl.load(Z + h * sh + chan, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    elif MODE == 1:  # KIVI keys: per channel of each token's page
        off = page[:, None] * sn + h * sh + chan[None, :]
        m = valid[:, None] & c_mask[None, :]
        s = _param(S, off, m, FP8)
        z = _param(Z, off, m, FP8)
    elif G_SIZE == D:  # one pair per token: (BLOCK_N, 1), broadcast
        off = page * sn + h * sh + row * st
        s = _param(S, off, valid, FP8)[:, None]
        z = _param(Z, off, valid, FP8)[:, None]
    else:  # per token and channel group
        off = page[:, None] * sn + h * sh + row[:, None] * st + (chan // G_SIZE)[None, :]
        m = valid[:, None] & c_mask[None, :]
        s = _param(S, off, m, FP8)
        z = _param(Z, off, m, FP8)
    return tl.where(valid[:, None] & c_mask[None, :], code * s + z, 0.0)


@triton.jit
def _dot_t(a, b, DOT_FP16: tl.constexpr):
    """a @ b^T with fp32 accumulation."""
    if DOT_FP16:
        return tl.dot(a.to(tl.float16), tl.trans(b.to(tl.float16)))
    return tl.dot(a, tl.trans(b), input_precision="ieee")


@triton.jit
def _dot(a, b, DOT_FP16: tl.constexpr):
    if DOT_FP16:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    return tl.dot(a, b, input_precision="ieee")


@triton.jit(do_not_specialize=["num_parts"])
def _merge_kernel(O_PART, LSE_PART, R, OUT, LSE, stride_ob, stride_oh, num_parts,
                  D: tl.constexpr, GROUP: tl.constexpr, ROTATE: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    heads = b * (GROUP * tl.num_programs(1)) + h * GROUP + offs_g
    # o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M): exact flash-decoding merge
    m = tl.full((BLOCK_G,), -1.0e30, tl.float32)
    w_sum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for s in range(num_parts):
        part = heads * num_parts + s
        lse_s = tl.load(LSE_PART + part, mask=g_mask, other=float("-inf"))
        seen = lse_s > float("-inf")  # an empty split's output is 0/1e-30 = 0: weight 0, but skip the read
        o_s = tl.load(O_PART + part[:, None] * D + offs_d[None, :],
                      mask=(g_mask & seen)[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m, lse_s)
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse_s - m_new)
        acc = acc * alpha[:, None] + w[:, None] * o_s
        w_sum = w_sum * alpha + w
        m = m_new
    o = acc / tl.maximum(w_sum, 1e-30)[:, None]  # (BLOCK_G, BLOCK_D), rotated value space
    if ROTATE:  # o_model = o_rot @ R_V^T:  R_V^T[e, c] = R_V[c, e]
        rt = tl.load(R + h * D * D + offs_d[None, :] * D + offs_d[:, None], mask=d_mask[:, None] & d_mask[None, :], other=0.0)
        o = tl.dot(o, rt, input_precision="ieee")
    qh = h * GROUP + offs_g
    tl.store(OUT + b * stride_ob + qh[:, None] * stride_oh + offs_d[None, :], o.to(OUT.dtype.element_ty),
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(LSE + heads, (m + tl.math.log2(tl.maximum(w_sum, 1e-30))) / 1.4426950408889634, mask=g_mask)


def _param_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(page, head, token) strides of a scale/zero tensor: static (Hkv, D), channel (pool, Hkv, D), token (pool, Hkv, P, NG)."""
    if t.dim() == 2:
        return 0, t.stride(0), 0
    if t.dim() == 3:
        return t.stride(0), t.stride(1), 0
    return t.stride(0), t.stride(1), t.stride(2)


def decode_attention(q: torch.Tensor, cache: PagedLayerCache, seqs: list[int], scale: float | None = None,
                     return_lse: bool = False, config: DecodeConfig | None = None):
    """Same contract as reference.decode_attention: q (B, Hq, D) -> o (B, Hq, D) [, lse (B, Hq)]."""
    cfg, rot = cache.cfg, cache.rot
    config = config or DecodeConfig()
    B, Hq, D = q.shape
    H = cfg.num_kv_heads
    assert D == cfg.head_dim and Hq % H == 0, f"q {tuple(q.shape)} vs cache Hkv={H}, D={cfg.head_dim}"
    assert q.device == cache.k_codes.device, f"q on {q.device}, cache on {cache.k_codes.device}"
    assert cfg.quant.bits == 2 and D % 4 == 0, "the fused decode kernel reads INT2 codes (4 per byte); other widths: reference"
    assert cfg.quant.key_split % 8 == 0 and (D - cfg.quant.key_drop) % 4 == 0, (
        f"split keys need whole top-bit bytes and a whole low plane, got key_split={cfg.quant.key_split}, key_drop={cfg.quant.key_drop}")
    G = Hq // H
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    dev = q.device
    batch = cache.batch_tables(seqs)
    q = q.contiguous()
    BLOCK_G, BLOCK_D = pow2_at_least(G), pow2_at_least(D)

    q_rot = torch.empty(B, Hq, D, dtype=torch.float32, device=dev)
    q_mu = torch.empty(B, Hq, dtype=torch.float32, device=dev)
    center = rot.k_mean is not None
    _rotate_q_kernel[(B, H)](
        q, rot.rot_q, rot.k_mean if center else q_mu, q_rot, q_mu, q.stride(0), q.stride(1),
        D=D, GROUP=G, ROTATE=not rot.identity, CENTER=center, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D,
    )

    splits = config.splits_for(B, H, dev)
    o_part = torch.empty(B, Hq, splits + 1, D, dtype=torch.float32, device=dev)
    lse_part = torch.empty(B, Hq, splits + 1, dtype=torch.float32, device=dev)
    k_mode = MODE_STATIC if cfg.quant.mode == "static" else (MODE_CHANNEL if cfg.quant.key_axis == "channel" else MODE_TOKEN)
    if cfg.quant.key_split:
        k_mode = MODE_SPLIT
    v_mode = MODE_STATIC if cfg.quant.mode == "static" else MODE_TOKEN
    kst, vst = _param_strides(cache.k_scale), _param_strides(cache.v_scale)
    minmax = cfg.quant.mode != "static"  # static constants stay fp16
    k_fp8 = cfg.quant.torch_key_param_dtype == FP8_PARAM and minmax  # keys may keep fp16 params where values are e4m3
    v_fp8 = cfg.quant.torch_param_dtype == FP8_PARAM and minmax
    params = [t.view(torch.uint8) if f else t for t, f in zip((cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero),
                                                                (k_fp8, k_fp8, v_fp8, v_fp8))]
    _decode_split_kernel[(B, H, splits + 1)](
        q_rot, q_mu, batch.seq_lens, batch.slots, batch.block_table,
        cache.sink_k, cache.sink_v, cache.ring_k, cache.ring_v,
        cache.k_codes, cache.v_codes, *params,
        o_part, lse_part,
        scale * LOG2E,
        splits,
        batch.block_table.stride(0),
        cache.sink_k.stride(0), cache.sink_k.stride(1), cache.sink_k.stride(2),
        cache.ring_k.stride(0), cache.ring_k.stride(1), cache.ring_k.stride(2),
        cache.k_codes.stride(0), cache.k_codes.stride(1), cache.k_codes.stride(2),
        cache.v_codes.stride(0), cache.v_codes.stride(1), cache.v_codes.stride(2),
        kst[0], kst[1], kst[2], vst[0], vst[1], vst[2],
        D=D, GROUP=G, P=cfg.quant.page_size, SINK=cfg.quant.sink, RECENT=cfg.quant.recent, G_SIZE=cfg.quant.group_size or D,
        K_MODE=k_mode, V_MODE=v_mode, MIN_PAGES=max(1, config.min_pages_per_split), DOT_FP16=config.dot_fp16, K_FP8=k_fp8, V_FP8=v_fp8,
        BLOCK_G=BLOCK_G, BLOCK_N=config.block_n, BLOCK_D=BLOCK_D, BLOCK_B=pow2_at_least(D // 4), W=cfg.quant.key_split,
        TOP=cfg.quant.key_top, STORED=D - cfg.quant.key_drop, NPARTS=len(cfg.key_parts) if cfg.quant.key_split else 2,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )

    out = torch.empty(B, Hq, D, dtype=q.dtype, device=dev)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=dev)
    _merge_kernel[(B, H)](
        o_part, lse_part, rot.rot_v, out, lse, out.stride(0), out.stride(1), splits + 1,
        D=D, GROUP=G, ROTATE=not rot.identity, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D,
    )
    return (out, lse) if return_lse else out
