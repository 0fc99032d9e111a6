"""The one family of quantization primitives: choose params / quantize / dequantize / pack.

Every quantizer in the project (cache formats, fit's clip search, the ablation's
scalar schemes, fake-quant validation) is built from these functions, so a clip
searched at fit time is optimal for exactly the format the kernel stores.
Pure torch, no project imports: this module is the leaf both `stats` and the
Triton kernels depend on (see docs/decisions/0028-kernels-rounding-identical-in-torch-and-triton.md).

Conventions
- Asymmetric uniform grid: ``x_hat = code * scale + zero`` with
  ``code in [0, 2**bits - 1]``; ``zero`` is the low end of the range.
- Rounding rule: ``code = clamp(floor((x - zero) / scale + 0.5), 0, 2**bits-1)``
  (round half up). Triton kernels use the same expression. A constant group (hi == lo)
  has a scale that rounds to 0 in fp16 (the 1e-8 floor is below fp16's smallest
  subnormal): its 0/0 is code 0, so it dequantizes to ``zero`` = the constant, exactly.
  (fake_quant once kept the NaN: under bfloat16 compute, Qwen2.5's large key biases
  make whole 64-token channel groups one bf16 value, and KIVI keys turned to NaN.)
- ``scale`` and ``zero`` are rounded to ``spec.param_dtype`` (fp16 by default)
  *before* quantizing, so the reference reproduces what a kernel that stores
  fp16 parameters computes.
- 8-bit parameters (``param_dtype=torch.float8_e4m3fn``, FP8_PARAM): 3 mantissa bits
  make round-to-nearest params too coarse to keep the grid on the data, so they are
  rounded *directionally, first*: ``zero = fp8_down(lo)`` (largest e4m3 <= lo), then
  ``scale = fp8_up(max((hi - zero) / levels, 1e-8))`` (smallest e4m3 >= it), so
  ``[zero, zero + levels * scale]`` still covers ``[lo, hi]``; codes are then chosen
  against that rounded grid (the same rule as above). e4m3 has no inf and torch
  saturates on conversion, so a group whose range leaves [-448, 448] (or holds a
  NaN) raises ``ValueError`` instead of being silently clamped; tiny
  ranges lose nothing but precision (scales round up to at least 2**-9). Static mode
  stores no per-token parameters; its layer constants stay fp16 whatever param_dtype says.
- Groups. ``axis="token"``: each token's D channels split in groups of
  ``group_size`` (default D), one (scale, zero) per token and group.
  ``axis="channel"`` (KIVI keys): each channel over a group of ``group_size``
  consecutive tokens, one (scale, zero) per channel and token group.
- ``mode="minmax"``: range = [min, max] of the group, shrunk by ``clip`` (a ratio
  in (0, 1]). With ``clip_rule="row-quantile"`` (the published OSCAR code's fixed
  clipping) the group is first clamped to ±(the ``clip``-quantile of its |values|),
  then its min/max are taken. ``mode="static"``: symmetric range [-clip, clip] with ``clip`` an
  absolute threshold (per channel, head, or scalar) taken from the artifact; no
  per-token metadata is stored.
- Packing: 8 // bits codes per byte, code i of a byte in bits
  ``[bits*i, bits*(i+1))`` (little-endian within the byte), along the last dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

FP8_PARAM = torch.float8_e4m3fn  # the 8-bit scale/zero format
FP8_MAX = 448.0  # largest finite e4m3fn
PARAM_DTYPES = (torch.float16, torch.float32, FP8_PARAM)

Axis = Literal["token", "channel"]
Mode = Literal["minmax", "static"]


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 2
    axis: Axis = "token"
    group_size: int | None = None  # None: D for axis="token"; required for axis="channel"
    mode: Mode = "minmax"
    param_dtype: torch.dtype = torch.float16
    clip_rule: Literal["ratio", "row-quantile"] = "ratio"  # how minmax mode applies `clip`

    def __post_init__(self):
        if not (isinstance(self.bits, int) and 1 <= self.bits <= 8):
            raise ValueError(f"bits must be an integer in 1..8, got {self.bits!r}")
        if self.axis not in ("token", "channel"):
            raise ValueError(f"axis must be 'token' or 'channel', got {self.axis!r}")
        if self.mode not in ("minmax", "static"):
            raise ValueError(f"mode must be 'minmax' or 'static', got {self.mode!r}")
        if self.mode == "static" and self.axis != "token":
            raise ValueError("static mode stores no per-group metadata; use axis='token'")
        if self.clip_rule not in ("ratio", "row-quantile"):
            raise ValueError(f"clip_rule must be 'ratio' or 'row-quantile', got {self.clip_rule!r}")
        if self.axis == "channel" and not self.group_size:
            raise ValueError("axis='channel' needs group_size (tokens per group)")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype must be one of {PARAM_DTYPES}, got {self.param_dtype}")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def group(self, head_dim: int) -> int:
        g = self.group_size or head_dim
        if self.axis == "token" and head_dim % g:
            raise ValueError(f"group_size {g} does not divide head_dim {head_dim}")
        return g

    def bits_per_element(self, head_dim: int) -> float:
        """Exact storage cost per element, metadata included."""
        if self.mode == "static":
            return float(self.bits)
        pbits = 2 * torch.finfo(self.param_dtype).bits  # scale + zero
        return self.bits + pbits / self.group(head_dim)


def _grouped(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """View x (..., T, D) as groups along the last dim: (..., T, D//G, G) or (..., D, T//G, G)."""
    D = x.shape[-1]
    g = spec.group(D)
    if spec.axis == "token":
        return x.reshape(*x.shape[:-1], D // g, g)
    T = x.shape[-2]
    if T % g:
        raise ValueError(f"axis='channel' needs T ({T}) to be a multiple of group_size ({g})")
    return x.transpose(-1, -2).reshape(*x.shape[:-2], D, T // g, g)


def _ungrouped(xg: torch.Tensor, spec: QuantSpec, shape: torch.Size) -> torch.Tensor:
    if spec.axis == "token":
        return xg.reshape(shape)
    return xg.reshape(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)


def _row_quantile(a: torch.Tensor, q: torch.Tensor | float) -> torch.Tensor:
    """The q-quantile of each row of a (..., G) (linear interpolation, as torch.quantile) -> (..., 1).

    q: a float or a tensor broadcastable to a.shape[:-1], the (scale, zero) layout (e.g. one ratio per KV head).
    High quantiles (the clipping use) read the few order statistics they need from topk instead of a
    full sort: the same values, hence the same result.
    """
    G = a.shape[-1]
    qt = torch.as_tensor(q, dtype=a.dtype, device=a.device)
    pos = torch.broadcast_to(qt, a.shape[:-1]).unsqueeze(-1) * (G - 1)  # (..., 1), as torch.quantile's ranks
    below = pos.floor().long().clamp(0, G - 1)
    above = (below + 1).clamp(max=G - 1)
    k = G - int(below.min())  # order statistics from `below` up
    if k <= G // 4:
        top = a.topk(k, dim=-1, largest=True, sorted=True).values  # (..., k) descending: index t <-> ascending G-1-t
        lo, hi = top.gather(-1, G - 1 - below), top.gather(-1, G - 1 - above)
    else:
        srt = a.sort(-1).values
        lo, hi = srt.gather(-1, below), srt.gather(-1, above)
    return torch.lerp(lo, hi, pos - below.to(a.dtype))


def choose_qparams(
    x: torch.Tensor, spec: QuantSpec, clip: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero for x (..., T, D); shapes (..., T, D//G) or (..., D, T//G) for groups.

    minmax: ``clip`` is a ratio in (0, 1] applied to both ends of the range.
    static: ``clip`` is the absolute threshold c > 0 (broadcast over the group
    layout, e.g. a tensor (..., 1, D//G) or a float); the grid spans [-c, c].
    """
    return _params(_grouped(x.float(), spec), spec, clip)


def _params(g: torch.Tensor, spec: QuantSpec, clip) -> tuple[torch.Tensor, torch.Tensor]:
    """choose_qparams on x already grouped: g (..., groups, G) float32."""
    if spec.mode == "static":
        if clip is None:
            raise ValueError("static mode needs clip thresholds")
        c = torch.as_tensor(clip, dtype=torch.float32, device=g.device)
        c = torch.broadcast_to(c, g.shape[:-1])
        lo, hi = -c, c
    else:
        if clip is not None and spec.clip_rule == "row-quantile":
            t = _row_quantile(g.abs(), clip)  # (..., groups, 1)
            g = torch.minimum(torch.maximum(g, -t), t)
            clip = None
        # the same values either way; on CPU amin + amax is ~8x faster than aminmax over contiguous groups
        # of 64, aminmax ~3x faster over strided ones
        lo, hi = (g.amin(dim=-1), g.amax(dim=-1)) if g.is_contiguous() else torch.aminmax(g, dim=-1)
        if clip is not None:
            r = torch.as_tensor(clip, dtype=torch.float32, device=g.device)
            lo, hi = lo * r, hi * r
    if spec.param_dtype == FP8_PARAM:
        if spec.mode == "static":  # per-layer constants, no per-token metadata: kept fp16 (what the cache stores)
            scale = ((hi - lo) / spec.levels).clamp_min(1e-8)
            return scale.to(torch.float16), lo.to(torch.float16)
        return _fp8_params(lo, hi, spec.levels)
    scale = ((hi - lo) / spec.levels).clamp_min(1e-8)
    return scale.to(spec.param_dtype), lo.to(spec.param_dtype)


def fp8_round(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x (float32) to the nearest e4m3fn value >= x (up=True) or <= x (up=False): exact directed rounding.

    Raises ValueError for |x| > 448 or NaN: torch's conversion would saturate them silently."""
    x = x.float()
    if not bool((x.abs() <= FP8_MAX).all()):
        bad = x[~(x.abs() <= FP8_MAX)]
        raise ValueError(f"an 8-bit (e4m3) scale/zero cannot hold {bad.abs().max().item():.4g} (finite range "
                         f"+-{FP8_MAX:g}, {bad.numel()} value(s)): this range needs param_dtype=torch.float16")
    neg = x < 0
    mag = x.abs()
    m = mag.to(FP8_PARAM).view(torch.uint8)  # magnitude, round to nearest even: one of the two neighbours
    mf = m.view(FP8_PARAM).float()
    grow = neg ^ up  # the magnitude rounds up when rounding up a positive or down a negative value
    # e4m3 magnitudes are monotone in their bit pattern: one step is +-1 (<= 126 = 448 since |x| <= 448)
    m = torch.where(grow & (mf < mag), m + 1, torch.where(~grow & (mf > mag), m - 1, m))
    return (m | (neg.to(torch.uint8) << 7)).view(FP8_PARAM)


def _fp8_params(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Directed 8-bit rounding, params first: zero = fp8_down(lo), scale = fp8_up((hi - zero) / levels).

    Needs every group range inside [-448, 448] (then the scale is at most 896/levels): ValueError otherwise."""
    if not bool((hi.abs() <= FP8_MAX).all()):
        fp8_round(hi, up=True)  # raises with the offending value
    zero = fp8_round(lo, up=False)
    scale = fp8_round(((hi - zero.float()) / levels).clamp_min(1e-8), up=True)
    return scale, zero


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Integer codes (uint8, same shape as x) under the round-half-up rule."""
    g = _grouped(x.float(), spec)
    s = scale.float().unsqueeze(-1)
    z = zero.float().unsqueeze(-1)
    codes = torch.floor((g - z) / s + 0.5).nan_to_num_(nan=0.0).clamp_(0, spec.levels)  # 0/0: code 0 (below)
    return _ungrouped(codes, spec, x.shape).to(torch.uint8)


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    g = _grouped(codes.float(), spec)
    xg = g * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return _ungrouped(xg, spec, codes.shape).to(dtype)


def fake_quant(x: torch.Tensor, spec: QuantSpec, clip: torch.Tensor | float | None = None) -> torch.Tensor:
    """quantize then dequantize, in x's dtype.

    Bit-identical to ``dequantize(quantize(x, *choose_qparams(x, spec, clip), spec), ...)`` (the codes
    are small integers, exact in float32), in place on one buffer instead of ~10 full-size passes.
    """
    g = _grouped(x.float(), spec)
    if not g.is_contiguous():  # channel groups: one copy makes every pass below contiguous (2x faster)
        g = g.contiguous()
    scale, zero = _params(g, spec, clip)
    s = scale.float().unsqueeze(-1)
    z = zero.float().unsqueeze(-1)
    codes = (g - z).div_(s).add_(0.5).floor_().nan_to_num_(nan=0.0).clamp_(0, spec.levels)  # as quantize()
    return _ungrouped(codes.mul_(s).add_(z), spec, x.shape).to(x.dtype)  # as dequantize()


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (..., D) into (..., D * bits // 8) bytes (bits 1, 2, 4 or 8: whole codes per byte;
    a 3-bit code is stored as a 2-bit and a 1-bit plane, `pack_planes`)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"pack: {bits}-bit codes do not fit whole in a byte (1, 2, 4 or 8); see pack_planes")
    per = 8 // bits
    D = codes.shape[-1]
    if D % per:
        raise ValueError(f"last dim {D} is not a multiple of {per} (codes per byte at {bits} bits)")
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], D // per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack: (..., B) bytes -> (..., B * 8 // bits) uint8 codes."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"unpack: {bits}-bit codes do not fit whole in a byte (1, 2, 4 or 8)")
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


def pack_planes(codes: torch.Tensor, bits: int, wide: int, top: int = 1, stored: int | None = None) -> torch.Tensor:
    """Codes (..., D) whose first `wide` channels have bits + top bits and the rest `bits` (a split key row), the
    channels from `stored` on (default D) not kept -> bytes (..., stored * bits // 8 + top * wide // 8): the low
    `bits` of channels [0, stored) packed as `pack`, then plane p = 0..top-1 of the wide channels' bit bits + p,
    8 per byte (channel c at byte c // 8 of the plane, bit c % 8)."""
    stored = codes.shape[-1] if stored is None else stored
    if wide % 8 or wide > stored or stored > codes.shape[-1] or (stored * bits) % 8 or top < 1:
        raise ValueError(f"pack_planes: {wide} wide channels must be a multiple of 8 and at most the {stored} stored "
                         f"of {codes.shape[-1]}, stored * bits whole bytes, top >= 1 (got top={top})")
    c = codes.to(torch.int32)
    low = pack((c[..., :stored] & ((1 << bits) - 1)).to(torch.uint8), bits)
    tops = [pack(((c[..., :wide] >> (bits + p)) & 1).to(torch.uint8), 1) for p in range(top)]
    return torch.cat([low, *tops], -1)


def unpack_planes(packed: torch.Tensor, bits: int, wide: int, D: int, top: int = 1, stored: int | None = None) -> torch.Tensor:
    """Inverse of pack_planes: (..., stored * bits // 8 + top * wide // 8) bytes -> (..., D) uint8 codes, 0 from
    channel `stored` on."""
    stored = D if stored is None else stored
    nb = stored * bits // 8
    codes = torch.zeros(*packed.shape[:-1], D, dtype=torch.int32, device=packed.device)
    codes[..., :stored] = unpack(packed[..., :nb], bits).to(torch.int32)
    for p in range(top):
        t = unpack(packed[..., nb + p * wide // 8:nb + (p + 1) * wide // 8], 1).to(torch.int32)
        codes[..., :wide] |= t << (bits + p)
    return codes.to(torch.uint8)


def parts_bits_per_element(parts: list[tuple[int, int, QuantSpec]], head_dim: int) -> float:
    """Stored bits per element of a row split into per-token groups [a, b) under their specs (metadata included)."""
    return sum((b - a) * spec.bits_per_element(b - a) for a, b, spec in parts) / head_dim


def fake_quant_parts(x: torch.Tensor, parts: list[tuple[int, int, QuantSpec]], clips: list) -> torch.Tensor:
    """Channels [a, b) of x (..., T, D) as their own per-token group under `spec` and clip (a split key):
    `fake_quant` of each part, in x's dtype. Channels no part covers are not stored: they read as 0."""
    out = torch.zeros_like(x, dtype=torch.float32)
    xf = x.float()
    for (a, b, spec), c in zip(parts, clips):
        out[..., a:b] = fake_quant(xf[..., a:b].contiguous(), spec, c)
    return out.to(x.dtype)

