"""Split keys (`oscar fit --variant split`, stats/split.py): keys split 3/2 bits along the query eigenbasis,
each part against a brute-force reference, and their bits against the 2.5 budget through the memory accounting."""

import itertools
import math

import numpy as np
import pytest
import torch

from oscar.quant import FP8_PARAM, QuantSpec, fp8_round
from oscar.scoring import layer_formats as lf


def _orthogonal(D: int, seed: int) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((D, D)))
    return q


@pytest.mark.parametrize("D,n_hi", [(64, 16), (32, 8)])
def test_split_rotation_is_the_scaled_variant_per_part(D, n_hi):
    from oscar.stats.hadamard import bitrev_perm, hadamard, perm_matrix
    from oscar.stats.rotations import importance_scales
    from oscar.stats.split import split_scaled_rotation

    rng = np.random.default_rng(1)
    U = _orthogonal(D, 2)
    lam, sig2 = np.sort(rng.exponential(1.0, D))[::-1], rng.exponential(1.0, D)
    hi = rng.choice(D, n_hi, replace=False)
    rk, rq = split_scaled_rotation(U, lam, sig2, hi)
    assert np.allclose(rq.T @ rk, np.eye(D), atol=1e-10)  # (q R_Q)·(k R_K) = q·k
    # by hand: part 1 = the hi directions in U's order, part 2 = the rest, each U_p diag(d_p) H_p P_br
    for idx, cols in ((np.sort(hi), slice(0, n_hi)), (np.setdiff1d(np.arange(D), hi), slice(n_hi, D))):
        n = len(idx)
        d = importance_scales(lam[idx][None], sig2[idx][None])[0]
        M = hadamard(n) @ perm_matrix(bitrev_perm(n))
        assert np.allclose(rk[:, cols], (U[:, idx] * d) @ M, atol=1e-12)
        assert np.allclose(rq[:, cols], (U[:, idx] / d) @ M, atol=1e-12)
    # a key along a hi direction lands in the first part only
    k = U[:, hi[0]]
    assert np.abs((k @ rk)[n_hi:]).max() < 1e-12


def _brute_minmax(x: np.ndarray, bits: int, clip: float) -> np.ndarray:
    """One token's part by hand: range x clip, fp8 params rounded outward, round half up, clamp."""
    lo, hi = x.min() * clip, x.max() * clip
    zero = float(fp8_round(torch.tensor([lo], dtype=torch.float32), up=False).float())
    scale = float(fp8_round(torch.tensor([max((hi - zero) / (2**bits - 1), 1e-8)], dtype=torch.float32), up=True).float())
    codes = np.clip(np.floor((x - zero) / scale + 0.5), 0, 2**bits - 1)
    return codes * scale + zero


def test_split_fake_quant_matches_brute_force():
    from oscar.quant import QuantSpec
    from oscar.stats.split import split_fake_quant

    g = torch.Generator().manual_seed(3)
    B, H, T, D = 2, 3, 5, 16
    segs = [(0, 4, 3), (4, 16, 2)]
    parts = [(a, b, QuantSpec(bits=bits, param_dtype=FP8_PARAM)) for a, b, bits in segs]
    y = torch.randn(B, H, T, D, generator=g) * torch.linspace(3, 0.3, D)
    clip = torch.tensor([[0.9, 0.8], [1.0, 0.7], [0.85, 1.0]])
    got = split_fake_quant(y, parts, clip).double().numpy()
    yn = y.float().numpy()
    want = np.empty_like(got)
    for b, h, t in np.ndindex(B, H, T):
        for j, (a, e, bits) in enumerate(segs):
            want[b, h, t, a:e] = _brute_minmax(yn[b, h, t, a:e].astype(np.float64), bits, float(clip[h, j]))
    assert np.allclose(got, want, atol=1e-6)
    # 3 bits use 8 levels per part 1 token, 2 bits 4
    assert len(np.unique(got[0, 0, 0, :4])) <= 8 and len(np.unique(got[0, 0, 0, 4:])) <= 4


def test_split_bits_through_the_memory_accounting():
    """2.75 (keys: 16 x 3 + 48 x 2 codes + two fp8 scale/zero pairs) + 2.25 (values, fp8) = 2.5 at head_dim 64."""
    from oscar.pipeline.models import load_config
    from oscar.stats.artifact import QuantConfig, identity_artifact
    from oscar.validate.methods import METHOD_NOTES, bits_per_element, memory_row
    from oscar.scoring.protocols import SERVING

    config = load_config("smollm2-135m")
    base = identity_artifact(config, QuantConfig(bits=2), clip=1.0)
    D = base.head_dim
    from oscar.stats.rotations import get_variant

    q = get_variant("split").fmt(base.quant, D)
    assert (q.key_split, q.param_dtype) == (16, "float8_e4m3fn")
    assert [(a, b, sp.bits) for a, b, sp in q.key_parts(D)] == [(0, 16, 3), (16, 64, 2)]
    assert q.key_bits(D) == (48 + 96 + 32) / 64 == 2.75 and q.value_bits(D) == 2.25 and q.bits_per_element(D) == 2.5
    art = identity_artifact(config, q, clip=1.0)
    art.clip_k = [torch.ones(base.num_kv_heads, 2) for _ in range(base.num_layers)]
    art.validate()
    assert bits_per_element(art, D) == 2.5
    assert memory_row("oscar-int2", art, config, 4096, SERVING)["bits_per_element"] <= 2.5
    # the layer format: every layer's (key, value) widths counted, the budget filled by the DP
    widths = [[3, 2]] * 12 + [[2, 2]] * 18
    lay = lf.derived_artifact(base, "oscar-layer-copy-int2", {"kind": "layers", "widths": widths}, {})
    assert bits_per_element(lay, D) == pytest.approx((12 * 0.5 * (3.5 + 2.25) + 18 * 2.25) / 30) == 2.5
    assert memory_row("oscar-layer-copy-int2", lay, config, 4096, SERVING)["bits_per_element"] <= 2.5
    # the report's method note says the format the artifact stores, read from the artifact
    assert memory_row("oscar-int2", art, config, 4096, SERVING)["note"].endswith(
        "(split keys: 16 channels placed by C_Q at 3 bits, the rest at 2; values at 2 bits; 8-bit scale/zero)")
    assert memory_row("oscar-int2", lay, config, 4096, SERVING)["note"].endswith(
        "(the layers codebook format of oscar-layer-copy-int2)")
    from oscar.recipe.widths import native_layer_artifact, widths_artifact

    art_one = identity_artifact(config, QuantConfig(bits=2, param_dtype="float8_e4m3fn"), clip=1.0)
    wide = native_layer_artifact(widths_artifact(art_one, [[3, 2]] * 4 + [[4, 2]] + [[2, 2]] * 25))
    assert art_one.layer_quant is None and wide.layer_quant is not None
    assert memory_row("oscar-int2", wide, config, 4096, SERVING)["note"].endswith(
        "(per-layer key widths: 5 of 30 layers' keys at 3 or 4 bits, the rest at 2; values at 2 bits; 8-bit scale/zero "
        "(fp16 for the wider keys))")
    assert memory_row("kivi2", art, config, 4096, SERVING)["note"] == METHOD_NOTES["kivi2"]  # its format is its name


def test_split_format_is_refused_where_it_cannot_be_stored():
    from oscar.common import OscarError
    from oscar.constraints import format_problems
    from oscar.stats.artifact import QuantConfig

    assert format_problems(64, key_split=16) == []
    assert any("multiple of 8" in p for p in format_problems(64, key_split=12))
    assert any("Hadamard" in p for p in format_problems(64, key_split=8))  # 56 channels: no Hadamard of order 56
    with pytest.raises(OscarError, match="key_split"):
        QuantConfig(key_split=16, key_axis="channel", group_size=16)
    with pytest.raises(OscarError, match="key_split"):
        QuantConfig(key_split=16, clip_rule="row-quantile")


@pytest.fixture(scope="module")
def fitted(tiny_store):
    from oscar.stats.fit import FitConfig, fit

    art = fit(tiny_store, FitConfig(variant="scaled", progress=False, threads=1))
    art.meta["clip_tuning"] = {"chosen_factor": 1.2}
    return art


def test_fit_variant_split_is_the_native_format(fitted):
    """`oscar fit --variant split`: the split format, the placement record, per-part clips on the rows of the
    clip search, a valid artifact that survives save/load."""
    from oscar.stats.artifact import load_artifact, save_artifact
    from oscar.stats.fit import FitConfig, fit
    from oscar.stats.split import SPLIT_RULES

    store = fitted.meta["provenance"]["store"]
    art = fit(store, FitConfig(variant="split", progress=False, threads=1))
    D, H = art.head_dim, art.num_kv_heads
    assert art.quant.key_split == D // 4 and art.quant.param_dtype == "float8_e4m3fn"
    assert all(tuple(c.shape) == (H, 2) for c in art.clip_k) and all(tuple(c.shape) == (H,) for c in art.clip_v)
    assert all(m["split"]["rule"] in SPLIT_RULES for m in art.meta["layers"])
    assert all(((c > 0) & (c <= 1)).all() for c in art.clip_k)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        save_artifact(art, f"{d}/a.safetensors")
        back = load_artifact(f"{d}/a.safetensors")
    assert back.quant == art.quant and all(torch.equal(a, b) for a, b in zip(back.clip_k, art.clip_k))


@pytest.mark.parametrize("path", ["oracle", "production"])
@pytest.mark.parametrize("scheme", ["oscar_mix"])
def test_ablation_mix_codec_is_the_model_level_quantizer(path, scheme):
    """MixCodec (the synthetic ablation's oscar_mix) = split_fake_quant in its rotated space, bits from
    the stored fields."""
    from oscar.validate.ablation.schemes import Ctx, make_scheme

    g = torch.Generator().manual_seed(7)
    D = 32
    ctx = Ctx(path, 0)
    x = {n: (torch.randn(256, D, generator=g) * torch.linspace(2, 0.3, D)).to(ctx.dtype) for n in "qkv"}
    te = torch.randn(64, D, generator=g).to(ctx.dtype) * 2
    s = make_scheme(scheme, 2).fit(x, ctx)
    got, bk = s.k.roundtrip(te)
    y = (te - s.k.mu) @ s.k.R
    from oscar.stats.split import SPLIT_RULES, split_fake_quant

    want = split_fake_quant(y[None, None], s.k.parts, s.k.clip)[0, 0] @ s.k.Rinv + s.k.mu
    assert torch.allclose(got, want, atol=1e-4)
    assert bk == (8 * 3 + 24 * 2 + 32) / D
    assert s.v.roundtrip(te)[1] == 2 + 16 / D
    assert s.k.rule in SPLIT_RULES


def test_split_rotation_survives_a_negative_key_variance():
    """C_K - mu mu^T can come out negative along a direction (Qwen2.5's large key biases on a small store: -97);
    the part holding it must still get finite scales (it takes the head's floor), and positive values are untouched."""
    from oscar.stats.split import split_scaled_rotation

    rng = np.random.default_rng(3)
    D, n = 32, 8
    U = _orthogonal(D, 4)
    lam, sig2 = np.sort(rng.exponential(1.0, D))[::-1].copy(), rng.exponential(0.01, D)
    sig2[0] = -97.0  # in the wide part, whose own mean is then negative
    rk, rq = split_scaled_rotation(U, lam, sig2, np.arange(n))
    assert np.isfinite(rk).all() and np.isfinite(rq).all()
    assert np.allclose(rq.T @ rk, np.eye(D), atol=1e-10)
    # the same as handing it the head's floor by hand (the mean is negative here: the floor's own floor, 1e-33)
    fixed = sig2.copy()
    fixed[0] = 1e-33
    assert np.allclose(rk, split_scaled_rotation(U, lam, fixed, np.arange(n))[0])


def test_empty_reservoir_is_no_reservoir(tmp_path, synthetic_store):
    """A store whose reservoirs hold no rows: the one-group fit searches no clips (1.0, recorded as not searched)
    instead of picking its most aggressive candidate on nothing, and the split variant, which places its wide
    part on those rows, refuses with a clear error."""
    from oscar.common import OscarError
    from oscar.stats.fit import FitConfig, fit

    store = str(tmp_path / "s")
    synthetic_store.write_synthetic_store(store, synthetic_store.SynthSpec(num_layers=1, reservoir=0, k_mean=2.0))
    art = fit(store, FitConfig(variant="scaled", progress=False, threads=1))
    assert (art.clip_k[0] == 1).all() and art.meta["layers"][0]["clip"] == {"searched": False}
    with pytest.raises(OscarError, match="reservoir keys"):
        fit(store, FitConfig(variant="split", progress=False, threads=1))


def test_parts_rotation_leaves_the_not_stored_directions_unscaled():
    from oscar.stats.rotations import importance_scales, mixer
    from oscar.stats.split import parts_rotation

    D = 64
    rng = np.random.default_rng(0)
    U, _ = np.linalg.qr(rng.standard_normal((D, D)))
    lam, sig2 = np.sort(rng.exponential(1.0, D))[::-1], rng.exponential(1.0, D)
    order = rng.permutation(D)
    groups = [np.sort(order[:16]), np.sort(order[16:56]), np.sort(order[56:])]
    rk, rq = parts_rotation(U, lam, sig2, groups, stored=2)
    assert np.allclose(rq.T @ rk, np.eye(D), atol=1e-10)  # (q R_Q)·(k R_K) = q·k
    for idx, cols in zip(groups[:2], (slice(0, 16), slice(16, 56))):
        d = importance_scales(lam[idx][None], sig2[idx][None])[0]
        assert np.allclose(rk[:, cols], (U[:, idx] * d) @ mixer(len(idx)), atol=1e-12)
    assert np.allclose(rk[:, 56:], U[:, groups[2]]) and np.allclose(rq[:, 56:], U[:, groups[2]])
    with pytest.raises(AssertionError, match="partition"):
        parts_rotation(U, lam, sig2, groups[:2], stored=2)
