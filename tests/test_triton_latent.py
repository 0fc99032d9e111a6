"""The Triton latent decode kernel against the torch reference: odd head counts, ragged lengths not multiples of
the tile, empty history or exact segments, several splits; and end to end against kernels/latent.py's absorbed form."""

from __future__ import annotations

import math

import pytest
import torch

from oscar.kernels.latent import absorbed_attention, pack_latents
from oscar.kernels.triton_latent import LatentDecodeInputs, latent_decode
from oscar.quant import QuantSpec, fake_quant

SPEC = QuantSpec(bits=2, axis="token", group_size=128, mode="minmax", param_dtype=torch.float32)


def _case(B, H, r, P, n_hist, n_exact, seed=0):
    g = torch.Generator().manual_seed(seed)
    N, M = max(n_hist), max(n_exact)
    hist = torch.randn(B, N, r, generator=g) * torch.linspace(0.3, 2.0, r)          # rotated, centred latents
    clip = torch.tensor([0.9, 0.8, 1.0, 0.7][: r // 128])
    codes, sc, zr = pack_latents(hist, SPEC, clip)                                  # (B, N, r/4), (B, N, G) x 2
    deq = fake_quant(hist, SPEC, clip)                                              # what the codes decode to
    inp = LatentDecodeInputs(codes=codes, scale=sc.float(), zero=zr.float(),
                             k_pe=torch.randn(B, N, P, generator=g).to(torch.bfloat16),
                             n_hist=torch.tensor(n_hist, dtype=torch.int32),
                             c_exact=torch.randn(B, M, r, generator=g),
                             k_pe_exact=torch.randn(B, M, P, generator=g).to(torch.bfloat16),
                             n_exact=torch.tensor(n_exact, dtype=torch.int32))
    q = dict(qa=torch.randn(B, H, r, generator=g) * 0.2, qpe=torch.randn(B, H, P, generator=g),
             qmu=torch.randn(B, H, generator=g))
    return inp, deq, q


def _reference(inp, deq, q, scale):
    """softmax over [exact segment, INT2 history] of ((q̃ R)·ĉ_rot + q̃·mean + q_pe·k_pe) x scale, times ĉ_rot."""
    outs = []
    for b in range(deq.shape[0]):
        m, n = int(inp.n_exact[b]), int(inp.n_hist[b])
        c = torch.cat([inp.c_exact[b, :m], deq[b, :n]]).double()                     # (T, r)
        kp = torch.cat([inp.k_pe_exact[b, :m], inp.k_pe[b, :n]]).double()
        s = (q["qa"][b].double() @ c.T + q["qpe"][b].double() @ kp.T + q["qmu"][b, :, None].double()) * scale
        outs.append(torch.softmax(s, -1) @ c)                                       # (H, r)
    return torch.stack(outs)


@pytest.mark.parametrize("B,H,r,P,n_hist,n_exact,splits", [
    (2, 3, 256, 32, [45, 70], [20, 9], 3),      # odd heads, ragged lengths off the tile
    (1, 17, 128, 64, [33], [1], 1),             # heads past one block of 16, one split
    (2, 5, 256, 24, [0, 130], [40, 5], 4),      # an empty history; a RoPE key narrower than 32
])
def test_kernel_matches_the_reference(B, H, r, P, n_hist, n_exact, splits):
    inp, deq, q = _case(B, H, r, P, n_hist, n_exact)
    scale = 1 / math.sqrt(96)
    got = latent_decode(q["qa"], q["qpe"], q["qmu"], inp, scale, num_splits=splits)
    want = _reference(inp, deq, q, scale)
    # float32 IEEE dots over r <= 256 terms against float64: |error| <= ~r x 2^-24 x |terms|
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_end_to_end_equals_the_absorbed_form():
    """The kernel's rotated output, un-rotated and projected through W_UV, equals kernels/latent.py's absorbed
    attention over the same cache (the oracle of the layer's o_proj input)."""
    B, H, r, P, dn, dv = 1, 4, 256, 32, 32, 32
    g = torch.Generator().manual_seed(3)
    inp, deq, _ = _case(B, H, r, P, [50], [12], seed=3)
    rot, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=torch.float64))
    rot, mean = rot.float(), torch.randn(r, generator=g) * 0.1
    w_uk, w_uv = torch.randn(H, dn, r, generator=g) * 0.1, torch.randn(H, dv, r, generator=g) * 0.1
    q = torch.randn(B, H, 1, dn + P, generator=g)                                    # one decode query
    c_rot = torch.cat([inp.c_exact[:, :12], deq[:, :50]], 1)                       # (1, 62, r)
    k_pe = torch.cat([inp.k_pe_exact[:, :12], inp.k_pe[:, :50]], 1).float()
    scale = 1 / math.sqrt(dn + P)
    want = absorbed_attention(q, c_rot, k_pe, w_uk, w_uv, rot, mean, scale, torch.ones(1, 62, dtype=torch.bool))
    qa = torch.einsum("bhd,hdr->bhr", q[:, :, 0, :dn], w_uk)                        # (B, H, r) absorbed
    o = latent_decode(qa @ rot, q[:, :, 0, dn:], qa @ mean, inp, scale, num_splits=2)  # (B, H, r) rotated
    got = torch.einsum("bhr,hvr->bhv", o @ rot.T + mean, w_uv)                      # (B, H, v)
    torch.testing.assert_close(got, want[:, 0], rtol=1e-4, atol=1e-4 * want.abs().max().item())
