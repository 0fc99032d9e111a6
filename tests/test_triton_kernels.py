"""Triton kernels against the torch reference (CPU via TRITON_INTERPRET=1, or CUDA).

Tolerances: kernel (a) codes and fp16 / 8-bit (e4m3) params are bit-identical to the
reference (same rounding rule, IEEE division, directed e4m3 rounding). Kernel (b) with fp32 IEEE dots: |o - o_ref| <=
2e-5 (summation order only); with fp16 dots (the CUDA default): <= 6e-3 for
|q|, |k|, |v| ~ 1 (fp16 rounding of q, k, p, v: ~2^-11 relative each).
"""

import importlib.util
import os

import pytest
import torch

from oscar.common import OscarError
from oscar.kernels import reference as ref
from oscar.kernels.dispatch import quantize_pages
from oscar.kernels.paged import PagedConfig, PagedLayerCache, layout
from oscar.kernels.rotation import LayerRotation
from oscar.stats.artifact import QuantConfig

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None
        or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
        reason="needs triton and CUDA, or TRITON_INTERPRET=1",
    ),
]

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MODES = [("minmax", "token"), ("minmax", "channel"), ("static", "token")]


def rotation(H, D, seed, mode, center=True, scaled=False):
    g = torch.Generator().manual_seed(seed)
    qr = lambda: torch.linalg.qr(torch.randn(H, D, D, generator=g))[0]  # noqa: E731
    if mode == "static":
        ck, cv = torch.rand(H, D, generator=g) + 1.0, torch.rand(H, generator=g) + 1.0
    else:
        ck = cv = torch.full((H,), 0.9)
    mu = torch.randn(H, D, generator=g) if center else None
    rq = None
    if scaled:  # non-orthogonal keys U diag(d) M, queries read with the dual U diag(1/d) M
        U, M, d = qr(), qr(), torch.rand(H, 1, D, generator=g) * 3 + 0.25
        rk, rq = (U * d) @ M, (U / d) @ M
    else:
        rk = qr()
    f = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return LayerRotation(rot_k=f(rk), rot_v=f(qr()), clip_k=f(ck), clip_v=f(cv), k_mean=f(mu), rot_q=f(rq))


def cache(mode="minmax", axis="token", H=2, D=64, P=8, S=5, R=16, pages=64, seqs=8, seed=0, scaled=False,
          group_size=None, param_dtype=torch.float16):
    quant = QuantConfig(page_size=P, sink=S, recent=R, mode=mode, key_axis=axis, group_size=group_size,
                        param_dtype=str(param_dtype).removeprefix("torch."))
    cfg = PagedConfig(quant, H, D, num_pages=pages, max_seqs=seqs, device=DEV)
    return PagedLayerCache(cfg, rotation(H, D, seed, mode, scaled=scaled), quantizer=quantize_pages)


def kv(H, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H, T, D, generator=g) * 2).to(DEV), torch.randn(H, T, D, generator=g).to(DEV)


# ------------------------------------------------------------------ kernel (a)
@pytest.mark.parametrize("mode,axis", MODES)
@pytest.mark.parametrize("D,group", [(64, None), (48, None), (128, 32)])
def test_quantize_kernel_bit_identical_to_reference(mode, axis, D, group):
    from oscar.kernels.triton_quant import quantize_pages_into

    if mode == "static" and group:
        pytest.skip("static mode has no groups")
    # a QuantConfig's group_size is also the channel keys' token group, which the cache holds to the page
    P = group if axis == "channel" and group else 8
    c = cache(mode, axis, D=D, P=P, R=2 * P, group_size=group)
    k, v = kv(2, 3 * P, D, 1)
    ids = torch.tensor([7, 0, 3], device=DEV)
    for which, x in (("k", k), ("v", v)):
        rot = c.rot.rotate_k(x) if which == "k" else c.rot.rotate_v(x)
        pages = rot.to(c.cfg.dtype).reshape(2, 3, P, D).transpose(0, 1).contiguous()  # (N, Hkv, P, D)
        codes, s, z = ref.quantize_page_tensors(c, pages, which)
        quantize_pages_into(c, ids, pages, which)
        assert torch.equal(getattr(c, f"{which}_codes")[ids], codes)
        if s is not None:
            assert torch.equal(getattr(c, f"{which}_scale")[ids], s)
            assert torch.equal(getattr(c, f"{which}_zero")[ids], z)


def test_quantize_kernel_constant_group_matches_reference():
    from oscar.kernels.triton_quant import quantize_pages_into

    c = cache(D=64)
    pages = torch.zeros(1, 2, 8, 64, dtype=c.cfg.dtype, device=DEV)
    pages[0, 1] = 0.5  # zero range: fp16 scale underflows to 0, codes must be 0 as in torch
    ids = torch.tensor([2], device=DEV)
    codes, s, z = ref.quantize_page_tensors(c, pages, "k")
    quantize_pages_into(c, ids, pages, "k")
    assert torch.equal(c.k_codes[ids], codes) and torch.equal(c.k_scale[ids], s) and torch.equal(c.k_zero[ids], z)


@pytest.mark.parametrize("mode,axis", [("minmax", "token"), ("minmax", "channel")])
def test_quantize_kernel_rotating_in_kernel_is_within_one_step(mode, axis):
    """rotate=True does (x - mu) @ R in the kernel: equal to torch up to summation order,
    so after rounding to bf16 a few codes may move by one step, never more."""
    from oscar.kernels.triton_quant import quantize_pages_into

    c = cache(mode, axis, D=64)
    k, _ = kv(2, 32, 64, 2)
    raw = k.reshape(2, 4, 8, 64).transpose(0, 1).contiguous()
    ids = torch.arange(4, device=DEV)
    quantize_pages_into(c, ids, raw, "k", rotate=True)
    got = ref.dequantize_pages(c, ids, "k")
    want_pages = c.rot.rotate_k(k).to(c.cfg.dtype).reshape(2, 4, 8, 64).transpose(0, 1).contiguous()
    ref.quantize_pages(c, ids, want_pages, want_pages.clone())
    want = ref.dequantize_pages(c, ids, "k")
    step = (c.k_scale[ids].float().amax() if axis == "token" else c.k_scale[ids].float().amax()) * 1.01
    assert (got - want).abs().max() <= step
    assert (got == want).float().mean() > 0.97


# ------------------------------------------------------------------ kernel (b)
def run_both(c, seqs, G, seed=0, fp16=False, splits=None, block_n=16, min_pages=1):
    from oscar.kernels.triton_decode import DecodeConfig, decode_attention

    q = torch.randn(len(seqs), c.cfg.num_kv_heads * G, c.cfg.head_dim, generator=torch.Generator().manual_seed(seed)).to(DEV)
    # min_pages=1: every split gets work even on these short contexts, so the merge is exercised
    cfg = DecodeConfig(block_n=block_n, num_splits=splits, dot_fp16=fp16, min_pages_per_split=min_pages)
    o, lse = decode_attention(q, c, seqs, scale=0.125, return_lse=True, config=cfg)
    ro, rlse = ref.decode_attention_oracle(q, c, seqs, scale=0.125, return_lse=True)
    return o, lse, ro, rlse


def fill(c, lengths, seed=0):
    seqs = []
    for i, n in enumerate(lengths):
        s = c.new_sequence()
        c.append(s, *kv(c.cfg.num_kv_heads, n, c.cfg.head_dim, seed + i))
        seqs.append(s)
    return seqs


@pytest.mark.parametrize(
    "mode,axis,H,D,G,group,scaled",
    [
        ("minmax", "token", 2, 64, 1, None, False),  # MHA
        ("minmax", "channel", 1, 128, 8, None, False),  # GLM-like GQA 8, KIVI keys
        ("static", "token", 2, 48, 3, None, False),  # non-power-of-two head dim (masked to 64)
        ("minmax", "token", 1, 64, 3, 16, False),  # 4 channel groups per token
        ("minmax", "token", 2, 64, 3, None, True),  # `scaled` variant: non-orthogonal rot_k, dual rot_q
    ],
)
def test_decode_kernel_matches_reference(monkeypatch, mode, axis, H, D, G, group, scaled):
    # lengths around S=5, R=16, P=8: inside the sink, at the sink edge, window not yet full,
    # the last length before the first page, the first page, wrapped ring, several pages
    monkeypatch.setenv("OSCAR_KERNELS", "triton")  # pages quantized by kernel (a)
    c = cache(mode, axis, H=H, D=D, group_size=group, scaled=scaled)
    lengths = [3, 5, 6, 5 + 16 + 7, 5 + 16 + 8, 61, 77]
    seqs = fill(c, lengths)[::-1]  # slot order != batch order
    o, lse, ro, rlse = run_both(c, seqs, G, splits=3)
    torch.testing.assert_close(o, ro, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse, rlse, rtol=0, atol=2e-5)


def test_decode_kernel_fp16_dots_and_auto_splits():
    c = cache("minmax", "token", H=2, D=64)
    seqs = fill(c, [9, 150])  # 150: 16 pages
    o, lse, ro, rlse = run_both(c, seqs, 3, fp16=True, splits=None, block_n=32)
    torch.testing.assert_close(o, ro, rtol=0, atol=6e-3)
    torch.testing.assert_close(lse, rlse, rtol=0, atol=6e-3)


@pytest.mark.full  # the small-shape sweeps above run the same kernels in the CI tier
@pytest.mark.parametrize("axis,G", [("token", 3), ("channel", 8)])
def test_decode_kernel_at_production_shapes(monkeypatch, axis, G):
    """The defaults the product ships (pages of 16, block_n 64, sink 64, recent 256, at least
    64 pages per split) on contexts long enough to use several splits, one short enough to
    leave most splits empty, and lengths that are not multiples of the page or the block."""
    from oscar.kernels.triton_decode import DecodeConfig

    monkeypatch.setenv("OSCAR_KERNELS", "triton")
    c = cache("minmax", axis, H=2, D=64, P=16, S=64, R=256, pages=360, seqs=4)
    lengths = [64 + 256 + 2 * 1024 + 16 * 70 + 5, 64 + 256 + 16 * 3 + 11, 64 + 256 + 1024 + 7]
    seqs = fill(c, lengths)
    pages = [layout(n, c.cfg).num_pages for n in lengths]
    assert max(pages) > 3 * DecodeConfig().min_pages_per_split  # four splits hold work, the rest none
    o, lse, ro, rlse = run_both(c, seqs, G, splits=6, block_n=64, min_pages=DecodeConfig().min_pages_per_split)
    torch.testing.assert_close(o, ro, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse, rlse, rtol=0, atol=2e-5)


def test_split_count_does_not_depend_on_the_context():
    """The split count reaches the kernel as a runtime argument and is chosen from the device,
    batch and KV heads alone, so decoding a growing context never recompiles."""
    import inspect

    from oscar.kernels.triton_decode import DecodeConfig, _decode_split_kernel, _merge_kernel

    assert list(inspect.signature(DecodeConfig.splits_for).parameters) == ["self", "batch", "kv_heads", "device"]
    for fn, arg in ((_decode_split_kernel, "num_splits"), (_merge_kernel, "num_parts")):
        params = inspect.signature(fn.fn).parameters  # the Python function under the jit wrapper
        assert arg in params and "constexpr" not in str(params[arg].annotation)
        if hasattr(fn, "do_not_specialize"):  # compiled (CUDA) mode: no value specialisation either
            assert arg in fn.do_not_specialize or fn.arg_names.index(arg) in fn.do_not_specialize


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compilation caches exist on CUDA only")
def test_growing_context_reuses_the_compiled_decode_kernel():
    from oscar.kernels.triton_decode import _decode_split_kernel, decode_attention

    c = cache("minmax", "token", H=2, D=64, P=16, S=64, R=256, pages=600, seqs=1)
    (s,) = fill(c, [400])
    q = torch.randn(1, 6, 64, device=DEV)
    decode_attention(q, c, [s])
    compiled = lambda: len(_decode_split_kernel.device_caches[torch.cuda.current_device()][0])  # noqa: E731
    before = compiled()
    for _ in range(4):
        c.append(s, *kv(2, 2000, 64, 7))
        decode_attention(q, c, [s])
    assert compiled() == before


def test_decode_kernel_with_shared_prefix_pages(monkeypatch):
    monkeypatch.setenv("OSCAR_KERNELS", "triton")
    c = cache("minmax", "channel", H=2, D=64, pages=24)
    (root,) = fill(c, [45])  # 5 sink + 3 pages + 16 ring
    forks = [c.fork(root) for _ in range(3)]
    for i, f in enumerate(forks):
        c.append(f, *kv(2, 4 + 9 * i, 64, 100 + i))
    shared = set(c.pages[root])
    assert all(shared <= set(c.pages[f]) for f in forks) and all(c.refcount[p] == 4 for p in shared)
    o, lse, ro, rlse = run_both(c, [forks[2], root, forks[0], forks[1]], 3, splits=2)
    torch.testing.assert_close(o, ro, rtol=0, atol=2e-5)
    # and the forks equal sequences built from scratch with the same tokens
    fresh = cache("minmax", "channel", H=2, D=64, pages=24)
    (s,) = fill(fresh, [45])
    fresh.append(s, *kv(2, 4 + 9 * 2, 64, 102))
    o2, _, _, _ = run_both(fresh, [s], 3)
    torch.testing.assert_close(o2[0], o[0], rtol=0, atol=2e-5)


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.float8_e4m3fn])
def test_triton_cache_equals_reference_cache(monkeypatch, param_dtype):
    """Appends through kernel (a) give the same pool bytes as appends through the reference."""
    k, v = kv(2, 70, 64, 9)
    caches = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("OSCAR_KERNELS", backend)
        c = cache("minmax", "token", D=64, param_dtype=param_dtype)
        s = c.new_sequence()
        c.append(s, k[:, :33], v[:, :33])
        c.append(s, k[:, 33:], v[:, 33:])
        caches[backend] = (c, s)
    (a, sa), (b, sb) = caches["reference"], caches["triton"]
    ids = torch.tensor(a.pages[sa], device=DEV)
    assert a.pages[sa] == b.pages[sb] and len(ids) == layout(70, a.cfg).num_pages
    for name in ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero"):
        assert torch.equal(_bytes(getattr(a, name)[ids]), _bytes(getattr(b, name)[ids])), name


# ------------------------------------------------------------------ 8-bit (e4m3) scale/zero
FP8 = torch.float8_e4m3fn


def _bytes(t):
    """Bit patterns (fp8 params compare by bytes: no float equality on e4m3 needed)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("axis,D,group", [("token", 64, None), ("token", 44, None), ("token", 64, 16),
                                          ("channel", 64, None), ("channel", 44, None)])
def test_quantize_kernel_fp8_params_bit_identical_to_reference(axis, D, group):
    from oscar.kernels.triton_quant import quantize_pages_into

    c = cache("minmax", axis, D=D, group_size=group, param_dtype=FP8)
    k, v = kv(2, 32, D, 3)
    ids = torch.tensor([9, 2, 5, 0], device=DEV)
    for which, x in (("k", k), ("v", v)):
        rot = c.rot.rotate_k(x) if which == "k" else c.rot.rotate_v(x)
        pages = rot.to(c.cfg.dtype).reshape(2, 4, 8, D).transpose(0, 1).contiguous()  # (N, Hkv, P, D)
        pages[1] *= 1e-3  # subnormal e4m3 scales (< 2^-6)
        pages[2, 0] = 0.25  # constant rows: zero exact, smallest scale 2^-9
        pages[3] = pages[3] / pages[3].abs().amax() * 440  # near the top of e4m3's range
        codes, s, z = ref.quantize_page_tensors(c, pages, which)
        assert s.dtype == FP8 and z.dtype == FP8
        quantize_pages_into(c, ids, pages, which)
        assert torch.equal(getattr(c, f"{which}_codes")[ids], codes)
        assert torch.equal(_bytes(getattr(c, f"{which}_scale")[ids]), _bytes(s))
        assert torch.equal(_bytes(getattr(c, f"{which}_zero")[ids]), _bytes(z))


@pytest.mark.parametrize(
    "axis,H,D,G,group",
    [
        ("token", 2, 64, 1, None),  # per-token 8-bit params, factored path
        ("token", 1, 44, 3, None),  # non-power-of-two head dim, GQA 3
        ("token", 1, 64, 3, 16),  # 4 channel groups per token: dequantized in registers
        ("channel", 1, 64, 3, None),  # KIVI keys with 8-bit per-channel params
    ],
)
def test_decode_kernel_fp8_params_matches_reference(monkeypatch, axis, H, D, G, group):
    monkeypatch.setenv("OSCAR_KERNELS", "triton")  # pages quantized by kernel (a)
    c = cache("minmax", axis, H=H, D=D, group_size=group, param_dtype=FP8)
    assert c.k_scale.dtype == FP8 and c.v_zero.dtype == FP8
    lengths = [4, 5 + 16 + 7, 5 + 16 + 8, 61, 77]  # sink only, before / at the first page, several pages
    seqs = fill(c, lengths)[::-1]
    o, lse, ro, rlse = run_both(c, seqs, G, splits=2)
    torch.testing.assert_close(o, ro, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse, rlse, rtol=0, atol=2e-5)


def test_dispatch_rejects_mismatches(monkeypatch):
    from oscar.kernels.dispatch import backend, decode_attention

    monkeypatch.setenv("OSCAR_KERNELS", "cuda-please")
    with pytest.raises(OscarError, match="OSCAR_KERNELS"):
        backend("cpu")
    monkeypatch.setenv("OSCAR_KERNELS", "triton")
    c = cache(D=64)
    seqs = fill(c, [12])
    with pytest.raises(OscarError, match="D=32"):
        decode_attention(torch.randn(1, 2, 32, device=DEV), c, seqs)
    with pytest.raises(OscarError, match="dtype"):
        decode_attention(torch.randn(1, 2, 64, device=DEV).to(torch.float64), c, seqs)
    o = decode_attention(torch.randn(1, 4, 64, device=DEV).to(torch.bfloat16), c, seqs)
    assert o.dtype == torch.bfloat16 and o.shape == (1, 4, 64)
