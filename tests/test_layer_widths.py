"""Per-layer widths in the cache: a layer's keys at 3 or 4 bits as one wide part (key_split = D, fp16
key params while values and the 2-bit layers keep e4m3 ones), `Artifact.layer_quant`, the pool, OscarCache, the
simulator and the memory accounting. The stored rows against brute force, Triton against the reference (under
TRITON_INTERPRET=1), the cache against the simulator on a real transformers model."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from oscar.common import OscarError
from oscar.kernels import reference as ref
from oscar.kernels.dispatch import quantize_pages
from oscar.kernels.paged import PagedConfig, PagedKVCache, PagedLayerCache
from oscar.kernels.rotation import LayerRotation
from oscar.quant import FP8_PARAM, QuantSpec, fake_quant, pack_planes, unpack_planes
from oscar.stats.artifact import QuantConfig

ROOT = Path(__file__).resolve().parents[1]


def wide_quant(top: int, D: int, key_params="float16", **kw) -> QuantConfig:
    """A layer whose keys are all 2 + top bits (one part), values 2-bit with e4m3 params."""
    return QuantConfig(param_dtype="float8_e4m3fn", key_param_dtype=key_params, key_split=D, key_top=top, **kw)


def rotation(H, D, seed):
    """A scaled (non-orthogonal) key transform with its dual, a key mean, per-head clips: what a scaled fit gives."""
    g = torch.Generator().manual_seed(seed)
    qr = lambda: torch.linalg.qr(torch.randn(H, D, D, generator=g))[0]  # noqa: E731
    U, d = qr(), torch.rand(H, 1, D, generator=g) * 2 + 0.5
    return LayerRotation(rot_k=U * d, rot_v=qr(), clip_k=torch.rand(H, generator=g) * 0.3 + 0.7,
                         clip_v=torch.full((H,), 0.9), k_mean=torch.randn(H, D, generator=g), rot_q=U / d)


def make(H=2, D=32, top=1, P=4, S=3, R=8, pages=64, seqs=10, key_params="float16", seed=0):
    cfg = PagedConfig(wide_quant(top, D, key_params, page_size=P, sink=S, recent=R), H, D, num_pages=pages, max_seqs=seqs)
    return PagedLayerCache(cfg, rotation(H, D, seed), quantizer=quantize_pages)


def tokens(H, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, T, D, generator=g) * 2, torch.randn(H, T, D, generator=g)


@pytest.mark.parametrize("top", [1, 2])
def test_wide_layer_rows_against_brute_force(top):
    """A 3- / 4-bit key row is the low plane of every channel plus `top` planes of D/8 bytes, one fp16 (scale, zero)
    per token; the dequantized keys equal fake_quant at 2 + top bits with fp16 params, bit for bit; values stay INT2
    with e4m3 params."""
    H, D = 2, 32
    c = make(H=H, D=D, top=top)
    assert c.cfg.k_packed_dim == D // 4 + top * D // 8 and c.cfg.packed_dim == D // 4
    assert c.k_scale.shape[-1] == 1 and c.k_scale.dtype == torch.float16 and c.v_scale.dtype == FP8_PARAM
    s = c.new_sequence()
    c.append(s, *tokens(H, 40, D, 1))
    ids = torch.tensor(c.pages[s])
    codes = unpack_planes(c.k_codes[ids], 2, D, D, top=top)
    assert int(codes.max()) == (1 << (2 + top)) - 1  # the top planes are used
    assert torch.equal(pack_planes(codes, 2, D, top=top), c.k_codes[ids])
    kr, _ = ref.gather_rotated(c, s)  # (H, n, D) rotated: sink | pages | ring
    n = len(c.pages[s]) * 4
    k, _ = tokens(H, 40, D, 1)
    stored = c.rot.rotate_k(k).to(torch.bfloat16).float()[:, 3:3 + n]  # what the pages were quantized from
    want = fake_quant(stored.reshape(H, -1, 4, D).transpose(0, 1), QuantSpec(bits=2 + top, param_dtype=torch.float16),
                      c.rot.clip_k.view(1, H, 1, 1)).transpose(0, 1).reshape(H, n, D)
    assert torch.equal(kr[:, 3:3 + n], want)


def test_wide_layer_decode_reference_equals_oracle():
    """The reference decode on the codes (one part: s (q . c) + z sum q) against dequantize-and-attend."""
    H, D = 2, 48
    c = make(H=H, D=D, top=2)
    seqs = []
    for i, n in enumerate([2, 14, 37]):
        s = c.new_sequence()
        c.append(s, *tokens(H, n, D, 10 + i))
        seqs.append(s)
    q = torch.randn(3, H * 3, D, generator=torch.Generator().manual_seed(2))
    o1, l1 = ref.decode_attention_oracle(q, c, seqs, return_lse=True)
    o2, l2 = ref.decode_attention(q, c, seqs, return_lse=True)
    torch.testing.assert_close(o2, o1, rtol=0, atol=1e-5)
    torch.testing.assert_close(l2, l1, rtol=0, atol=1e-5)


def test_layer_formats_refused():
    from oscar.kernels.paged import layer_config

    with pytest.raises(OscarError, match="key_split 40"):  # more wide channels than stored
        PagedConfig(QuantConfig(key_split=40), 2, 32, num_pages=4)
    with pytest.raises(OscarError, match="key_param_dtype"):
        QuantConfig(key_param_dtype="int8")
    base = PagedConfig(QuantConfig(param_dtype="float8_e4m3fn"), 2, 32, num_pages=4)
    with pytest.raises(OscarError, match="recent"):  # layers share the layout
        layer_config(base, replace(base.quant, recent=512))
    cfg = PagedConfig(wide_quant(1, 32, page_size=4, sink=3, recent=8), 2, 32, num_pages=4)
    rot = rotation(2, 32, 0)
    bad = LayerRotation(rot_k=rot.rot_k, rot_v=rot.rot_v, clip_k=torch.full((2, 2), 0.9), clip_v=rot.clip_v,
                        k_mean=rot.k_mean, rot_q=rot.rot_q)
    with pytest.raises(OscarError, match=r"\(2, 1\)"):  # one part: one ratio per head
        PagedLayerCache(cfg, bad, quantizer=quantize_pages)


def test_pool_with_per_layer_formats_shares_pages_and_forks():
    """Layers of one pool with different key formats: the same page ids per sequence in every layer, each layer's
    own row size and param dtype, a fork shares them; a refused layout difference names the field."""
    H, D, L = 2, 32, 3
    base = QuantConfig(page_size=4, sink=3, recent=8, param_dtype="float8_e4m3fn")
    lq = [base, replace(wide_quant(2, D), page_size=4, sink=3, recent=8), replace(wide_quant(1, D), page_size=4, sink=3, recent=8)]
    pool = PagedKVCache(PagedConfig(base, H, D, num_pages=32, max_seqs=4), [rotation(H, D, l) for l in range(L)],
                        quantizer=quantize_pages, layer_quant=lq)
    assert [pc.cfg.k_packed_dim for pc in pool.layers] == [D // 4, D // 4 + D // 4, D // 4 + D // 8]
    assert [pc.k_scale.dtype for pc in pool.layers] == [FP8_PARAM, torch.float16, torch.float16]
    s = pool.new_sequence()
    for l, pc in enumerate(pool.layers):
        pc.append(s, *tokens(H, 30, D, l))
    t = pool.fork(s)
    assert all(pc.pages[s] == pool.layers[0].pages[s] == pc.pages[t] for pc in pool.layers)
    with pytest.raises(OscarError, match="page_size"):
        PagedKVCache(PagedConfig(base, H, D, num_pages=8), [rotation(H, D, 0)] * 2, quantizer=quantize_pages,
                     layer_quant=[base, replace(base, page_size=8, recent=8)])


# Triton against the reference on one-part keys (W = D): tests/test_split_cache.py (ONE_PART cases)


# ----------------------------------------------------------------- the artifact and the budget


def copy_widths_smollm2() -> list[list[int]]:
    """The (key, value) bits per layer the copy probe chose on SmolLM2 (bench/results/layer_copy_smollm2.json)."""
    rec = json.loads((ROOT / "bench/results/layer_copy_smollm2.json").read_text())
    return rec["copy"]["widths"]


def test_copy_widths_cost_2_5_bits_by_the_memory_accounting():
    """The 2.5-bit budget, from the accounting `oscar bench memory` uses (not by hand): SmolLM2's copy-chosen widths as
    per-layer formats (keys at 4 bits in 5 layers, 3 in 3, fp16 params there; e4m3 elsewhere) cost 2.5 bits per
    element, equal to the live pool's bytes; the shipped uniform formats agree with QuantConfig.bits_per_element."""
    from oscar.kernels import memory
    from oscar.stats.artifact import Artifact

    widths = copy_widths_smollm2()
    H, D, L = 3, 64, len(widths)
    base = QuantConfig(param_dtype="float8_e4m3fn")
    lq = [base if kb == 2 else wide_quant(kb - 2, D) for kb, vb in widths]
    assert all(vb == 2 for _, vb in widths) and sorted({kb for kb, _ in widths}) == [2, 3, 4]
    eye = torch.eye(D).expand(H, D, D)
    art = Artifact(rot_k=[eye] * L, rot_v=[eye] * L, clip_k=[torch.ones(H)] * L, clip_v=[torch.ones(H)] * L,
                   quant=base, layer_quant=lq)
    art.validate()
    assert memory.artifact_bits_per_element(art) == pytest.approx(2.5, abs=1e-12)
    shapes = {"num_layers": 1, "num_kv_heads": H, "head_dim": D}
    for q in (base, wide_quant(1, D), wide_quant(2, D)):
        f = memory.Format.from_quant("x", replace(q, recent=16, page_size=16, sink=0))
        per = memory.per_history_token(shapes, f)
        c = PagedLayerCache(PagedConfig(replace(q, recent=16, page_size=16, sink=0), H, D, num_pages=4),
                            LayerRotation.identity_for(H, D), quantizer=quantize_pages)
        pool = c.bytes_used()
        assert per["codes"] == pool["codes"] / (4 * 16) and per["scales"] == pool["scales"] / (4 * 16)
        assert 8 * (per["codes"] + per["scales"]) / (2 * H * D) == pytest.approx(q.bits_per_element(D))


def test_layer_quant_artifact_round_trip_and_refusals(tmp_path):
    """Saved as format oscar-artifact/3 (an older reader refuses it), loaded with the same per-layer formats; a layer
    that changes the layout, or a clip of the wrong shape for its key parts, is refused naming the layer."""
    from oscar.artifact_header import read_metadata
    from oscar.stats.artifact import Artifact, load_artifact, save_artifact

    H, D, L = 2, 32, 3
    eye = torch.eye(D).expand(H, D, D)
    base = QuantConfig(param_dtype="float8_e4m3fn")
    lq = [base, wide_quant(2, D), base]
    art = Artifact(rot_k=[eye.clone() for _ in range(L)], rot_v=[eye.clone() for _ in range(L)],
                   clip_k=[torch.full((H,), 0.9) for _ in range(L)], clip_v=[torch.ones(H) for _ in range(L)],
                   quant=base, layer_quant=lq, meta={"variant": "test"})
    save_artifact(art, str(tmp_path / "a.safetensors"))
    assert read_metadata(str(tmp_path / "a.safetensors"))["format"] == "oscar-artifact/3"
    back = load_artifact(str(tmp_path / "a.safetensors"))
    assert back.layer_quant == lq and back.quant_for(1) == lq[1] and back.quant_for(0) == base
    from oscar.stats.artifact import describe

    assert "layers 1: 4-bit keys on 32 channels, float16 params" in describe(str(tmp_path / "a.safetensors"))
    with pytest.raises(OscarError, match="layer 2's format differs .* sink"):
        replace(art, layer_quant=[base, base, replace(base, sink=8)]).validate()
    with pytest.raises(OscarError, match=r"layers.1.clip_k .* expected \(2,\)"):
        replace(art, clip_k=[torch.ones(H), torch.ones(H, 2), torch.ones(H)]).validate()
    with pytest.raises(OscarError, match="2 entries for 3 layers"):
        replace(art, layer_quant=[base, base]).validate()


# ----------------------------------------------------------------- a real model: simulator, codec and cache agree


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def widths_artifacts(config, widths, page):
    """The same per-layer widths as the validation codec ("layers") and as the cache's own format
    (native_layer_artifact), on a scaled rotation with a key mean and searched-looking clips."""
    from helpers.artifacts import rotated_artifact
    from oscar.recipe.widths import native_layer_artifact, widths_artifact

    a = rotated_artifact(config, QuantConfig(bits=2, page_size=page), seed=1, scaled=True)
    for l in range(a.num_layers):
        a.clip_k[l] = torch.full((a.num_kv_heads,), 0.85)
        a.clip_v[l] = torch.full((a.num_kv_heads,), 0.9)
    codec = widths_artifact(a, widths)
    return codec, native_layer_artifact(codec)


@pytest.mark.parametrize("page", [4, 8])
def test_native_layer_widths_equal_the_codec_and_the_cache(tiny, page):
    """On a 3-layer Llama (head_dim 16) with keys at 2 / 4 / 3 bits: the simulator on the native per-layer artifact
    equals the simulator on the "layers" codec it was converted from (the A/Bs' arm), and OscarCache (pages, fused
    reference decode) equals the simulator (its recent window R = P is the protocol's P - 1, as for every format)."""
    from oscar.kernels.cache import OscarCache
    from oscar.kernels.protocol import Protocol
    from oscar.kernels.window_attention import simulated

    codec, native = widths_artifacts(tiny.config, [[2, 2], [4, 2], [3, 2]], page)
    assert [native.quant_for(l).key_split for l in range(3)] == [0, 16, 16]
    assert [native.quant_for(l).key_top for l in range(3)] == [1, 2, 1]
    ids = torch.randint(0, 97, (1, 44), generator=torch.Generator().manual_seed(4))
    proto = Protocol("strict", sink=4, recent=page - 1)
    try:
        with torch.no_grad():
            with simulated(tiny, codec, proto):
                want = tiny(input_ids=ids, use_cache=False).logits
            with simulated(tiny, native, proto):
                sim = tiny(input_ids=ids, use_cache=False).logits
            c = OscarCache.from_artifact(tiny, native, page_size=page, recent=page, sink=4)
            got = tiny(input_ids=ids, cache=c, use_cache=True).logits
            assert [pc.k_scale.dtype for pc in c.pool.layers] == [FP8_PARAM, torch.float16, torch.float16]
    finally:
        tiny.set_attn_implementation("sdpa")
    assert torch.allclose(sim, want, atol=1e-5), (sim - want).abs().max()
    assert torch.allclose(got, sim, atol=1e-5), (got - sim).abs().max()
    from oscar.kernels.window_attention import simulated

    with simulated(tiny, widths_artifacts(tiny.config, [[2, 2]] * 3, page)[1], proto):  # widths make a difference
        with torch.no_grad():
            flat = tiny(input_ids=ids, use_cache=False).logits
    assert (flat - sim).abs().max() > 1e-3


def test_native_layer_artifact_refuses_what_the_cache_cannot_store(tiny):
    from oscar.recipe.widths import native_layer_artifact

    codec, _ = widths_artifacts(tiny.config, [[2, 2], [2, 2], [2, 2]], 4)
    for widths, what in (([[2, 2], [3, 3], [2, 2]], "layer 1 .* \\(3, 3\\)"), ([[2, 2], [2, 2], [5, 2]], "layer 2")):
        bad = replace(codec, meta={**codec.meta, "codec": {**codec.meta["codec"], "widths": widths}})
        with pytest.raises(OscarError, match=what):
            native_layer_artifact(bad)
    with pytest.raises(OscarError, match="not per-layer widths"):
        native_layer_artifact(replace(codec, meta={k: v for k, v in codec.meta.items() if k != "codec"}))


def test_memory_accounting_refuses_a_validation_codec(tiny):
    """The accounting knows cache formats only: a "layers" codec artifact is refused naming the conversion, its
    native form is accounted (both read from the same widths)."""
    from oscar.kernels.memory import artifact_row

    codec, native = widths_artifacts(tiny.config, [[2, 2], [4, 2], [3, 2]], 4)
    with pytest.raises(OscarError, match="codec 'layers'.*native_layer_artifact"):
        artifact_row(codec, tiny.config)
    assert artifact_row(native, tiny.config)["bits_per_element"] > 2
