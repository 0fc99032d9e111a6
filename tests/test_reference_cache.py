"""oscar-ref in the paged cache: row-quantile clips, float32 scale/zero, pages of 8.

The stored pages are checked against a from-scratch definition (sort-based quantile,
clamp, min/max, round half up) rather than against `oscar.quant`, and decode
attention against the dequantize-everything oracle. The Triton part (kernel decode
reading float32 params; the page quantizer refusing the format, the dispatcher falling
back to the reference) runs where Triton can (CUDA, or TRITON_INTERPRET=1 exported before
Python starts, as scripts/test.sh does).
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
from oscar.stats import reference_recipe as rr
from oscar.stats.artifact import QuantConfig

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, D = 2, 16


def _cache(pages=48, dtype=torch.bfloat16, mean=False):
    cfg = PagedConfig(rr.reference_quant_config(), H, D, num_pages=pages, max_seqs=4, dtype=dtype, device=DEV)
    g = torch.Generator().manual_seed(0)
    R = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0].float()
    R = R.expand(H, D, D).clone()  # one rotation per layer, as the reference recipe fits
    rot = LayerRotation(rot_k=R.to(DEV), rot_v=R.clone().to(DEV), clip_k=torch.full((H,), rr.CLIP_K, device=DEV),
                        clip_v=torch.full((H,), rr.CLIP_V, device=DEV),
                        k_mean=torch.randn(H, D, generator=g).to(DEV) if mean else None)
    return PagedLayerCache(cfg, rot, quantizer=quantize_pages)


def _kv(T, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H, T, D, generator=g) * 2).to(DEV), torch.randn(H, T, D, generator=g).to(DEV)


def _page_definition(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Reference-format fake quant of rows x (..., D), written out from the recipe's description."""
    x = x.double()
    a = x.abs().sort(-1).values
    pos = ratio * (D - 1)
    lo_i = int(pos)
    t = a[..., lo_i] + (pos - lo_i) * (a[..., lo_i + 1] - a[..., lo_i])  # linear-interpolated quantile
    xc = torch.maximum(torch.minimum(x, t[..., None]), -t[..., None])
    lo, hi = xc.amin(-1).float().double(), xc.amax(-1).float().double()  # float32 storage
    s = ((hi - lo) / 3).float().double().clamp_min(1e-8)
    code = torch.floor((x - lo[..., None]) / s[..., None] + 0.5).clamp(0, 3)
    return code * s[..., None] + lo[..., None]


def test_config_from_reference_quant():
    c = _cache()
    cfg = c.cfg
    q = cfg.quant
    assert (q.sink, q.recent, q.page_size, q.clip_rule, q.torch_param_dtype) == (64, 256, 8, "row-quantile", torch.float32)
    assert c.k_scale.dtype == torch.float32 and c.v_zero.dtype == torch.float32
    assert cfg.key_spec == rr.reference_spec() and cfg.value_spec == rr.reference_spec()
    # the cache takes its format from a QuantConfig, which refuses these (the one owner of the checks)
    with pytest.raises(OscarError, match="row-quantile"):
        PagedConfig(QuantConfig(key_axis="channel", clip_rule="row-quantile"), num_kv_heads=1, head_dim=16, num_pages=1)
    with pytest.raises(OscarError, match="param_dtype"):
        PagedConfig(QuantConfig(param_dtype="bfloat16"), num_kv_heads=1, head_dim=16, num_pages=1)


def test_pages_of_8_clip_and_float32_params():
    os.environ.pop("OSCAR_KERNELS", None)
    c = _cache()
    n = 64 + 256 + 8 * 3 + 5  # sink, window, three full pages past it, 5 more tokens in the ring
    k, v = _kv(n, 1)
    s = c.new_sequence()
    c.append(s, k[:, :100], v[:, :100])  # chunked appends: same pages as one shot
    c.append(s, k[:, 100:], v[:, 100:])
    lay = layout(n, c.cfg)
    # 285 tokens past the sink: 3 whole pages of 8 left the window, 261 (R + 5 < R + P) stay in BF16
    assert lay.num_pages == 3 and lay.ring_len == 256 + 5
    got_k, got_v = ref.dequantize_sequence(c, s, dtype=torch.float32, rotated=True)
    kr = c.rot.rotate_k(k).to(torch.bfloat16).float()
    vr = c.rot.rotate_v(v).to(torch.bfloat16).float()
    a, e = 64, 64 + 3 * 8
    torch.testing.assert_close(got_k[:, :a], kr[:, :a], rtol=0, atol=0)  # BF16 sink
    torch.testing.assert_close(got_k[:, e:], kr[:, e:], rtol=0, atol=0)  # BF16 recent window
    torch.testing.assert_close(got_k[:, a:e].double(), _page_definition(kr[:, a:e], 0.96), rtol=0, atol=2e-6)
    torch.testing.assert_close(got_v[:, a:e].double(), _page_definition(vr[:, a:e], 0.92), rtol=0, atol=2e-6)
    # the clip actually bites: some rows' extreme values are not representable
    assert (got_k[:, a:e].abs().amax(-1) < kr[:, a:e].abs().amax(-1) - 1e-3).any()


def test_reference_decode_matches_oracle():
    c = _cache()
    seqs = []
    for i, n in enumerate([10, 64 + 256 + 8, 64 + 256 + 8 * 5 + 3]):
        s = c.new_sequence()
        c.append(s, *_kv(n, 10 + i))
        seqs.append(s)
    q = torch.randn(3, H * 3, D, generator=torch.Generator().manual_seed(3)).to(DEV)
    o, lse = ref.decode_attention(q, c, seqs, scale=0.25, return_lse=True)
    ro, rlse = ref.decode_attention_oracle(q, c, seqs, scale=0.25, return_lse=True)
    torch.testing.assert_close(o, ro, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse, rlse, rtol=0, atol=2e-5)


_TRITON = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.slow
@pytest.mark.skipif(not _TRITON, reason="needs triton and CUDA, or TRITON_INTERPRET=1")
def test_triton_path_with_reference_format(monkeypatch):
    from oscar.kernels import triton_quant
    from oscar.kernels.triton_decode import DecodeConfig, decode_attention

    monkeypatch.setenv("OSCAR_KERNELS", "triton")
    c = _cache(mean=True)  # (a key mean too: this format with centering, as `oscar` artifacts may carry)
    k, v = _kv(64 + 256 + 8 * 2 + 1, 7)
    s = c.new_sequence()
    c.append(s, k, v)  # the dispatcher quantizes the pages with the reference (Triton cannot)
    want = _cache(mean=True)
    monkeypatch.setenv("OSCAR_KERNELS", "reference")
    s2 = want.new_sequence()
    want.append(s2, k, v)
    ids = torch.tensor(c.pages[s], device=DEV)
    for name in ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero"):
        assert torch.equal(getattr(c, name)[ids], getattr(want, name)[ids]), name
    with pytest.raises(OscarError, match="does not implement clip_rule='row-quantile'"):
        triton_quant.quantize_pages_into(c, ids, torch.zeros(len(ids), H, 8, D, device=DEV), "k")
    # the fused decode kernel reads float32 scale/zero
    q = torch.randn(1, H * 3, D, generator=torch.Generator().manual_seed(4)).to(DEV)
    o, lse = decode_attention(q, c, [s], scale=0.25, return_lse=True, config=DecodeConfig(block_n=16, dot_fp16=False))
    ro, rlse = ref.decode_attention_oracle(q, c, [s], scale=0.25, return_lse=True)
    torch.testing.assert_close(o, ro, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse, rlse, rtol=0, atol=2e-5)


def test_oscar_cache_from_reference_artifact():
    """OscarCache (transformers) built from an oscar-ref artifact stores the published format."""
    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

    from oscar.kernels.cache import OscarCache
    from oscar.kernels.generation import prefill
    from oscar.kernels.memory import Format, cache_bytes, total
    from oscar.common import attention_shapes
    from oscar.stats.artifact import identity_artifact

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(1, 96, (1, 45), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dyn = m(input_ids=ids, past_key_values=DynamicCache(config=cfg), use_cache=True).past_key_values
    k0 = dyn.layers[0].keys[0]  # (Hkv, T, D) post-RoPE keys of layer 0 (its input does not depend on the cache)
    art = identity_artifact(cfg, quant=rr.reference_quant_config(), variant="oscar-ref")
    art.clip_k = [torch.full((2,), rr.CLIP_K) for _ in range(2)]
    art.clip_v = [torch.full((2,), rr.CLIP_V) for _ in range(2)]
    cache = OscarCache.from_artifact(m, art, dtype=torch.float32, sink=4, recent=16, max_len=64)
    prefill(m, cache, ids)
    pc = cache.pool[0]
    assert (pc.cfg.quant.page_size, pc.cfg.quant.clip_rule, pc.k_scale.dtype) == (8, "row-quantile", torch.float32)
    s = cache.seqs[0]
    lay = layout(45, pc.cfg)
    assert lay.num_pages == 3  # 41 tokens past the sink: 3 pages of 8 flushed, 17 in the window
    got_k, _ = ref.dequantize_sequence(pc, s, dtype=torch.float32, rotated=True)
    a, e = 4, 4 + 3 * 8
    torch.testing.assert_close(got_k[:, a:e].double(), _page_definition(k0[:, a:e].float(), 0.96), rtol=0, atol=1e-5)
    f = Format("ref", sink=4, recent=16, page_size=8, param_bytes=4, dtype_bytes=4)  # fp32 storage here
    ana, live = total(attention_shapes(cfg), f, 45), cache_bytes(cache)
    for key in ("codes", "scales", "sinks", "recent", "page_table"):
        assert live[key] == pytest.approx(ana[key]), key
    m.set_attn_implementation("sdpa")
