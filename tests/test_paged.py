"""The paged cache layout and the torch reference, against brute-force definitions."""


import pytest
import torch

from oscar.common import OscarError
from oscar.kernels import reference as ref
from oscar.kernels.dispatch import quantize_pages
from oscar.kernels.paged import PagedConfig, PagedKVCache, PagedLayerCache, PoolExhausted, layout
from oscar.kernels.rotation import LayerRotation
from oscar.quant import QuantSpec, fake_quant, pack, unpack
from oscar.stats.artifact import QuantConfig


def scaled_pair(H, D, g):
    """A non-orthogonal key transform U diag(d) M and its dual U diag(1/d) M (the `scaled` variant's shape)."""
    qr = lambda: torch.linalg.qr(torch.randn(H, D, D, generator=g))[0]  # noqa: E731
    U, M, d = qr(), qr(), torch.rand(H, 1, D, generator=g) * 3 + 0.25
    return (U * d) @ M, (U / d) @ M


def random_rotation(H, D, seed, mean=True, clip=None, static=False, scaled=False):
    g = torch.Generator().manual_seed(seed)
    qr = lambda: torch.linalg.qr(torch.randn(H, D, D, generator=g))[0]  # noqa: E731
    if static:
        ck, cv = torch.rand(H, D, generator=g) + 1.0, torch.rand(H, generator=g) + 1.0
    else:
        ck = cv = torch.full((H,), clip or 1.0)
    mu = torch.randn(H, D, generator=g) if mean else None
    rk, rq = scaled_pair(H, D, g) if scaled else (qr(), None)
    return LayerRotation(rot_k=rk, rot_v=qr(), clip_k=ck, clip_v=cv, k_mean=mu, rot_q=rq)


def make(mode="minmax", key_axis="token", H=2, D=16, P=4, S=3, R=8, pages=32, seqs=4, seed=0, dtype=torch.bfloat16,
         scaled=False, param_dtype=torch.float16, group_size=None, key_split=0, **kw):
    tiers = {}
    if key_axis == "split":  # split keys (QuantConfig.key_split): half the channels one bit wider
        key_axis, key_split = "token", D // 2
    if key_axis == "tiers":  # split keys as tiers: half the channels two bits wider, the last quarter not stored
        key_axis, key_split, tiers = "token", D // 2, {"key_top": 2, "key_drop": D // 4}
    quant = QuantConfig(page_size=P, sink=S, recent=R, mode=mode, key_axis=key_axis, group_size=group_size,
                        param_dtype=str(param_dtype).removeprefix("torch."), key_split=key_split, **tiers)
    cfg = PagedConfig(quant, H, D, num_pages=pages, max_seqs=seqs, dtype=dtype, **kw)
    rot = random_rotation(H, D, seed, clip=0.9 if mode == "minmax" else None, static=mode == "static", scaled=scaled)
    if key_split:  # split keys (tests/test_split_cache.py): a clip ratio per head and key part
        rot.clip_k = torch.tensor([0.95, 0.85]).expand(H, 2).contiguous()
    return PagedLayerCache(cfg, rot, quantizer=quantize_pages)


def tokens(H, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, T, D, generator=g) * 2, torch.randn(H, T, D, generator=g)


MODES = [("minmax", "token"), ("minmax", "channel"), ("static", "token")]
MODES_G = [(m, a, None) for m, a in MODES] + [("minmax", "token", 4)]


def test_layout_is_sink_pages_ring():
    cfg = PagedConfig(QuantConfig(page_size=4, sink=3, recent=8), num_kv_heads=1, head_dim=8, num_pages=4)
    assert layout(0, cfg) == (0, 0, 0, 0)
    assert layout(2, cfg) == (2, 0, 0, 0)
    assert layout(3 + 11, cfg) == (3, 0, 11, 0)  # ring holds up to R + P - 1 = 11
    assert layout(3 + 12, cfg) == (3, 1, 8, 4)  # the 12th token pushes the oldest page out
    for n in range(60):
        l = layout(n, cfg)
        assert l.sink_len + l.num_pages * 4 + l.ring_len == n
        assert l.ring_len < cfg.ring_size and (n < 3 + 8 or l.ring_len >= 8)


def test_config_rejects_bad_formats():
    with pytest.raises(ValueError, match="multiple of page_size"):
        PagedConfig(QuantConfig(page_size=16, recent=100), num_kv_heads=1, head_dim=8, num_pages=1)
    with pytest.raises(ValueError, match="static"):
        PagedConfig(QuantConfig(mode="static", key_axis="channel"), num_kv_heads=1, head_dim=8, num_pages=1)
    with pytest.raises(ValueError, match="divide"):
        PagedConfig(QuantConfig(group_size=16), num_kv_heads=1, head_dim=24, num_pages=1)
    with pytest.raises(ValueError, match="whole number of bytes"):
        PagedConfig(QuantConfig(), num_kv_heads=1, head_dim=6, num_pages=1)
    with pytest.raises(OscarError, match="set page_size = group_size"):
        PagedConfig(QuantConfig(key_axis="channel", group_size=32, page_size=16), 2, 64, num_pages=8)
    with pytest.raises(OscarError, match="must be a QuantConfig"):
        PagedConfig({"page_size": 16}, 2, 64, num_pages=8)
    quant = QuantConfig(page_size=32, sink=4, recent=64)
    cfg = PagedConfig(quant, 2, 64, num_pages=8)
    assert cfg.quant is quant  # held, not copied
    assert (cfg.quant.page_size, cfg.quant.sink, cfg.quant.recent, cfg.ring_size, cfg.packed_dim) == (32, 4, 64, 96, 16)
    assert (cfg.key_spec, cfg.value_spec) == (quant.key_spec(64), quant.value_spec(64))  # one derivation


FP8 = torch.float8_e4m3fn
MODES_PD = [(m, a, torch.float16) for m, a in MODES] + [("minmax", "token", FP8), ("minmax", "channel", FP8),
                                                        ("minmax", "split", FP8),  # split keys: 8 of 16 channels at 3 bits
                                                        ("minmax", "tiers", FP8)]  # 8 at 4 bits, 4 at 2, 4 not stored


@pytest.mark.parametrize("mode,axis,pd", MODES_PD)
def test_stored_sequence_matches_brute_force(mode, axis, pd):
    """dequantize_sequence(rotated) == sink, fake_quant of each page, ring — by definition."""
    c = make(mode, axis, param_dtype=pd)
    H, D, P, S = 2, 16, 4, 3
    k, v = tokens(H, 30, D, 1)
    s = c.new_sequence()
    c.append(s, k, v)
    got_k, got_v = ref.dequantize_sequence(c, s, dtype=torch.float32, rotated=True)
    kr = c.rot.rotate_k(k).to(torch.bfloat16).float()
    vr = c.rot.rotate_v(v).to(torch.bfloat16).float()
    lay = layout(30, c.cfg)
    a, e = S, S + lay.num_pages * P
    want_k, want_v = kr.clone(), vr.clone()
    for p0 in range(a, e, P):
        blk_k, blk_v = kr[:, p0:p0 + P], vr[:, p0:p0 + P]
        if mode == "static":
            want_k[:, p0:p0 + P] = fake_quant(blk_k, QuantSpec(group_size=1, mode="static"), c.rot.clip_k.reshape(H, 1, D))
            want_v[:, p0:p0 + P] = fake_quant(blk_v, QuantSpec(group_size=1, mode="static"), c.rot.clip_v.reshape(H, 1, 1))
        elif axis == "split":  # each part its own per-token group under its own clip: [0, 8) at 3 bits, [8, 16) at 2
            ck = c.rot.clip_k
            want_k[:, p0:p0 + P, :8] = fake_quant(blk_k[..., :8].contiguous(), QuantSpec(bits=3, param_dtype=pd), ck[:, :1, None])
            want_k[:, p0:p0 + P, 8:] = fake_quant(blk_k[..., 8:].contiguous(), QuantSpec(param_dtype=pd), ck[:, 1:, None])
            want_v[:, p0:p0 + P] = fake_quant(blk_v, QuantSpec(param_dtype=pd), 0.9)
        elif axis == "tiers":  # [0, 8) at 4 bits, [8, 12) at 2, [12, 16) not stored: read as 0 (the key mean)
            ck = c.rot.clip_k
            want_k[:, p0:p0 + P, :8] = fake_quant(blk_k[..., :8].contiguous(), QuantSpec(bits=4, param_dtype=pd), ck[:, :1, None])
            want_k[:, p0:p0 + P, 8:12] = fake_quant(blk_k[..., 8:12].contiguous(), QuantSpec(param_dtype=pd), ck[:, 1:, None])
            want_k[:, p0:p0 + P, 12:] = 0
            want_v[:, p0:p0 + P] = fake_quant(blk_v, QuantSpec(param_dtype=pd), 0.9)
        else:
            kspec = QuantSpec(axis="channel", group_size=P, param_dtype=pd) if axis == "channel" else QuantSpec(param_dtype=pd)
            want_k[:, p0:p0 + P] = fake_quant(blk_k, kspec, 0.9)
            want_v[:, p0:p0 + P] = fake_quant(blk_v, QuantSpec(param_dtype=pd), 0.9)
    assert lay.num_pages == 4
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)
    # model space: un-rotation of the same tensors
    mk, mv = ref.dequantize_sequence(c, s, dtype=torch.float32)
    torch.testing.assert_close(mk, want_k @ c.rot.rot_k.transpose(-1, -2) + c.rot.k_mean.unsqueeze(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mv, want_v @ c.rot.rot_v.transpose(-1, -2), rtol=1e-5, atol=1e-5)


def _state(c, s):
    n = c.lengths[s]
    lay = layout(n, c.cfg)
    ids = torch.tensor(c.pages[s], dtype=torch.int64)
    slots = (torch.arange(lay.ring_len) + lay.ring_start) % c.cfg.ring_size
    out = [c.sink_k[s, :, :lay.sink_len], c.sink_v[s, :, :lay.sink_len], c.ring_k[s][:, slots], c.ring_v[s][:, slots],
           c.k_codes[ids], c.v_codes[ids]]
    if c.cfg.quant.mode != "static":
        out += [c.k_scale[ids], c.k_zero[ids], c.v_scale[ids], c.v_zero[ids]]
    return out


@pytest.mark.parametrize("mode,axis,pd", MODES_PD)
def test_chunked_appends_are_bit_identical_to_one_shot(mode, axis, pd):
    k, v = tokens(2, 37, 16, 2)
    one, chunked = make(mode, axis, param_dtype=pd), make(mode, axis, param_dtype=pd)
    a, b = one.new_sequence(), chunked.new_sequence()
    one.append(a, k, v)
    for lo, hi in [(0, 1), (1, 2), (2, 9), (9, 10), (10, 25), (25, 26), (26, 37)]:
        chunked.append(b, k[:, lo:hi], v[:, lo:hi])
    for x, y in zip(_state(one, a), _state(chunked, b)):
        assert torch.equal(x, y)


def test_fp8_params_out_of_range_refused_before_writing():
    """8-bit scale/zero hold +-448: a page with larger (rotated) values is refused whole, at the append
    that would quantize it, and nothing changes; 16-bit sink/ring tokens are never checked."""
    c = make(param_dtype=FP8, S=3, R=8, P=4)
    a, b = c.new_sequence(), c.new_sequence()
    c.append(a, *tokens(2, 3 + 2 * 4 + 8, 16, 20))  # 2 pages
    k, v = tokens(2, 3 + 8, 16, 21)
    k[:, 0] *= 1e4  # a huge sink token: kept in 16 bits, never quantized
    v[:, 5] = 1e4  # a huge ring token: accepted for now
    c.append(b, k, v)
    before = [t.clone() for t in _state(c, a) + _state(c, b)]
    lens, free = list(c.lengths), list(c.free_pages)
    with pytest.raises(OscarError, match=r"rotated values entering INT2 pages reach \|x\| = .*8-bit \(e4m3\).*nothing was written"):
        c.append(b, *tokens(2, 4, 16, 22))  # pushes the huge token into a page
    assert c.lengths == lens and c.free_pages == free
    for x, y in zip(before, _state(c, a) + _state(c, b)):
        assert torch.equal(x, y)
    c.append(a, *tokens(2, 4, 16, 23))  # other sequences go on
    assert len(c.pages[a]) == 3
    with pytest.raises(OscarError, match="reach"):
        c.append(a, torch.full((2, 12, 16), float("nan")), torch.zeros(2, 12, 16))  # NaN is refused too


def test_page_codes_are_packed_little_endian():
    c = make("minmax", "token", S=0, R=0, P=4)
    s = c.new_sequence()
    k, v = tokens(2, 4, 16, 3)
    c.append(s, k, v)
    (pid,) = c.pages[s]
    codes = unpack(c.k_codes[pid], 2)  # (Hkv, P, D)
    assert torch.equal(pack(codes, 2), c.k_codes[pid])
    byte = c.k_codes[pid, 0, 0, 0].item()
    assert [(byte >> (2 * i)) & 3 for i in range(4)] == codes[0, 0, :4].tolist()


def _sdpa(q, k, v, scale):
    # q (Hq, D), k/v (Hkv, n, D) model space, explicit softmax in float64
    G = q.shape[0] // k.shape[0]
    kk, vv = k.double().repeat_interleave(G, 0), v.double().repeat_interleave(G, 0)
    logits = torch.einsum("hd,hnd->hn", q.double(), kk) * scale
    return torch.einsum("hn,hnd->hd", torch.softmax(logits, -1), vv), torch.logsumexp(logits, -1)


@pytest.mark.parametrize("mode,axis,group,scaled,split", [m + (False, 0) for m in MODES_G]
                         + [("minmax", "token", None, True, 0), ("minmax", "token", None, True, 8),
                            ("minmax", "tiers", None, True, 0)])
@pytest.mark.parametrize("G", [1, 3])
def test_reference_decode_equals_attention_over_dequantized_cache(mode, axis, group, scaled, split, G):
    """Rotating q, adding q.mu and un-rotating o is exact: same result as attention on the model-space K/V;
    the CPU path that works on the codes equals the dequantize-everything oracle. scaled: a non-orthogonal
    rot_k read with its dual rot_q (keys un-rotated with rot_qᵀ) is exact too; split: split keys (8 of 16
    channels at 3 bits, 8-bit params), whose CPU path sums the logit over the two parts; tiers: 8 channels at 4 bits,
    4 at 2 and 4 not stored."""
    c = make(mode, axis, group_size=group, scaled=scaled, key_split=split,
             param_dtype=torch.float8_e4m3fn if split or axis == "tiers" else torch.float16)
    lens = [2, 11, 30, 45]
    seqs = []
    for i, n in enumerate(lens):
        s = c.new_sequence()
        c.append(s, *tokens(2, n, 16, 10 + i))
        seqs.append(s)
    q = torch.randn(len(lens), 2 * G, 16, generator=torch.Generator().manual_seed(5))
    o, lse = ref.decode_attention_oracle(q, c, seqs, scale=0.3, return_lse=True)
    fo, flse = ref.decode_attention(q, c, seqs, scale=0.3, return_lse=True)  # on the codes, CPU path
    torch.testing.assert_close(fo, o, rtol=0, atol=2e-5)
    torch.testing.assert_close(flse, lse, rtol=0, atol=2e-5)
    for b, s in enumerate(seqs):
        k, v = ref.dequantize_sequence(c, s, dtype=torch.float32)
        want_o, want_lse = _sdpa(q[b], k, v, 0.3)
        torch.testing.assert_close(o[b].double(), want_o, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse[b].double(), want_lse, rtol=1e-4, atol=1e-4)


def test_passthrough_is_exact():
    cfg = PagedConfig.passthrough(num_kv_heads=3, head_dim=8, max_len=40, dtype=torch.float32)
    c = PagedLayerCache(cfg, quantizer=quantize_pages)
    s = c.new_sequence()
    k, v = tokens(3, 40, 8, 4)
    c.append(s, k[:, :25], v[:, :25])
    c.append(s, k[:, 25:], v[:, 25:])
    got_k, got_v = ref.dequantize_sequence(c, s)
    assert torch.equal(got_k, k) and torch.equal(got_v, v) and c.pages[s] == []
    q = torch.randn(1, 6, 8)
    o = ref.decode_attention(q, c, [s])
    want = torch.nn.functional.scaled_dot_product_attention(q[0].unsqueeze(1), k.repeat_interleave(2, 0), v.repeat_interleave(2, 0))
    torch.testing.assert_close(o[0], want[:, 0], rtol=1e-6, atol=1e-6)


def test_fork_shares_pages_and_free_returns_them():
    c = make(pages=12)
    a = c.new_sequence()
    c.append(a, *tokens(2, 27, 16, 6))  # 3 + 4 pages * 4 + 8 ring
    assert len(c.pages[a]) == 4
    b = c.fork(a)
    assert c.pages[b] == c.pages[a] and all(c.refcount[p] == 2 for p in c.pages[a])
    k2, v2 = tokens(2, 6, 16, 7)
    c.append(b, k2, v2)  # b grows on its own pages
    assert c.pages[b][:4] == c.pages[a] and len(c.pages[b]) == 5
    assert c.block_table[b, :5].tolist() == c.pages[b] and c.block_table[a, :4].tolist() == c.pages[a]
    fk, fv = ref.dequantize_sequence(c, b, dtype=torch.float32)
    fresh = make(pages=12)
    f = fresh.new_sequence()
    k, v = tokens(2, 27, 16, 6)
    fresh.append(f, torch.cat([k, k2], 1), torch.cat([v, v2], 1))
    wk, wv = ref.dequantize_sequence(fresh, f, dtype=torch.float32)
    assert torch.equal(fk, wk) and torch.equal(fv, wv)  # sharing == recomputing the prefix
    free_before = len(c.free_pages)
    c.free(a)
    assert len(c.free_pages) == free_before  # still referenced by b
    c.free(b)
    assert len(c.free_pages) == 12 and all(r == 0 for r in c.refcount)


def test_pool_exhaustion_raises_and_changes_nothing():
    c = make(pages=5)
    a, b = c.new_sequence(), c.new_sequence()
    c.append(a, *tokens(2, 3 + 3 * 4 + 8, 16, 8))  # 3 pages
    before_a = [t.clone() for t in _state(c, a)]
    c.append(b, *tokens(2, 3 + 8, 16, 9))
    before_b = [t.clone() for t in _state(c, b)]
    lens, free = list(c.lengths), list(c.free_pages)
    with pytest.raises(PoolExhausted, match="needs 3 new pages.*2 of 5 are free; nothing was written"):
        c.append(b, *tokens(2, 12, 16, 10))
    assert c.lengths == lens and c.free_pages == free
    for x, y in zip(before_a + before_b, _state(c, a) + _state(c, b)):
        assert torch.equal(x, y)
    c.append(b, *tokens(2, 8, 16, 11))  # 2 pages still fit
    assert len(c.free_pages) == 0
    narrow = make(pages=8, max_pages_per_seq=2)  # block-table width bounds one sequence
    s = narrow.new_sequence()
    with pytest.raises(PoolExhausted, match="max_pages_per_seq=2; nothing was written"):
        narrow.append(s, *tokens(2, 3 + 3 * 4 + 8, 16, 12))
    assert narrow.lengths[s] == 0 and len(narrow.free_pages) == 8


def test_bad_inputs_raise_clearly():
    c = make()
    s = c.new_sequence()
    with pytest.raises(OscarError, match=r"k must be \(Hkv=2, T, D=16\)"):
        c.append(s, torch.randn(3, 4, 16), torch.randn(3, 4, 16))
    with pytest.raises(OscarError, match="floating"):
        c.append(s, torch.zeros(2, 4, 16, dtype=torch.int64), torch.zeros(2, 4, 16, dtype=torch.int64))
    with pytest.raises(OscarError, match="differ in shape"):
        c.append(s, torch.randn(2, 4, 16), torch.randn(2, 5, 16))
    with pytest.raises(OscarError, match="not active"):
        c.append(3, torch.randn(2, 4, 16), torch.randn(2, 4, 16))
    with pytest.raises(OscarError, match="outside"):
        c.free(9)
    from oscar.kernels.dispatch import decode_attention

    with pytest.raises(OscarError, match="empty"):
        decode_attention(torch.randn(1, 2, 16), c, [s])
    c.append(s, *tokens(2, 5, 16, 0))
    with pytest.raises(OscarError, match="multiple of Hkv"):
        decode_attention(torch.randn(1, 3, 16), c, [s])
    with pytest.raises(OscarError, match="dtype"):
        decode_attention(torch.zeros(1, 2, 16, dtype=torch.float64), c, [s])
    with pytest.raises(OscarError, match="2 sequence ids"):
        decode_attention(torch.randn(1, 2, 16), c, [s, s])
    other = "cuda" if torch.cuda.is_available() else "meta"  # a device the cache is not on
    with pytest.raises(OscarError, match=f"k is on {other}"):
        c.append(s, torch.randn(2, 1, 16, device=other), torch.randn(2, 1, 16, device=other))
    with pytest.raises(OscarError, match=f"q is on {other}"):
        decode_attention(torch.randn(1, 2, 16, device=other), c, [s])
    assert c.lengths[s] == 5
    meta = c.rot
    with pytest.raises(OscarError, match="minmax clip ratios"):
        PagedLayerCache(c.cfg, LayerRotation(meta.rot_k, meta.rot_v, torch.full((2,), 1.5), meta.clip_v),
                        quantizer=quantize_pages)
    with pytest.raises(OscarError, match="rotation shape"):
        PagedLayerCache(c.cfg, LayerRotation.identity_for(3, 16), quantizer=quantize_pages)


def test_kv_cache_from_artifact_applies_every_layer():
    from transformers import LlamaConfig

    from oscar.stats.artifact import identity_artifact

    conf = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    art = identity_artifact(conf, QuantConfig(page_size=4, sink=2, recent=8))
    cache = PagedKVCache.from_artifact(art, num_pages=8, max_seqs=2, quantizer=quantize_pages)
    s = cache.new_sequence()
    for layer in cache.layers:
        layer.append(s, *tokens(2, 20, 16, 0))
    t = cache.fork(s)
    assert all(l.pages[t] == l.pages[s] and len(l.pages[s]) == 2 for l in cache.layers)
    cache.free(s)
    cache.free(t)
    assert all(len(l.free_pages) == 8 for l in cache.layers)


def test_chunk_queries_over_history_merge_exactly_with_the_chunk():
    """Chunked prefill recipe: T query rows on the same sequence (seqs=[s]*T) attend to the cached
    history; merging with causal attention inside the chunk by log-sum-exp equals attention over all."""
    c = make("minmax", "token")
    s = c.new_sequence()
    k, v = tokens(2, 40, 16, 12)
    c.append(s, k, v)
    kh, vh = ref.dequantize_sequence(c, s, dtype=torch.float32)  # history as stored
    T = 5
    q = torch.randn(T, 4, 16, generator=torch.Generator().manual_seed(3))
    kc, vc = tokens(2, T, 16, 13)  # the new chunk (full precision)
    o_hist, lse_hist = ref.decode_attention(q, c, [s] * T, scale=0.25, return_lse=True)  # (T, Hq, D), (T, Hq)
    kq, vq = kc.repeat_interleave(2, 0), vc.repeat_interleave(2, 0)  # (Hq, T, D)
    logits = torch.einsum("thd,hsd->hts", q, kq) * 0.25
    logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    lse_c = torch.logsumexp(logits, -1).transpose(0, 1)  # (T, Hq)
    o_c = (torch.softmax(logits, -1) @ vq).transpose(0, 1)  # (T, Hq, D)
    lse = torch.logaddexp(lse_hist, lse_c)
    merged = o_hist * (lse_hist - lse).exp().unsqueeze(-1) + o_c * (lse_c - lse).exp().unsqueeze(-1)
    kk, vv = torch.cat([kh, kc], 1).repeat_interleave(2, 0), torch.cat([vh, vc], 1).repeat_interleave(2, 0)
    full = torch.einsum("thd,hsd->hts", q, kk) * 0.25
    full = full.masked_fill(torch.ones(T, 40 + T, dtype=torch.bool).triu(41), float("-inf"))
    want = (torch.softmax(full, -1) @ vv).transpose(0, 1)
    torch.testing.assert_close(merged, want, rtol=1e-5, atol=1e-5)
