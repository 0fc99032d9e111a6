"""The quantization primitive family against an explicit per-element loop."""

import itertools

import pytest
import torch

from oscar.quant import FP8_PARAM, QuantSpec, choose_qparams, dequantize, fake_quant, pack, quantize, unpack


def _brute(x, bits, G, ratio=None):
    # One token-group at a time, python floats: the definition in the docstring.
    out = torch.empty_like(x, dtype=torch.float32)
    T, D = x.shape
    L = 2**bits - 1
    for t, g0 in itertools.product(range(T), range(0, D, G)):
        vals = [float(v) for v in x[t, g0:g0 + G]]
        lo, hi = min(vals), max(vals)
        if ratio is not None:
            lo, hi = lo * ratio, hi * ratio
        s = float(torch.tensor(max((hi - lo) / L, 1e-8)).half())
        z = float(torch.tensor(lo).half())
        for j, v in enumerate(vals):
            c = min(max(int(torch.floor(torch.tensor((v - z) / s + 0.5, dtype=torch.float32))), 0), L)
            out[t, g0 + j] = c * s + z
    return out


@pytest.mark.parametrize("bits,G,ratio", [(2, 8, None), (2, 16, 0.8), (4, 8, None), (1, 16, None)])
def test_token_groups_match_brute_force(bits, G, ratio):
    torch.manual_seed(0)
    x = torch.randn(5, 32) * 3
    got = fake_quant(x, QuantSpec(bits=bits, group_size=G), clip=ratio)
    torch.testing.assert_close(got, _brute(x, bits, G, ratio), rtol=0, atol=1e-6)


def test_channel_axis_is_token_axis_transposed():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 16, 8)  # (B, H, T, D)
    got = fake_quant(x, QuantSpec(axis="channel", group_size=4))
    want = fake_quant(x.transpose(-1, -2).reshape(2, 3, 8, 4, 4).reshape(2, 3, 32, 4), QuantSpec(group_size=4))
    want = want.reshape(2, 3, 8, 16).transpose(-1, -2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_static_mode_symmetric_grid():
    x = torch.tensor([[-2.0, -0.4, 0.1, 5.0]])
    spec = QuantSpec(mode="static")
    s, z = choose_qparams(x, spec, clip=1.5)
    codes = quantize(x, s, z, spec)
    assert codes.tolist() == [[0, 1, 2, 3]]  # -2 clamps to 0, 5 clamps to 3
    torch.testing.assert_close(dequantize(codes, s, z, spec), torch.tensor([[-1.5, -0.5, 0.5, 1.5]]))
    assert spec.bits_per_element(64) == 2.0


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_roundtrip_bit_exact(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)


def test_pack_layout_little_endian_in_byte():
    codes = torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    assert pack(codes, 2).item() == 1 | (2 << 2) | (3 << 4)


def test_bits_per_element_counts_metadata():
    assert QuantSpec(bits=2).bits_per_element(64) == 2.5
    assert QuantSpec(bits=2).bits_per_element(128) == 2.25
    assert QuantSpec(bits=2, group_size=32).bits_per_element(128) == 3.0


def test_bad_specs_raise():
    with pytest.raises(ValueError, match="bits"):
        QuantSpec(bits=9)
    with pytest.raises(ValueError, match="whole in a byte"):  # 3-bit codes are fake-quantized, packed as planes
        pack(torch.zeros(2, 8, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="group_size"):
        QuantSpec(axis="channel")
    with pytest.raises(ValueError, match="divide"):
        fake_quant(torch.randn(2, 10), QuantSpec(group_size=4))


def test_row_quantile_clip_matches_hand_computation():
    # |x| = 0..7 -> the 0.75-quantile (linear interpolation) is 5.25
    x = torch.tensor([[0.0, -1.0, 2.0, -3.0, 4.0, -5.0, 6.0, -7.0]])
    spec = QuantSpec(bits=2, clip_rule="row-quantile", param_dtype=torch.float32)
    s, z = choose_qparams(x, spec, clip=0.75)
    assert z.item() == pytest.approx(-5.25) and s.item() == pytest.approx(10.5 / 3)
    got = fake_quant(x, spec, clip=0.75)
    assert got.min().item() == pytest.approx(-5.25) and got.max().item() == pytest.approx(5.25)
    assert spec.bits_per_element(8) == 2 + 64 / 8


# ------------------------------------------------------------------ 8-bit (e4m3) scale / zero
FP8 = torch.float8_e4m3fn
E4M3 = torch.arange(256, dtype=torch.uint8).view(FP8).float()
E4M3 = E4M3[E4M3 == E4M3].unique()  # the 253 distinct finite values, sorted (+-0 merged)


def _fp8_brute(x, bits, G, ratio=None):
    """Definition: zero = largest e4m3 <= lo, scale = smallest e4m3 >= max((hi - zero) / L, 1e-8), by table lookup."""
    out = torch.empty_like(x, dtype=torch.float32)
    T, D = x.shape
    L = 2**bits - 1
    for t, g0 in itertools.product(range(T), range(0, D, G)):
        vals = x[t, g0:g0 + G].float()
        lo, hi = vals.min(), vals.max()
        if ratio is not None:
            lo, hi = lo * ratio, hi * ratio
        z = E4M3[E4M3 <= lo].max()
        s = E4M3[E4M3 >= torch.clamp((hi - z) / L, min=1e-8)].min()
        c = torch.floor((vals - z) / s + 0.5).clamp(0, L)
        out[t, g0:g0 + G] = c * s + z
    return out


def test_fp8_round_is_directed_rounding_on_every_value():
    from oscar.quant import fp8_round

    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.exp(torch.randn(20000, generator=g) * 4)
    x = torch.cat([x.clamp(-448, 448), E4M3, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 448.0, -448.0])])
    up, down = fp8_round(x, up=True), fp8_round(x, up=False)
    assert up.dtype == FP8 and down.dtype == FP8
    assert torch.equal(up.float(), E4M3[torch.searchsorted(E4M3, x, right=False)])
    assert torch.equal(down.float(), E4M3[torch.searchsorted(E4M3, x, right=True) - 1])


@pytest.mark.parametrize("G,ratio,scale", [(8, None, 3.0), (16, 0.8, 1.0), (32, None, 1e-3), (64, None, 100.0)])
def test_fp8_params_match_brute_force(G, ratio, scale):
    torch.manual_seed(G)
    x = torch.randn(6, 64) * scale  # 1e-3: subnormal e4m3 scales; 100: zeros near the top of the range
    spec = QuantSpec(bits=2, group_size=G, param_dtype=FP8)
    s, z = choose_qparams(x, spec, clip=ratio)
    assert s.dtype == FP8 and z.dtype == FP8
    torch.testing.assert_close(fake_quant(x, spec, clip=ratio), _fp8_brute(x, 2, G, ratio), rtol=0, atol=0)
    assert spec.bits_per_element(64) == 2 + 16 / G
    assert QuantSpec(param_dtype=FP8).bits_per_element(64) == 2.25  # 1/7.11 of BF16 at head_dim 64


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_fp8_grid_covers_the_range_no_clipping(axis):
    """zero <= min, zero + L * scale >= max: every value within half a step of its grid point."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, 48, generator=g) * torch.exp(torch.randn(3, 64, 1, generator=g) * 2).clamp(max=60)  # (H, T, D)
    spec = QuantSpec(bits=2, axis=axis, group_size=16 if axis == "channel" else None, param_dtype=FP8)
    s, z = choose_qparams(x, spec)
    xg = x.reshape(3, 64, 1, 48) if axis == "token" else x.transpose(-1, -2).reshape(3, 48, 4, 16)
    lo, hi = xg.amin(-1), xg.amax(-1)
    assert bool((z.float() <= lo).all()) and bool((z.float() + 3 * s.float() >= hi * (1 - 1e-6)).all())
    err = (x - dequantize(quantize(x, s, z, spec), s, z, spec)).abs()
    step = (s.float().unsqueeze(-1).expand(*s.shape, 48).reshape(3, 64, 48) if axis == "token"
            else s.float().unsqueeze(-1).expand(3, 48, 4, 16).reshape(3, 48, 64).transpose(-1, -2))
    assert bool((err <= step / 2 * (1 + 1e-5)).all())


def test_fp8_params_out_of_range_raise_instead_of_saturating():
    spec = QuantSpec(bits=2, param_dtype=FP8)
    ok = torch.full((1, 8), -448.0)
    ok[0, 0] = 448.0
    s, z = choose_qparams(ok, spec)  # exactly the largest finite e4m3: accepted
    assert z.float().item() == -448.0 and s.float().item() == pytest.approx(320.0)  # 896/3 rounded up
    for bad in (449.0, -1e4, float("nan"), float("inf")):
        x = torch.randn(2, 8)
        x[1, 3] = bad
        with pytest.raises(ValueError, match=r"8-bit \(e4m3\).*param_dtype=torch.float16"):
            choose_qparams(x, spec)
    with pytest.raises(ValueError, match="param_dtype"):
        QuantSpec(param_dtype=torch.bfloat16)
    # static mode has no per-token params: its constants stay fp16 (as the paged cache stores them)
    st = QuantSpec(mode="static", param_dtype=FP8)
    s, z = choose_qparams(torch.zeros(1, 4), st, clip=1000.0)
    assert s.dtype == torch.float16 and z.item() == -1000.0 and st.bits_per_element(64) == 2.0


@pytest.mark.parametrize("axis,group", [("channel", 64), ("token", None)])
def test_constant_group_dequantizes_to_its_value(axis, group):
    """A group whose values are all equal (bf16 rounding of a channel dominated by a large key bias,
    as on Qwen2.5) has a scale that rounds to 0 in fp16: 0/0 must give code 0 -> exactly the constant,
    in fake_quant as in quantize/dequantize, never NaN (the kivi2 bfloat16 collapse)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 128, 64, generator=g).to(torch.bfloat16)
    if axis == "channel":
        x[0, 1, :64, 5] = 146.0  # one channel constant over a 64-token group
    else:
        x[0, 0, 7, :] = -3.25  # one token constant over its channels
    spec = QuantSpec(bits=2, axis=axis, group_size=group)
    s, z = choose_qparams(x, spec)
    assert (s == 0).any()  # the case: fp16 scale underflows to zero
    want = dequantize(quantize(x, s, z, spec), s, z, spec).to(x.dtype)
    got = fake_quant(x, spec)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    if axis == "channel":
        assert torch.equal(got[0, 1, :64, 5], x[0, 1, :64, 5])
    else:
        assert torch.equal(got[0, 0, 7], x[0, 0, 7])


def test_pack_planes_round_trip_is_bit_exact():
    """A split key row: 16 channels of 3-bit codes then 48 of 2-bit, packed as a 2-bit plane + a 1-bit plane."""
    from oscar.quant import pack_planes, unpack_planes

    g = torch.Generator().manual_seed(0)
    D, wide = 64, 16
    codes = torch.cat([torch.randint(0, 8, (5, 3, wide), generator=g), torch.randint(0, 4, (5, 3, D - wide), generator=g)], -1)
    packed = pack_planes(codes.to(torch.uint8), 2, wide)
    assert packed.shape == (5, 3, D // 4 + wide // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_planes(packed, 2, wide, D), codes.to(torch.uint8))
    # the layout by hand: byte c // 4 holds the low 2 bits of channel c at bits 2 (c % 4); the top bit of wide
    # channel c is bit c % 8 of byte D/4 + c // 8
    c = codes[0, 0].tolist()
    row = packed[0, 0].tolist()
    for ch in range(D):
        assert (row[ch // 4] >> (2 * (ch % 4))) & 3 == c[ch] & 3
    for ch in range(wide):
        assert (row[D // 4 + ch // 8] >> (ch % 8)) & 1 == c[ch] >> 2
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_planes(codes.to(torch.uint8), 2, 12)


def test_pack_planes_tiers_round_trip_is_bit_exact():
    """Tiers: 16 channels of 4-bit codes, 40 of 2-bit, the last 8 not stored: a 2-bit plane of 56 channels + two
    1-bit planes of the 16 wide ones (18 bytes); the not-stored channels come back as 0."""
    from oscar.quant import pack_planes, unpack_planes

    g = torch.Generator().manual_seed(1)
    D, wide, stored = 64, 16, 56
    codes = torch.cat([torch.randint(0, 16, (4, wide), generator=g), torch.randint(0, 4, (4, D - wide), generator=g)], -1)
    packed = pack_planes(codes.to(torch.uint8), 2, wide, top=2, stored=stored)
    assert packed.shape == (4, stored // 4 + 2 * wide // 8) == (4, 18)
    want = codes.clone()
    want[:, stored:] = 0
    assert torch.equal(unpack_planes(packed, 2, wide, D, top=2, stored=stored), want.to(torch.uint8))
    row, c = packed[0].tolist(), codes[0].tolist()
    for ch in range(wide):  # plane p (p = 0, 1) of wide channel c: bit c % 8 of byte stored/4 + p*wide/8 + c // 8
        for p in range(2):
            assert (row[stored // 4 + p * wide // 8 + ch // 8] >> (ch % 8)) & 1 == (c[ch] >> (2 + p)) & 1
    with pytest.raises(ValueError, match="whole bytes"):
        pack_planes(codes.to(torch.uint8), 2, wide, top=2, stored=54)


def test_fake_quant_parts_is_fake_quant_per_part():
    from oscar.quant import fake_quant_parts

    x = torch.randn(2, 3, 7, 64, generator=torch.Generator().manual_seed(1))
    parts = [(0, 16, QuantSpec(bits=3, param_dtype=FP8_PARAM)), (16, 64, QuantSpec(bits=2, param_dtype=FP8_PARAM))]
    clips = [torch.tensor([0.9, 1.0, 0.8]).view(-1, 1, 1), 0.7]
    got = fake_quant_parts(x, parts, clips)
    assert torch.equal(got[..., :16], fake_quant(x[..., :16].contiguous(), parts[0][2], clips[0]))
    assert torch.equal(got[..., 16:], fake_quant(x[..., 16:].contiguous(), parts[1][2], clips[1]))
    assert len(got[0, 0, 0, :16].unique()) <= 8 and len(got[0, 0, 0, 16:].unique()) <= 4



# ----------------------------------------------------------------------------- one quantizer family

def _ties_and_clipping(T=6, D=16, seed=3):
    """Rows with exact half-step ties (the grid 0..3 at scale 1: x = k + 0.5 rounds up), values outside a clipped
    range, a constant row, and random rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g) * 2
    x[0] = torch.tensor([0.0, 3.0] + [0.5, 1.5, 2.5] * 4 + [1.0, 2.0])  # lo 0, hi 3: scale 1, ties at k + 0.5
    x[1] = 1.25  # constant group
    x[2, :2] = torch.tensor([-40.0, 40.0])  # far outliers: a clip ratio < 1 clamps most of the row's neighbours
    return x


def test_ties_round_half_up_and_clipping_clamps():
    x = _ties_and_clipping()
    got = fake_quant(x, QuantSpec(bits=2, group_size=16))
    assert got[0, 2:14].tolist() == [1.0, 2.0, 3.0] * 4  # 0.5 -> 1, 1.5 -> 2, 2.5 -> 3: half up
    assert torch.equal(got[1], x[1])  # a constant group reads back exactly
    xv = x[[0, 2, 3, 4, 5]]  # the brute force divides by the scale: the constant row is checked above
    for ratio in (None, 0.5, 0.9):
        torch.testing.assert_close(fake_quant(xv, QuantSpec(bits=2, group_size=8), clip=ratio),
                                   _brute(xv, 2, 8, ratio), rtol=0, atol=1e-6)
    c = fake_quant(x, QuantSpec(bits=2, group_size=16), clip=0.5)
    assert c[0].max() <= 1.5 and c[0].min() >= 0.0  # clipped to [0, 1.5]


def test_every_uniform_grid_in_the_package_is_this_one():
    """The ablation's uniform codec, the paged cache's CPU quantizer and the published recipe's format all read
    x through choose_qparams / quantize / dequantize: bit-identical to fake_quant on ties and clipping. The
    other quantizers (Lloyd–Max codebooks: TurboQuant, SpectralQuant, oscar-lm) are different by design."""
    from oscar.stats import reference_recipe as rr
    from oscar.validate.ablation.schemes import Ctx, UniformCodec

    x = _ties_and_clipping(T=16, D=16)
    for clip, rule in ((None, "ratio"), (0.8, "ratio"), (0.96, "row-quantile")):
        codec = UniformCodec(2, clip=clip, clip_rule=rule).fit({"k": x}, "k", Ctx())
        y, _ = codec.roundtrip(x)
        assert torch.equal(y, fake_quant(x, codec.spec, clip)), (clip, rule)
    spec = rr.reference_spec(2)
    s, z = choose_qparams(x, spec, rr.CLIP_K)
    assert torch.equal(dequantize(quantize(x, s, z, spec), s, z, spec), fake_quant(x, spec, rr.CLIP_K))


def test_no_other_module_rounds_to_a_uniform_grid():
    """Source guard: round-half-up onto a uniform grid (floor(... + 0.5)) is written in oscar/quant.py and in its
    Triton mirror (kernels/triton_quant.py, tested against it) only."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = set()
    for d in ("oscar", "pipeline", "stats", "kernels", "validate", "cluster", "reports"):
        for f in (root / d).rglob("*.py"):
            if re.search(r"floor\([^\n]*\+ 0\.5\)|\.add_\(0\.5\)\.floor_\(\)", f.read_text()):
                found.add(str(f.relative_to(root)))
    assert found == {"oscar/quant.py", "kernels/triton_quant.py"}, found
