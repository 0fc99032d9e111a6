"""The fake-quant cache and the masked-attention perplexity path agree with token-by-token decoding.

A tiny random-init Llama (GQA 2:1, head_dim 16) keeps these exact checks fast.
"""

import math

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from helpers.artifacts import rotated_artifact
from oscar.quant import fake_quant
from oscar.stats.artifact import QuantConfig, identity_artifact
from oscar.kernels.backends import CacheSpec, make_cache
from oscar.kernels.simulate import LayerQuant, MethodBatchCache, SimQuantCache
from oscar.validate.methods import bits_per_element, hadamard, method_artifact, parse_methods, uncalibrated_warning
from oscar.kernels.protocol import Protocol
from oscar.scoring.protocols import PROTOCOLS
from oscar.scoring.nll import window_nll
from oscar.kernels import window_attention
from oscar.kernels.window_attention import fresh_mask, simulated
from oscar.common import OscarError


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def test_hadamard_orthogonal():
    for n in (1, 2, 16, 64):
        h = hadamard(n)
        assert torch.allclose(h @ h.T, torch.eye(n), atol=1e-6)
    with pytest.raises(OscarError, match="power-of-two"):
        hadamard(48)


@pytest.mark.parametrize("scaled", [False, True])
def test_layerquant_matches_rotated_reference(tiny, scaled):
    art = rotated_artifact(tiny.config, QuantConfig(bits=2), scaled=scaled)
    lq = LayerQuant(art, 0)
    k = torch.randn(1, 2, 10, 16, dtype=torch.float64).float()
    Rq = art.rot_q[0] if scaled else art.rot_k[0]
    # reference: in the rotated space, per head; back to model space with R_K^{-1} (brute-force inverse)
    for h in range(2):
        R, mu = art.rot_k[0][h], art.k_mean[0][h]
        kr = (k[0, h] - mu) @ R
        ref = fake_quant(kr, art.quant.key_spec(16), 0.9) @ torch.linalg.inv(R.double()).float() + mu
        assert torch.allclose(lq.keys(k)[0, h], ref, atol=1e-4)
    # q·k̂ equals the kernel's rotated-space logit (q R_Q)·(k̂_rot) + q·mu
    q = torch.randn(16)
    khat = lq.keys(k)[0, 0]
    kr_hat = fake_quant((k[0, 0] - art.k_mean[0][0]) @ art.rot_k[0][0], art.quant.key_spec(16), 0.9)
    assert torch.allclose(khat @ q, kr_hat @ (q @ Rq[0]) + q @ art.k_mean[0][0], atol=1e-4)


def test_bits_per_element(tiny):
    assert bits_per_element(None, 64) == 16
    assert bits_per_element(method_artifact("naive-int2", tiny.config, None), 16) == 2 + 32 / 16
    with pytest.raises(OscarError, match="unknown method"):
        parse_methods("bf16,int3")
    with pytest.raises(OscarError, match="needs --artifact"):
        method_artifact("oscar-int2", tiny.config, None)


@pytest.mark.parametrize("quant,recent,qchunk", [
    (QuantConfig(bits=2), 0, 256), (QuantConfig(bits=2), 3, 256), (QuantConfig(bits=2), 3, 5),
    (QuantConfig(bits=2, key_axis="channel", group_size=4), 0, 256), (QuantConfig(bits=2, key_axis="channel", group_size=4), 5, 256),
    (QuantConfig(bits=2, key_axis="channel", group_size=4), 5, 7), (QuantConfig(bits=2, key_axis="channel", group_size=4), 20, 256),
])
def test_masked_ppl_equals_token_by_token_decode(tiny, quant, recent, qchunk, monkeypatch):
    """The perplexity mask reproduces decoding one token at a time through SimQuantCache.

    qchunk < T exercises several query blocks of the band; recent 20 leaves the far part only 5 queries."""

    monkeypatch.setitem(window_attention._SIM, "qchunk", qchunk)
    art = rotated_artifact(tiny.config, quant)
    proto = Protocol("t", sink=3, recent=recent)
    ids = torch.randint(0, 97, (1, 29), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = SimQuantCache(art, proto)
        step = torch.cat([tiny(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits
                          for t in range(ids.shape[1])], dim=1)
        with simulated(tiny, art, proto):
            masked = tiny(input_ids=ids, use_cache=False).logits
        with simulated(tiny, art, proto, dense=True):
            dense = tiny(input_ids=ids, use_cache=False).logits
        exact = tiny(input_ids=ids, use_cache=False).logits
    assert torch.allclose(step, masked, atol=2e-4), (step - masked).abs().max()
    assert torch.allclose(dense, masked, atol=2e-5), (dense - masked).abs().max()
    assert (step - exact).abs().max() > 1e-3  # quantization really happened
    assert tiny.config._attn_implementation == "sdpa"  # restored


def test_prefill_takeover_equals_prefill_through_cache(tiny):
    """Strict NIAH: handing an exact prefill to the method's cache == prefilling through that cache."""
    art = rotated_artifact(tiny.config, QuantConfig(bits=2))
    proto = Protocol("strict", sink=4, recent=0)
    ctx = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(5))
    q = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        direct = SimQuantCache(art, proto)
        tiny(input_ids=ctx, cache=direct, use_cache=True)
        a = tiny(input_ids=q, cache=direct, use_cache=True).logits
        exact = DynamicCache()
        tiny(input_ids=ctx, cache=exact, use_cache=True)
        taken = make_cache(CacheSpec.one(art, proto, prefill=exact))
        b = tiny(input_ids=q, cache=taken, use_cache=True).logits
        # the exact prefill is untouched, so a bf16 cache built from it is the plain continuation
        c = tiny(input_ids=q, cache=make_cache(CacheSpec.one(None, proto, prefill=exact)), use_cache=True).logits
        ref = tiny(input_ids=torch.cat([ctx, q], 1), use_cache=False).logits[:, -7:]
    assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(c, ref, atol=1e-4)
    assert (a - ref).abs().max() > 1e-3


@pytest.mark.parametrize("recent", [0, 6, 30])
def test_method_batch_equals_each_method_cache(tiny, recent):
    """One batch row per method (exact, per-token INT2, KIVI-style channel keys, whole pages) decodes
    exactly what each method's own cache decodes: question chunk, then steps that flush tokens."""
    from oscar.stats import reference_recipe as rr

    arts = [None, rotated_artifact(tiny.config, QuantConfig(bits=2)),
            rotated_artifact(tiny.config, QuantConfig(bits=2, key_axis="channel", group_size=4), seed=2),
            rotated_artifact(tiny.config, rr.reference_quant_config(), seed=3)]
    proto = Protocol("t", sink=4, recent=recent)
    g = torch.Generator().manual_seed(9)
    ctx, q = torch.randint(0, 97, (1, 45), generator=g), torch.randint(0, 97, (1, 6), generator=g)
    steps = torch.randint(0, 97, (len(arts), 12), generator=g)  # a different continuation per row
    with torch.no_grad():
        exact = DynamicCache()
        tiny(input_ids=ctx, cache=exact, use_cache=True)
        batch = MethodBatchCache.from_prefill(arts, proto, exact, capacity=50)  # grows past 50
        got = [tiny(input_ids=q.expand(len(arts), -1), cache=batch, use_cache=True).logits[:, -1]]
        got += [tiny(input_ids=steps[:, t:t + 1], cache=batch, use_cache=True).logits[:, -1] for t in range(12)]
        got = torch.stack(got, 1)  # (R, 13, V)
        for r, art in enumerate(arts):
            one = make_cache(CacheSpec.one(art, proto, prefill=exact))
            want = [tiny(input_ids=q, cache=one, use_cache=True).logits[:, -1]]
            want += [tiny(input_ids=steps[r:r + 1, t:t + 1], cache=one, use_cache=True).logits[:, -1] for t in range(12)]
            want = torch.stack(want, 1)[0]
            assert torch.allclose(got[r], want, atol=1e-5), (r, (got[r] - want).abs().max())
    assert (got[1] - got[0]).abs().max() > 1e-3  # the rows really differ


def test_prefill_pool_equals_one_shot_prefill(tiny):
    from oscar.scoring.prefill import PrefillPool

    g = torch.Generator().manual_seed(10)
    base = torch.randint(0, 97, (60,), generator=g).tolist()
    b = base[:25] + torch.randint(0, 97, (20,), generator=g).tolist()
    pool = PrefillPool(tiny, keep=2)
    with torch.no_grad():
        pool.prefill(base)
        got = pool.prefill(b)
        ref = DynamicCache()
        tiny(input_ids=torch.tensor([b]), cache=ref, use_cache=True)
    assert pool.reused == 25 and pool.computed == 60 + 20
    for x, y in zip(got.layers, ref.layers):
        assert x.keys.shape == y.keys.shape and torch.allclose(x.keys, y.keys, atol=1e-5)
        assert torch.allclose(x.values, y.values, atol=1e-5)


def test_fresh_mask_small():
    m = fresh_mask(6, sink=1, recent=0, key_group=1)
    assert m[:, 0].all() and m.diagonal().all()
    assert not m[3, 2] and not m[5, 1]
    g = fresh_mask(9, sink=1, recent=0, key_group=4)  # groups [1..4], [5..8]
    assert g[3, 1] and g[4, 1] and not g[5, 1] and g[7, 5] and g[8, 5]


def test_flash_lse_fallback_matches_aten():
    """The far part's flash attention (aten CPU op) and its explicit fallback agree, lse included."""

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, 13, 16, generator=g) for _ in range(3))
    o1, l1 = window_attention._flash_lse(q, k, v, 0.25, causal=True)
    o2, l2 = window_attention._flash_lse(q.double(), k.double(), v.double(), 0.25, causal=True)  # float64: the explicit path
    assert torch.allclose(o1.double(), o2, atol=1e-5) and torch.allclose(l1.double(), l2, atol=1e-5)


def test_window_nll_matches_logits(tiny):
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    nll, n = window_nll(tiny, ids, chunk=7)
    with torch.no_grad():
        lg = tiny(input_ids=ids).logits[0, :-1]
    ref = torch.nn.functional.cross_entropy(lg, ids[0, 1:], reduction="sum").item()
    assert n == 19 and math.isclose(nll, ref, rel_tol=1e-5)


@pytest.mark.parametrize("quant", [QuantConfig(bits=2), QuantConfig(bits=2, key_axis="channel", group_size=4)])
def test_window_prefix_equals_shorter_window(tiny, quant):
    """A shorter window starting at the same token is scored from the longer window's prefix."""
    art = rotated_artifact(tiny.config, quant)
    proto = Protocol("t", sink=3, recent=2)
    ids = torch.randint(0, 97, (1, 33), generator=torch.Generator().manual_seed(8))
    with simulated(tiny, art, proto):
        tot, n, parts = window_nll(tiny, ids, chunk=5, prefixes=(13, 21))
        full = window_nll(tiny, ids, chunk=7)
        short = [window_nll(tiny, ids[:, :P]) for P in (13, 21)]
    assert n == 32 and math.isclose(tot, full[0], rel_tol=1e-5)
    for (a, na), (b, nb) in zip(parts, short):
        assert na == nb and math.isclose(a, b, rel_tol=1e-5), (a, b)


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("page", [1, 4])
def test_simulator_matches_oscarcache(tiny, scaled, page):
    """The validation simulator equals the product cache (kernels/cache.py) on the same artifact.

    OscarCache's decode step at p reads the layout of p+1 tokens (the current token is written first)
    and releases whole pages of P tokens once they are R tokens old, so its recent window R = P is our
    protocol's recent P - 1 with pages of P (page 1: token-granular, recent 1 ↔ recent 0).
    """
    cache_mod = pytest.importorskip("oscar.kernels.cache")
    art = rotated_artifact(tiny.config, QuantConfig(bits=2, page_size=page), scaled=scaled)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(4))
    try:
        with torch.no_grad():
            with simulated(tiny, art, Protocol("strict", sink=4, recent=page - 1)):
                mine = tiny(input_ids=ids, use_cache=False).logits
            c = cache_mod.OscarCache.from_artifact(tiny, art, page_size=page, recent=page, sink=4)
            theirs = tiny(input_ids=ids, cache=c, use_cache=True).logits
    finally:
        tiny.set_attn_implementation("sdpa")
    assert torch.allclose(mine, theirs, atol=1e-5), (mine - theirs).abs().max()


def test_pages_leave_the_window_whole(tiny):
    """`pages` protocols release per-token K/V in whole pages counted from the sink; strict-token does not."""
    art = rotated_artifact(tiny.config, QuantConfig(bits=2, page_size=16))
    paged, token = LayerQuant(art, 0), LayerQuant(art, 0, pages=False)
    assert paged.key_group == 16 and token.key_group == 1
    assert paged.quantized_until(64 + 15, 64, 0) == 64 and token.quantized_until(64 + 15, 64, 0) == 79
    assert paged.quantized_until(64 + 256 + 40, 64, 256) == 96
    assert PROTOCOLS["strict"].pages and PROTOCOLS["serving"].pages and not PROTOCOLS["strict-token"].pages


def test_bfloat16_compute_paths(tiny):
    """--dtype bfloat16: the flash/band perplexity path matches the dense reference and the batched
    cache matches each method's own cache, both computing in bf16 (bf16 tolerances)."""
    import copy

    from oscar.scoring.dtype import with_dtype

    m = with_dtype(copy.deepcopy(tiny), "bfloat16")
    assert next(m.parameters()).dtype == torch.bfloat16
    art = rotated_artifact(tiny.config, QuantConfig(bits=2, key_axis="channel", group_size=4))
    proto = Protocol("t", sink=3, recent=5)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        with simulated(m, art, proto):
            fast = m(input_ids=ids, use_cache=False).logits.float()
        with simulated(m, art, proto, dense=True):
            dense = m(input_ids=ids, use_cache=False).logits.float()
        assert (fast - dense).abs().max() < 5e-2, (fast - dense).abs().max()
        exact = DynamicCache()
        m(input_ids=ids[:, :30], cache=exact, use_cache=True)
        batch = MethodBatchCache.from_prefill([None, art], proto, exact, capacity=40)
        got = m(input_ids=ids[:, 30:].expand(2, -1), cache=batch, use_cache=True).logits.float()
        for r, a in enumerate([None, art]):
            want = m(input_ids=ids[:, 30:], cache=make_cache(CacheSpec.one(a, proto, prefill=exact)), use_cache=True).logits.float()
            assert (got[r] - want[0]).abs().max() < 5e-2
    with pytest.raises(OscarError, match="unknown dtype"):
        with_dtype(tiny, "float16")


@pytest.mark.parametrize("group,recent,T", [(1, 0, 70), (16, 0, 70), (4, 5, 53), (16, 60, 150), (4, 100, 130)])
def test_band_batched_equals_band_loop(group, recent, T):
    """The perplexity band in batched blocks (narrow bands) equals the 256-query loop (wide bands), for
    token-granular, paged and per-channel (mixed) keys, T not a multiple of the block."""

    g = torch.Generator().manual_seed(12)
    q = torch.randn(1, 4, T, 16, generator=g)
    k, v = torch.randn(1, 2, T, 16, generator=g), torch.randn(1, 2, T, 16, generator=g)
    kh, vh = k + 0.1 * torch.randn(k.shape, generator=g), v + 0.1 * torch.randn(v.shape, generator=g)
    W = recent + group
    a = window_attention._band(q, k, v, kh, vh, 3, recent, group, W, 0.25)
    b = window_attention._band_loop(q, k, v, kh, vh, 3, recent, group, W, 0.25)
    assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-5)


def test_wide_band_ppl_equals_dense(tiny):
    """A serving-like band (recent 60, pages of 16: W = 76 > 64, the loop) with a far part, against the dense reference."""
    art = rotated_artifact(tiny.config, QuantConfig(bits=2))
    proto = Protocol("t", sink=3, recent=60)
    ids = torch.randint(0, 97, (1, 120), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        with simulated(tiny, art, proto):
            fast = tiny(input_ids=ids, use_cache=False).logits
        with simulated(tiny, art, proto, dense=True):
            dense = tiny(input_ids=ids, use_cache=False).logits
        exact = tiny(input_ids=ids, use_cache=False).logits
    assert torch.allclose(fast, dense, atol=2e-5), (fast - dense).abs().max()
    assert (fast - exact).abs().max() > 1e-3


def test_uncalibrated_warning_names_the_lengths(tiny):
    """Contexts past the calibration length warn (the fit never saw those RoPE phases); within it, or for an
    artifact that does not record it, they do not."""
    from dataclasses import replace

    art = identity_artifact(tiny.config)
    assert uncalibrated_warning(art, 8192) is None  # not recorded: nothing to say
    art = replace(art, meta={"provenance": {"seq_len": 2048}})
    assert uncalibrated_warning(art, 2048) is None and uncalibrated_warning(None, 8192) is None
    w = uncalibrated_warning(art, 4096)
    assert "4096" in w and "(2048 tokens)" in w and "--positions 4096" in w
    # windows read at offsets (`oscar calibrate --positions`): the positions covered count, not the window
    art = replace(art, meta={"provenance": {"seq_len": 2048, "positions": 8192}})
    assert uncalibrated_warning(art, 8192) is None and "(8192 tokens)" in uncalibrated_warning(art, 8193)
