"""The quantization primitive family against an explicit per-element loop."""

import itertools

import pytest
import torch

from oscar.kernels.quant import QuantSpec, choose_qparams, dequantize, fake_quant, pack, quantize, unpack


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
        QuantSpec(bits=3)
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
