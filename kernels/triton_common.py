"""@triton.jit helpers and launch constants shared by the page quantizer and the decode kernel.

e4m3 (8-bit scale/zero) is handled as bit patterns with integer ops, so the result is exact and
the same on every GPU and in the interpreter (no native fp8 type needed): `e4m3_bits` encodes
with the directed rounding of `oscar.quant.fp8_round`, `e4m3_value` decodes.
"""

from __future__ import annotations

import triton
import triton.language as tl

# how a side's scale/zero are laid out (the kernels' MODE constexprs); MODE_SPLIT: split keys (QuantConfig.key_split),
# a per-token pair for the wide part and one for the rest, codes as a 2-bit plane + the wide part's top bits
MODE_TOKEN, MODE_CHANNEL, MODE_STATIC, MODE_SPLIT = 0, 1, 2, 3


def pow2_at_least(n: int, lo: int = 16) -> int:
    """A block size: the next power of two >= n, at least lo (tl.dot needs 16)."""
    return max(lo, triton.next_power_of_2(n))


@triton.jit
def e4m3_bits(x, UP: tl.constexpr):
    """fp32 -> e4m3fn bit pattern (int32) rounded towards +inf (UP) or -inf: quant.fp8_round.

    e4m3 magnitudes are monotone in their 7 low bits: normal |x| = 2^e (1 + m/8) has code
    (e + 7) * 8 + m, subnormal |x| = m * 2^-9 has code m, so a carry is just + 1."""
    neg = x < 0
    a = tl.minimum(tl.abs(x), 448.0)  # saturate (the pool refuses such pages first); masked lanes hold inf
    u = a.to(tl.int32, bitcast=True)
    e = (u >> 23) - 127
    if UP:
        grow = x >= 0  # the magnitude rounds up
    else:
        grow = neg
    normal = (e + 7) * 8 + ((u >> 20) & 7) + tl.where(grow & ((u & 0xFFFFF) != 0), 1, 0)
    q = a * 512.0  # subnormal units of 2^-9, exact
    sub = tl.where(grow, tl.ceil(q), tl.floor(q)).to(tl.int32)
    code = tl.minimum(tl.where(a < 0.015625, sub, normal), 126)  # 126 = 448, never the NaN pattern
    return code + tl.where(neg, 128, 0)


@triton.jit
def e4m3_value(bits):
    """e4m3fn bit pattern (int32 in [0, 255]) -> its fp32 value (NaN patterns are never stored)."""
    e = (bits >> 3) & 15
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # exponent bias 7 -> 127
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where(bits >= 128, -mag, mag)
