"""Split keys in the paged cache (QuantConfig.key_split): the stored format against brute force, the
Triton kernels against the reference (under TRITON_INTERPRET=1), and the memory accounting (the reference decode
on the codes against the oracle: tests/test_paged.py, split=8)."""

import os

import pytest
import torch

from oscar.kernels import reference as ref
from oscar.kernels.dispatch import quantize_pages
from oscar.kernels.paged import PagedConfig, PagedLayerCache
from oscar.kernels.rotation import LayerRotation
from oscar.quant import FP8_PARAM, pack_planes, unpack_planes
from oscar.stats.artifact import QuantConfig


def split_rotation(H, D, seed, W, drop=0):
    """Block rotations (a W-part, a D-W-drop part and the not-stored rest, each with its own scaled-orthogonal
    transform), a key mean, per-part clips: the shape `oscar fit --variant split` (tiers) produces."""
    g = torch.Generator().manual_seed(seed)
    qr = lambda n: torch.linalg.qr(torch.randn(H, n, n, generator=g))[0]  # noqa: E731
    U = qr(D)
    d = torch.rand(H, 1, D, generator=g) * 2 + 0.5
    M = torch.zeros(H, D, D)
    e = D - drop
    M[:, :W, :W] = qr(W)
    if e > W:
        M[:, W:e, W:e] = qr(e - W)
    if drop:
        M[:, e:, e:] = qr(drop)
    rk, rq = (U * d) @ M, (U / d) @ M
    clip = torch.stack([torch.rand(H, generator=g) * 0.3 + 0.7, torch.rand(H, generator=g) * 0.3 + 0.7], -1)  # (H, 2)
    clip = clip if e > W else clip[:, 0]  # W = every stored channel (per-layer widths): one part, a ratio per head
    return LayerRotation(rot_k=rk, rot_v=qr(D), clip_k=clip, clip_v=torch.full((H,), 0.9), k_mean=torch.randn(H, D, generator=g),
                         rot_q=rq)


def make(H=2, D=32, W=8, P=4, S=3, R=8, pages=48, seqs=4, seed=0, dtype=torch.bfloat16, param_dtype="float8_e4m3fn",
         device="cpu", top=1, drop=0, key_params=None):
    quant = QuantConfig(page_size=P, sink=S, recent=R, key_split=W, param_dtype=param_dtype, key_top=top, key_drop=drop,
                        key_param_dtype=key_params)
    cfg = PagedConfig(quant, H, D, num_pages=pages, max_seqs=seqs, dtype=dtype, device=device)
    rot = split_rotation(H, D, seed, W, drop)
    if device != "cpu":
        rot = LayerRotation(**{k: getattr(rot, k).to(device) for k in ("rot_k", "rot_v", "clip_k", "clip_v", "k_mean", "rot_q")})
    return PagedLayerCache(cfg, rot, quantizer=quantize_pages)


def tokens(H, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, T, D, generator=g) * 2, torch.randn(H, T, D, generator=g)


def test_split_page_rows_are_the_two_planes():
    """A stored key row is pack_planes' layout: the wide part's 3-bit codes (some >= 4: the top plane is used) and the
    rest's 2-bit, one (scale, zero) pair per part; values are the usual per-token INT2 rows (the page contents against
    fake_quant, and chunked appends: tests/test_paged.py, axis "split")."""
    H, D, W = 2, 32, 8
    c = make()
    assert c.cfg.k_packed_dim == D // 4 + W // 8 and c.cfg.packed_dim == D // 4
    assert tuple(c.k_scale.shape[-1:]) == (2,) and tuple(c.v_scale.shape[-1:]) == (1,)
    s = c.new_sequence()
    c.append(s, *tokens(H, 30, D, 1))
    ids = torch.tensor(c.pages[s])
    codes = unpack_planes(c.k_codes[ids], 2, W, D)
    assert int(codes[..., :W].max()) == 7 and int(codes[..., W:].max()) == 3
    assert torch.equal(pack_planes(codes, 2, W), c.k_codes[ids])
    assert [(a, b, sp.bits) for a, b, sp in c.cfg.key_parts] == [(0, W, 3), (W, D, 2)]


def test_tier_page_rows_are_the_planes():
    """Tiers (key_top 2, key_drop D/8): a key row is the low plane of the D - D/8 stored channels, then two top-bit
    planes of the wide part (its 4-bit codes reach 15); the not-stored channels hold nothing and read as 0."""
    H, D, W, drop = 2, 64, 16, 8
    c = make(D=D, W=W, top=2, drop=drop)
    assert c.cfg.k_packed_dim == (D - drop) // 4 + 2 * W // 8 == 18 and c.cfg.k_low_dim == 14
    s = c.new_sequence()
    c.append(s, *tokens(H, 30, D, 1))
    ids = torch.tensor(c.pages[s])
    codes = unpack_planes(c.k_codes[ids], 2, W, D, top=2, stored=D - drop)
    assert int(codes[..., :W].max()) == 15 and int(codes[..., W:].max()) == 3 and int(codes[..., D - drop:].max()) == 0
    assert torch.equal(pack_planes(codes, 2, W, top=2, stored=D - drop), c.k_codes[ids])
    assert [(a, b, sp.bits) for a, b, sp in c.cfg.key_parts] == [(0, W, 4), (W, D - drop, 2)]
    kr, _ = ref.dequantize_sequence(c, s, dtype=torch.float32, rotated=True)
    assert (kr[:, 3:3 + 4 * len(c.pages[s]), D - drop:] == 0).all()


# the reference decode on split-key codes against the oracle, the pages against fake_quant and chunked appends
# bit-identical to one shot: tests/test_paged.py (split=8, axis "split")


def test_split_cache_refuses_what_it_cannot_store():
    from oscar.common import OscarError

    with pytest.raises(OscarError, match="key_split"):
        PagedConfig(QuantConfig(key_split=12), 2, 32, num_pages=4)
    with pytest.raises(OscarError, match="key_top"):  # tiers' fields shape split keys only
        QuantConfig(key_top=2)
    with pytest.raises(OscarError, match="key_drop 2"):  # 30 stored channels at 2 bits: not whole bytes
        PagedConfig(QuantConfig(key_split=8, key_top=2, key_drop=2), 2, 32, num_pages=4)
    cfg = PagedConfig(QuantConfig(page_size=4, sink=3, recent=8, key_split=8), 2, 32, num_pages=4)
    rot = split_rotation(2, 32, 0, 8)
    bad = LayerRotation(rot_k=rot.rot_k, rot_v=rot.rot_v, clip_k=torch.full((2,), 0.9), clip_v=rot.clip_v,
                        k_mean=rot.k_mean, rot_q=rot.rot_q)
    with pytest.raises(OscarError, match="key part"):
        PagedLayerCache(cfg, bad, quantizer=quantize_pages)


@pytest.mark.parametrize("top,drop", [(1, 0), (2, 8)])
def test_split_memory_accounting_is_the_stored_bytes(top, drop):
    """Analytic bytes per history token = what the pool allocates per token (codes + both key parts' params),
    for split keys and their tiers (the not-stored channels cost nothing)."""
    from oscar.kernels import memory

    H, D, W, P = 2, 64, 16, 16
    f = memory.Format("int2-split-fp8", param_bytes=1, key_split=W, page_size=P, key_top=top, key_drop=drop)
    per = memory.per_history_token({"num_layers": 1, "num_kv_heads": H, "head_dim": D}, f)
    c = make(H=H, D=D, W=W, P=P, S=0, R=16, pages=8, top=top, drop=drop)
    pool = c.bytes_used()
    assert per["codes"] == pool["codes"] / (8 * P)  # K: D/4 + W/8 bytes, V: D/4 bytes per token and head
    assert per["scales"] == pool["scales"] / (8 * P)
    assert 8 * (per["codes"] + per["scales"]) / (2 * H * D) == 2.5  # bits per element, K and V averaged


# ----------------------------------------------------------------- Triton, against the reference


def _triton():
    from oscar.kernels.dispatch import triton_usable

    return triton_usable("cpu") or torch.cuda.is_available()


needs_triton = pytest.mark.skipif(not _triton(), reason="needs Triton (CUDA, or TRITON_INTERPRET=1)")


# W = D: the per-layer widths' wide layers (one part, 3 / 4 bits, fp16 key params beside e4m3 values: kp)
ONE_PART = [(32, 32, "float8_e4m3fn", 1, 0, "float16"), (48, 48, "float8_e4m3fn", 2, 0, "float16"),
            (64, 64, "float8_e4m3fn", 2, 0, None)]


@needs_triton
@pytest.mark.parametrize("D,W,pd,top,drop,kp", [(32, 8, "float8_e4m3fn", 1, 0, None), (64, 16, "float8_e4m3fn", 1, 0, None),
                                                (48, 8, "float16", 1, 0, None), (64, 16, "float8_e4m3fn", 2, 8, None),
                                                (32, 8, "float16", 2, 4, None), (48, 8, "float8_e4m3fn", 2, 8, None),
                                                *ONE_PART])
def test_triton_quantizer_writes_the_reference_bytes(D, W, pd, top, drop, kp):
    from oscar.kernels import triton_quant

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    c = make(D=D, W=W, param_dtype=pd, device=dev, top=top, drop=drop, key_params=kp)
    g = torch.Generator().manual_seed(7)
    ids = torch.tensor([4, 0, 7, 2, 9], device=dev)
    u8 = lambda t: t.view(torch.uint8) if t.dtype == FP8_PARAM else t  # noqa: E731
    for which in ("k", "v"):
        x = (torch.randn(5, 2, 4, D, generator=g) * 3).to(torch.bfloat16).to(dev)
        codes, s, z = ref.quantize_page_tensors(c, x, which)
        triton_quant.quantize_pages_into(c, ids, x, which)
        assert torch.equal(getattr(c, f"{which}_codes")[ids].cpu(), codes.cpu())
        assert torch.equal(u8(getattr(c, f"{which}_scale")[ids]).cpu(), u8(s).cpu())
        assert torch.equal(u8(getattr(c, f"{which}_zero")[ids]).cpu(), u8(z).cpu())


@needs_triton
@pytest.mark.parametrize("D,W,G,top,drop,kp", [(32, 8, 1, 1, 0, None), (80, 16, 3, 1, 0, None), (64, 16, 3, 2, 8, None),
                                               (48, 48, 3, 2, 0, "float16")] + [  # one of each kind in the CI tier
    pytest.param(*c, marks=pytest.mark.full) for c in [(64, 16, 3, 1, 0, None), (48, 8, 8, 1, 0, None), (48, 8, 8, 2, 4, None),
                                                       (32, 8, 1, 2, 4, None), (32, 32, 1, 1, 0, "float16"),
                                                       (64, 64, 8, 1, 0, None), (80, 80, 3, 2, 0, "float16")]])
def test_triton_decode_equals_the_reference(D, W, G, top, drop, kp):
    """The fused decode kernel on split keys (and their tiers: top 2, drop; and W = D, one part: the per-layer widths'
    3- / 4-bit layers, fp16 key params beside e4m3 value params) against the reference: head dims 32 / 64 and
    non-powers of two 48 / 80 (masked), GQA 1 / 3 / 8; lengths (S = 3, R = 8, P = 4) inside the sink, at its edge,
    the window not yet full, the last length before the first page, the first page, several pages; a shared prefix
    (fork) and its own tail."""
    from oscar.kernels.triton_decode import DecodeConfig, decode_attention

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    H = 2
    c = make(D=D, W=W, device=dev, pages=64, seqs=10, top=top, drop=drop, key_params=kp)
    seqs = []
    for i, n in enumerate([1, 3, 4, 3 + 8 + 3, 3 + 8 + 4, 37, 70]):
        s = c.new_sequence()
        k, v = tokens(H, n, D, 20 + i)
        c.append(s, k.to(dev), v.to(dev))
        seqs.append(s)
    seqs.append(c.fork(seqs[-1]))  # shares its pages
    k, v = tokens(H, 5, D, 40)
    c.append(seqs[-1], k.to(dev), v.to(dev))
    q = torch.randn(len(seqs), H * G, D, generator=torch.Generator().manual_seed(6)).to(dev)
    want_o, want_lse = ref.decode_attention(q, c, seqs, scale=0.25, return_lse=True)
    for cfg in (DecodeConfig(block_n=16, num_splits=3, min_pages_per_split=1, dot_fp16=False), DecodeConfig(block_n=32)):
        o, lse = decode_attention(q, c, seqs, scale=0.25, return_lse=True, config=cfg)
        tol = 2e-5 if not cfg.dot_fp16 else 2e-2
        torch.testing.assert_close(o.float().cpu(), want_o.float().cpu(), rtol=0, atol=tol)
        torch.testing.assert_close(lse.cpu(), want_lse.cpu(), rtol=0, atol=tol)
