"""Triton kernel (b): fused paged decode attention over the mixed-precision cache.

One query token per sequence, B sequences of different lengths. Three launches:

1. `_rotate_q_kernel` (B, Hkv): q_rot = q @ R_K and the key-mean term q . mu, once per
   query (row vectors; q . k = q_rot . k_rot + q . mu since R_K is orthogonal and the
   cache stores k_rot = (k - mu) @ R_K).
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from oscar.kernels.paged import PagedLayerCache

LOG2E = 1.4426950408889634
MODE_TOKEN, MODE_CHANNEL, MODE_STATIC = 0, 1, 2


@dataclass
class DecodeConfig:
    """Launch parameters. num_splits=None: enough programs to fill the device
    (about 4 per SM over B * Hkv), never fewer than min_pages_per_split pages each."""

    block_n: int = 64  # tokens per tile
    num_splits: int | None = None
    min_pages_per_split: int = 16
    max_splits: int = 128
    num_warps: int = 4
    num_stages: int = 2
    dot_fp16: bool = True  # fp16 tensor-core dots (fp32 accumulate); False: fp32 IEEE dots

    def splits_for(self, batch: int, kv_heads: int, max_pages: int, device: torch.device) -> int:
        if self.num_splits is not None:
            return max(1, self.num_splits)
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            sms = 2  # interpreter: keep the grid small
        want = triton.cdiv(4 * sms, batch * kv_heads)
        cap = max(1, triton.cdiv(max_pages, self.min_pages_per_split))
        return max(1, min(want, cap, self.max_splits))


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


@triton.jit
def _decode_split_kernel(
    QROT, QMU, SEQ_LENS, SLOTS, BLOCK_TABLES,
    SINK_K, SINK_V, RING_K, RING_V,
    K_CODES, V_CODES, K_SCALE, K_ZERO, V_SCALE, V_ZERO,
    O_PART, LSE_PART,
    qk_scale,
    stride_bt,  # block table row
    stride_sb, stride_sh, stride_st,  # sink (max_seqs, Hkv, S, D); ring has the same strides but its own token count
    stride_rb, stride_rh, stride_rt,
    stride_cn, stride_ch, stride_ct,  # codes (pool, Hkv, P, D*BITS/8)
    stride_ksn, stride_ksh, stride_kst,  # key params: token (pool, Hkv, P, NG) | channel (pool, Hkv, D) | static (Hkv, D)
    stride_vsn, stride_vsh, stride_vst,  # value params: token | static
    D: tl.constexpr, GROUP: tl.constexpr, P: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
    G_SIZE: tl.constexpr, BITS: tl.constexpr, K_MODE: tl.constexpr, V_MODE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_FP16: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    HKV = tl.num_programs(1)
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    RING: tl.constexpr = RECENT + P

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    heads = b * (GROUP * HKV) + h * GROUP + offs_g  # flat (B, Hq) index
    q = tl.load(QROT + heads[:, None] * D + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q * qk_scale  # logits in base 2: s = log2(e) * scale * q.k
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
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)

    if split == 0:
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
    else:
        # INT2 history: pages [p0, p1) of this sequence
        per_split = tl.cdiv(n_pages, NUM_SPLITS)
        p0 = (split - 1) * per_split
        p1 = tl.minimum(p0 + per_split, n_pages)
        byte_d = offs_d // PER  # byte holding channel d, and its bit offset
        shift_d = (offs_d % PER) * BITS
        if K_MODE == 2:
            ks = tl.load(K_SCALE + h * stride_ksh + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            kz = tl.load(K_ZERO + h * stride_ksh + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        if V_MODE == 2:
            vs = tl.load(V_SCALE + h * stride_vsh + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            vz = tl.load(V_ZERO + h * stride_vsh + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        for start in range(p0 * P, p1 * P, BLOCK_N):
            t = start + offs_n  # token index within the history
            valid = t < p1 * P
            page = tl.load(BLOCK_TABLES + b * stride_bt + t // P, mask=valid, other=0).to(tl.int64)
            row = t % P
            mask2 = valid[:, None] & d_mask[None, :]
            cptr = page[:, None] * stride_cn + h * stride_ch + row[:, None] * stride_ct + byte_d[None, :]
            kc = ((tl.load(K_CODES + cptr, mask=mask2, other=0).to(tl.int32) >> shift_d[None, :]) & MASK).to(tl.float32)
            vc = ((tl.load(V_CODES + cptr, mask=mask2, other=0).to(tl.int32) >> shift_d[None, :]) & MASK).to(tl.float32)
            if K_MODE == 0:  # per token and channel group
                sp = page[:, None] * stride_ksn + h * stride_ksh + row[:, None] * stride_kst + (offs_d // G_SIZE)[None, :]
                ks = tl.load(K_SCALE + sp, mask=mask2, other=0.0).to(tl.float32)
                kz = tl.load(K_ZERO + sp, mask=mask2, other=0.0).to(tl.float32)
            elif K_MODE == 1:  # KIVI: per channel of the page
                sp = page[:, None] * stride_ksn + h * stride_ksh + offs_d[None, :]
                ks = tl.load(K_SCALE + sp, mask=mask2, other=0.0).to(tl.float32)
                kz = tl.load(K_ZERO + sp, mask=mask2, other=0.0).to(tl.float32)
            if V_MODE == 0:
                sp = page[:, None] * stride_vsn + h * stride_vsh + row[:, None] * stride_vst + (offs_d // G_SIZE)[None, :]
                vs = tl.load(V_SCALE + sp, mask=mask2, other=0.0).to(tl.float32)
                vz = tl.load(V_ZERO + sp, mask=mask2, other=0.0).to(tl.float32)
            k = tl.where(mask2, kc * ks + kz, 0.0)  # dequantized in registers, rotated space
            v = tl.where(mask2, vc * vs + vz, 0.0)
            m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, qmu, DOT_FP16)

    # this split's normalised output and log2-sum-exp (-inf when it saw no token)
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
    part = heads * (NUM_SPLITS + 1) + split
    tl.store(O_PART + part[:, None] * D + offs_d[None, :], o, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(LSE_PART + part, lse, mask=g_mask)


@triton.jit
def _merge_kernel(O_PART, LSE_PART, R, OUT, LSE, stride_ob, stride_oh,
                  D: tl.constexpr, GROUP: tl.constexpr, NUM_PARTS: tl.constexpr, ROTATE: tl.constexpr,
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
    for s in range(NUM_PARTS):
        part = heads * NUM_PARTS + s
        lse_s = tl.load(LSE_PART + part, mask=g_mask, other=float("-inf"))
        o_s = tl.load(O_PART + part[:, None] * D + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
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


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def decode_attention(q: torch.Tensor, cache: PagedLayerCache, seqs: list[int], scale: float | None = None,
                     return_lse: bool = False, config: DecodeConfig | None = None):
    """Same contract as reference.decode_attention: q (B, Hq, D) -> o (B, Hq, D) [, lse (B, Hq)]."""
    cfg, rot = cache.cfg, cache.rot
    config = config or DecodeConfig()
    B, Hq, D = q.shape
    H = cfg.num_kv_heads
    assert D == cfg.head_dim and Hq % H == 0, f"q {tuple(q.shape)} vs cache Hkv={H}, D={cfg.head_dim}"
    assert q.device == cache.k_codes.device, f"q on {q.device}, cache on {cache.k_codes.device}"
    assert cfg.bits in (1, 2, 4, 8) and D % (8 // cfg.bits) == 0
    G = Hq // H
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    dev = q.device
    block_tables, seq_lens, slots = cache.batch_tables(seqs)
    q = q.contiguous()
    BLOCK_G, BLOCK_D = _pow2(G), _pow2(D)

    q_rot = torch.empty(B, Hq, D, dtype=torch.float32, device=dev)
    q_mu = torch.empty(B, Hq, dtype=torch.float32, device=dev)
    center = rot.k_mean is not None
    _rotate_q_kernel[(B, H)](
        q, rot.rot_k, rot.k_mean if center else q_mu, q_rot, q_mu, q.stride(0), q.stride(1),
        D=D, GROUP=G, ROTATE=not rot.identity, CENTER=center, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D,
    )

    splits = config.splits_for(B, H, block_tables.shape[1], dev)
    o_part = torch.empty(B, Hq, splits + 1, D, dtype=torch.float32, device=dev)
    lse_part = torch.empty(B, Hq, splits + 1, dtype=torch.float32, device=dev)
    k_mode = MODE_STATIC if cfg.mode == "static" else (MODE_CHANNEL if cfg.key_axis == "channel" else MODE_TOKEN)
    v_mode = MODE_STATIC if cfg.mode == "static" else MODE_TOKEN
    kst, vst = _param_strides(cache.k_scale), _param_strides(cache.v_scale)
    _decode_split_kernel[(B, H, splits + 1)](
        q_rot, q_mu, seq_lens, slots, block_tables,
        cache.sink_k, cache.sink_v, cache.ring_k, cache.ring_v,
        cache.k_codes, cache.v_codes, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero,
        o_part, lse_part,
        scale * LOG2E,
        block_tables.stride(0),
        cache.sink_k.stride(0), cache.sink_k.stride(1), cache.sink_k.stride(2),
        cache.ring_k.stride(0), cache.ring_k.stride(1), cache.ring_k.stride(2),
        cache.k_codes.stride(0), cache.k_codes.stride(1), cache.k_codes.stride(2),
        kst[0], kst[1], kst[2], vst[0], vst[1], vst[2],
        D=D, GROUP=G, P=cfg.page_size, SINK=cfg.sink, RECENT=cfg.recent, G_SIZE=cfg.group_size or D,
        BITS=cfg.bits, K_MODE=k_mode, V_MODE=v_mode, NUM_SPLITS=splits, DOT_FP16=config.dot_fp16,
        BLOCK_G=BLOCK_G, BLOCK_N=config.block_n, BLOCK_D=BLOCK_D,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )

    out = torch.empty(B, Hq, D, dtype=q.dtype, device=dev)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=dev)
    _merge_kernel[(B, H)](
        o_part, lse_part, rot.rot_v, out, lse, out.stride(0), out.stride(1),
        D=D, GROUP=G, NUM_PARTS=splits + 1, ROTATE=not rot.identity, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D,
    )
    return (out, lse) if return_lse else out
