"""Triton kernel (a): rotate + quantize + pack whole pages into the pool.

One program per (page, KV head) quantizes P tokens x D channels (split keys, MODE_SPLIT: two per-token
groups of unequal width, the wide one's top bits in TOP planes of W/8 extra bytes per row, the channels after
the second group not stored). The work is laid
out as PER = 8 // BITS strided column tiles: tile i holds channels j*PER + i for
j < D*BITS/8, so the byte j of a token is sum_i code_i(j) << (BITS*i) and packing
needs no reshape (works for any D that is a multiple of PER, power of two or not).

Rounding is exactly `oscar.quant`: scale = fp16(max((hi - lo)/levels, 1e-8)),
zero = fp16(lo), code = clamp(floor((x - zero) / scale + 0.5), 0, levels), with
IEEE division (`div_rn`) so the codes are bit-identical to the torch reference.
A zero fp16 scale (a constant group) gives 0/0 = NaN in both: code 0.

8-bit params (cfg.quant.torch_param_dtype = float8_e4m3fn, FP8=True): zero = e4m3 rounded down from lo,
scale = e4m3 rounded up from (hi - zero) / levels (quant.fp8_round, computed here with
integer ops on the fp32 bits so the result is exact and the same on every GPU); the
params are stored as their bit patterns through a uint8 view of the pool's fp8 tensors.
The pool refuses pages beyond e4m3's range before calling the kernel; here the code
saturates at 448 rather than producing NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from oscar.common import OscarError
from oscar.kernels.triton_common import MODE_CHANNEL, MODE_SPLIT, MODE_STATIC, MODE_TOKEN, e4m3_bits, e4m3_value, pow2_at_least
from oscar.quant import FP8_PARAM

if TYPE_CHECKING:
    from oscar.kernels.paged import PagedLayerCache


@triton.jit
def _round_bf16(x):
    """fp32 -> nearest bf16 (ties to even), as fp32. Written out with integer ops because
    the Triton interpreter's .to(tl.bfloat16) truncates while torch and the GPU round."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _load_tile(X, R, MEAN, x_base, r_base, m_base, offs_t, offs_c, offs_e, t_mask, c_mask, e_mask,
               D: tl.constexpr, ROTATE: tl.constexpr, CENTER: tl.constexpr, ROUND: tl.constexpr):
    """Tokens x channels offs_c of a page, rotated ((x - mu) @ R) and rounded like the cache stores them."""
    if ROTATE:
        x = tl.load(X + x_base + offs_t[:, None] * D + offs_e[None, :], mask=t_mask[:, None] & e_mask[None, :],
                    other=0.0).to(tl.float32)  # (BLOCK_P, BLOCK_D)
        if CENTER:
            x = x - tl.load(MEAN + m_base + offs_e, mask=e_mask, other=0.0)[None, :]
        r = tl.load(R + r_base + offs_e[:, None] * D + offs_c[None, :], mask=e_mask[:, None] & c_mask[None, :],
                    other=0.0)  # (BLOCK_D, BLOCK_B): the columns of R for these channels
        x = tl.dot(x, r, input_precision="ieee")  # (BLOCK_P, BLOCK_B)
        if ROUND == 1:
            x = _round_bf16(x)
        elif ROUND == 2:
            x = x.to(tl.float16).to(tl.float32)
    else:
        x = tl.load(X + x_base + offs_t[:, None] * D + offs_c[None, :], mask=t_mask[:, None] & c_mask[None, :],
                    other=0.0).to(tl.float32)
    return x


@triton.jit
def _params(lo, hi, LEVELS: tl.constexpr, FP8: tl.constexpr):
    """(scale, zero) as stored (fp16, or e4m3 bits as uint8) and as fp32 values, from a clipped range."""
    if FP8:
        zb = e4m3_bits(lo, False)
        zf = e4m3_value(zb)
        sb = e4m3_bits(tl.maximum(tl.math.div_rn(hi - zf, LEVELS * 1.0), 1e-8), True)
        return sb.to(tl.uint8), zb.to(tl.uint8), e4m3_value(sb), zf
    s16 = tl.maximum(tl.math.div_rn(hi - lo, LEVELS * 1.0), 1e-8).to(tl.float16)
    z16 = lo.to(tl.float16)
    return s16, z16, s16.to(tl.float32), z16.to(tl.float32)


@triton.jit
def _code(x, s, z, LEVELS: tl.constexpr):
    """The project's rounding rule on fp16-rounded params s, z (fp32 values)."""
    c = tl.floor(tl.math.div_rn(x - z, s) + 0.5)
    c = tl.where(c != c, 0.0, c)  # 0/0 (constant group, zero scale) -> code 0, like torch
    return tl.minimum(tl.maximum(c, 0.0), LEVELS).to(tl.int32)


@triton.jit
def _token_group_params(X, R, MEAN, CLIP, x_base, r_base, m_base, h, g: tl.constexpr, offs_t, offs_j, offs_e, t_mask,
                        j_mask, e_mask, D: tl.constexpr, G: tl.constexpr, PER: tl.constexpr, LEVELS: tl.constexpr,
                        ROTATE: tl.constexpr, CENTER: tl.constexpr, ROUND: tl.constexpr, BLOCK_P: tl.constexpr,
                        FP8: tl.constexpr, W: tl.constexpr = 0, NPARTS: tl.constexpr = 2):
    """(scale, zero) of channel group g for every token of the page, stored and fp32: (BLOCK_P,) each.
    W > 0 (split keys): group 0 is channels [0, W), group 1 [W, D), each with its own clip ratio (clip_k (Hkv, NPARTS))."""
    lo = tl.full((BLOCK_P,), float("inf"), tl.float32)
    hi = tl.full((BLOCK_P,), float("-inf"), tl.float32)
    for i in tl.static_range(PER):
        offs_c = offs_j * PER + i
        x = _load_tile(X, R, MEAN, x_base, r_base, m_base, offs_t, offs_c, offs_e, t_mask, j_mask, e_mask,
                       D, ROTATE, CENTER, ROUND)
        if W == 0:
            in_c = (offs_c // G) == g
        elif g == 0:
            in_c = offs_c < W
        else:
            in_c = offs_c >= W
        in_g = t_mask[:, None] & (j_mask & in_c)[None, :]
        lo = tl.minimum(lo, tl.min(tl.where(in_g, x, float("inf")), axis=1))
        hi = tl.maximum(hi, tl.max(tl.where(in_g, x, float("-inf")), axis=1))
    if W == 0:
        r = tl.load(CLIP + h)
    else:
        r = tl.load(CLIP + h * NPARTS + g)
    lo, hi = lo * r, hi * r  # minmax clip: a ratio applied to both ends (quant.choose_qparams)
    return _params(lo, hi, LEVELS, FP8)


@triton.jit
def _quantize_pages_kernel(
    X, R, MEAN, CLIP, SSTAT, ZSTAT, PAGE_IDS, CODES, SCALE, ZERO,
    stride_xn, stride_xh,  # X: (N, Hkv, P, D) contiguous in (P, D)
    stride_cn, stride_ch, stride_ct,  # CODES: (pool, Hkv, P, D*BITS/8)
    stride_sn, stride_sh, stride_st,  # SCALE/ZERO: (pool, Hkv, P, NG) token | (pool, Hkv, D) channel
    P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr,
    MODE: tl.constexpr, ROTATE: tl.constexpr, CENTER: tl.constexpr, ROUND: tl.constexpr, FP8: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
    W: tl.constexpr = 0, BLOCK_W: tl.constexpr = 16,  # split keys: wide channels, a block over their W/8 top-bit bytes
    TOP: tl.constexpr = 1,  # split keys: the wide channels' bits above BITS (one plane of W/8 bytes each)
    STORED: tl.constexpr = 0,  # channels [0, STORED) are stored (D; split keys: D - key_drop)
    NPARTS: tl.constexpr = 2,  # split keys: 2, or 1 when W = STORED (every stored channel wide)
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    NB: tl.constexpr = STORED // PER  # bytes per token row (of the low plane)
    page = tl.load(PAGE_IDS + n).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_P)
    offs_j = tl.arange(0, BLOCK_B)  # byte column
    offs_e = tl.arange(0, BLOCK_D)
    t_mask = offs_t < P
    j_mask = offs_j < NB
    e_mask = offs_e < D
    x_base = n.to(tl.int64) * stride_xn + h * stride_xh
    r_base = h * D * D
    m_base = h * D
    valid = t_mask[:, None] & j_mask[None, :]

    byte = tl.zeros((BLOCK_P, BLOCK_B), tl.int32)
    if MODE == 3:
        # split keys: part 0 (channels < W) at BITS + TOP, part 1 (W <= c < STORED) at BITS, each its own
        # per-token pair (stored at group 0 / 1; W = STORED: part 0 only); channels from STORED on are not stored. The low BITS of
        # every stored code go to the byte tiles as usual; bit BITS + p of the wide channels to plane p of W/8
        # bytes, channel c at bit c % 8 of byte NB + p*W/8 + c // 8 (quant.pack_planes)
        LEV_W: tl.constexpr = (1 << (BITS + TOP)) - 1
        s0, z0, sf0, zf0 = _token_group_params(X, R, MEAN, CLIP, x_base, r_base, m_base, h, 0, offs_t, offs_j, offs_e, t_mask,
                                               j_mask, e_mask, D, G, PER, LEV_W, ROTATE, CENTER, ROUND, BLOCK_P, FP8, W,
                                               NPARTS)
        so = page * stride_sn + h * stride_sh + offs_t * stride_st
        tl.store(SCALE + so, s0, mask=t_mask)
        tl.store(ZERO + so, z0, mask=t_mask)
        if NPARTS == 2:  # a narrow part (W = STORED: every stored channel is wide, one pair per token)
            s1, z1, sf1, zf1 = _token_group_params(X, R, MEAN, CLIP, x_base, r_base, m_base, h, 1, offs_t, offs_j, offs_e,
                                                   t_mask, j_mask, e_mask, D, G, PER, LEVELS, ROTATE, CENTER, ROUND,
                                                   BLOCK_P, FP8, W, NPARTS)
            tl.store(SCALE + so + 1, s1, mask=t_mask)
            tl.store(ZERO + so + 1, z1, mask=t_mask)
        else:
            sf1, zf1 = sf0, zf0
        for i in tl.static_range(PER):
            offs_c = offs_j * PER + i
            x = _load_tile(X, R, MEAN, x_base, r_base, m_base, offs_t, offs_c, offs_e, t_mask, j_mask, e_mask,
                           D, ROTATE, CENTER, ROUND)
            code = tl.where((offs_c < W)[None, :], _code(x, sf0[:, None], zf0[:, None], LEV_W),
                            _code(x, sf1[:, None], zf1[:, None], LEVELS))
            byte += (code & LEVELS) << (BITS * i)
        offs_m = tl.arange(0, BLOCK_W)  # top-bit byte column
        m_mask = offs_m < W // 8
        for p in tl.static_range(TOP):
            top = tl.zeros((BLOCK_P, BLOCK_W), tl.int32)
            for i in tl.static_range(8):
                offs_c = offs_m * 8 + i
                x = _load_tile(X, R, MEAN, x_base, r_base, m_base, offs_t, offs_c, offs_e, t_mask, m_mask, e_mask,
                               D, ROTATE, CENTER, ROUND)
                top += ((_code(x, sf0[:, None], zf0[:, None], LEV_W) >> (BITS + p)) & 1) << i
            to = page * stride_cn + h * stride_ch + offs_t[:, None] * stride_ct + NB + p * (W // 8) + offs_m[None, :]
            tl.store(CODES + to, top.to(tl.uint8), mask=t_mask[:, None] & m_mask[None, :])
    elif MODE == 0:
        # token groups: per group g, its fp16 params from the group's range (one pass over the
        # PER column tiles), then the codes of its channels (a second pass)
        for g in tl.static_range(NG):
            s_g, z_g, sf, zf = _token_group_params(X, R, MEAN, CLIP, x_base, r_base, m_base, h, g, offs_t, offs_j,
                                                   offs_e, t_mask, j_mask, e_mask, D, G, PER, LEVELS, ROTATE, CENTER,
                                                   ROUND, BLOCK_P, FP8)
            so = page * stride_sn + h * stride_sh + offs_t * stride_st + g
            tl.store(SCALE + so, s_g, mask=t_mask)
            tl.store(ZERO + so, z_g, mask=t_mask)
            for i in tl.static_range(PER):
                offs_c = offs_j * PER + i
                x = _load_tile(X, R, MEAN, x_base, r_base, m_base, offs_t, offs_c, offs_e, t_mask, j_mask, e_mask,
                               D, ROTATE, CENTER, ROUND)
                code = _code(x, sf[:, None], zf[:, None], LEVELS)
                byte += tl.where(((offs_c // G) == g)[None, :], code, 0) << (BITS * i)
    else:
        for i in tl.static_range(PER):
            offs_c = offs_j * PER + i
            x = _load_tile(X, R, MEAN, x_base, r_base, m_base, offs_t, offs_c, offs_e, t_mask, j_mask, e_mask,
                           D, ROTATE, CENTER, ROUND)
            if MODE == 1:  # KIVI: range of each channel over the page's P tokens
                lo = tl.min(tl.where(valid, x, float("inf")), axis=0)
                hi = tl.max(tl.where(valid, x, float("-inf")), axis=0)
                r = tl.load(CLIP + h)
                lo, hi = lo * r, hi * r
                s_st, z_st, sf, zf = _params(lo, hi, LEVELS, FP8)
                so = page * stride_sn + h * stride_sh + offs_c
                tl.store(SCALE + so, s_st, mask=j_mask)
                tl.store(ZERO + so, z_st, mask=j_mask)
                s = sf[None, :]
                z = zf[None, :]
            else:  # static: layer constants (Hkv, D)
                s = tl.load(SSTAT + h * D + offs_c, mask=j_mask, other=1.0).to(tl.float32)[None, :]
                z = tl.load(ZSTAT + h * D + offs_c, mask=j_mask, other=0.0).to(tl.float32)[None, :]
            byte += _code(x, s, z, LEVELS) << (BITS * i)
    co = page * stride_cn + h * stride_ch + offs_t[:, None] * stride_ct + offs_j[None, :]
    tl.store(CODES + co, byte.to(tl.uint8), mask=valid)


def supports(cfg) -> bool:
    """Ratio clips with fp16 or 8-bit (e4m3) scale/zero (keys and values); not the published format (row-quantile,
    float32)."""
    ok = (torch.float16, FP8_PARAM)
    return cfg.quant.clip_rule == "ratio" and cfg.quant.torch_param_dtype in ok and cfg.quant.torch_key_param_dtype in ok


def quantize_pages_into(cache: PagedLayerCache, ids: torch.Tensor, x: torch.Tensor, which: str,
                        rotate: bool = False) -> None:
    """Quantize pages x (N, Hkv, P, D) of keys or values into the pool of `cache` at page ids (N,).

    rotate=False: x is already rotated and rounded to cfg.dtype (what the cache stores).
    rotate=True: x is in the model space; the kernel applies (x - mu) @ R and rounds to
    cfg.dtype itself (fp32 IEEE dot, so equal to the torch rotation up to summation order).
    """
    cfg = cache.cfg
    if not supports(cfg):
        raise OscarError(f"the Triton page quantizer does not implement clip_rule={cfg.quant.clip_rule!r} / "
                         f"param_dtype={cfg.quant.torch_param_dtype} (the published OSCAR format); use the reference "
                         "(oscar.kernels.dispatch.quantize_pages falls back to it)")
    N, H, P, D = x.shape
    assert (H, P, D) == (cfg.num_kv_heads, cfg.quant.page_size, cfg.head_dim), f"pages {tuple(x.shape)} vs cache {cfg}"
    assert ids.shape == (N,) and which in ("k", "v")
    if x.device != cache.k_codes.device:
        raise OscarError(f"pages on {x.device}, cache on {cache.k_codes.device}")
    if N == 0:
        return
    x = x.contiguous()
    rot = cache.rot
    mode = MODE_STATIC if cfg.quant.mode == "static" else (MODE_CHANNEL if which == "k" and cfg.quant.key_axis == "channel" else MODE_TOKEN)
    W = cfg.quant.key_split if which == "k" else 0
    if W:
        assert cfg.quant.bits == 2 and W % 8 == 0, f"split keys: INT2 with whole top-bit bytes, got {cfg.quant}"
        mode = MODE_SPLIT
    codes = getattr(cache, f"{which}_codes")
    scale, zero = getattr(cache, f"{which}_scale"), getattr(cache, f"{which}_zero")
    clip = (rot.clip_k if which == "k" else rot.clip_v).float().contiguous()
    R = rot.rot_k if which == "k" else rot.rot_v
    center = which == "k" and rot.k_mean is not None
    do_rotate = rotate and not rot.identity
    round_code = {torch.bfloat16: 1, torch.float16: 2}.get(cfg.dtype, 0)
    ss = scale.stride() if mode != MODE_STATIC else (0, 0, 0)
    G = cfg.quant.group_size or D
    pdt = cfg.quant.torch_key_param_dtype if which == "k" else cfg.quant.torch_param_dtype
    fp8 = pdt == FP8_PARAM and mode != MODE_STATIC
    if fp8:  # the kernel writes e4m3 bit patterns it computed itself (directed rounding)
        scale, zero = scale.view(torch.uint8), zero.view(torch.uint8)
    _quantize_pages_kernel[(N, H)](
        x, R.contiguous(), rot.k_mean if center else clip, clip, scale, zero, ids.to(torch.int32), codes, scale, zero,
        x.stride(0), x.stride(1),
        codes.stride(0), codes.stride(1), codes.stride(2),
        ss[0], ss[1], ss[2] if mode in (MODE_TOKEN, MODE_SPLIT) else 0,
        P=P, D=D, G=G, NG=D // G, BITS=cfg.quant.bits, MODE=mode, ROTATE=do_rotate, CENTER=center and do_rotate,
        ROUND=round_code, FP8=fp8, BLOCK_P=pow2_at_least(P), BLOCK_D=pow2_at_least(D), BLOCK_B=pow2_at_least(cfg.packed_dim),
        W=W, BLOCK_W=pow2_at_least(max(W // 8, 1)), TOP=cfg.quant.key_top, STORED=D - cfg.quant.key_drop if W else D,
        NPARTS=len(cfg.key_parts) if W else 2,
    )


def quantize_pages(cache: PagedLayerCache, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Dispatch target: rotated pages k, v (N, Hkv, P, D) -> pool (same contract as reference.quantize_pages)."""
    quantize_pages_into(cache, ids, k, "k")
    quantize_pages_into(cache, ids, v, "v")
