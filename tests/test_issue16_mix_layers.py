"""Issue 16's hypotheses 2, 4 and 5 (validate/codebooks.py): oscar-mix-int2 (keys split 3/2 bits along the query
eigenbasis), oscar-layer-int2 (widths per layer by calibrated error) and oscar-tier-int2 (4/2/0-bit tiers), each
against a brute-force reference, and their bits against the 2.5 budget through the memory accounting."""

import itertools
import math

import numpy as np
import pytest
import torch

from oscar.quant import FP8_PARAM, QuantSpec, fp8_round
from oscar.validate import codebooks as cb


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
    from oscar.validate.methods import SERVING, bits_per_element, memory_row

    config = load_config("smollm2-135m")
    base = identity_artifact(config, QuantConfig(bits=2), clip=1.0)
    D = base.head_dim
    q = cb.split_quant(base)
    assert (q.key_split, q.param_dtype) == (16, "float8_e4m3fn")
    assert [(a, b, sp.bits) for a, b, sp in q.key_parts(D)] == [(0, 16, 3), (16, 64, 2)]
    assert q.key_bits(D) == (48 + 96 + 32) / 64 == 2.75 and q.value_bits(D) == 2.25 and q.bits_per_element(D) == 2.5
    art = identity_artifact(config, q, clip=1.0)
    art.clip_k = [torch.ones(base.num_kv_heads, 2) for _ in range(base.num_layers)]
    art.validate()
    assert bits_per_element(art, D) == 2.5
    assert memory_row("oscar-int2", art, config, 4096, SERVING)["bits_per_element"] <= cb.BUDGET_BITS
    # the layer format: every layer's (key, value) widths counted, the budget filled by the DP
    widths = [[3, 2]] * 12 + [[2, 2]] * 18
    lay = cb._derived(base, "oscar-layer-int2", {"kind": "layers", "widths": widths}, {})
    assert bits_per_element(lay, D) == pytest.approx((12 * 0.5 * (3.5 + 2.25) + 18 * 2.25) / 30) == 2.5
    assert memory_row("oscar-layer-int2", lay, config, 4096, SERVING)["bits_per_element"] <= cb.BUDGET_BITS
    mixl = cb._derived(base, "oscar-mix-layer-int2", {"kind": "layers", "widths": [["mix", 2]] * 30}, {})
    assert bits_per_element(mixl, D) == 2.5


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


def test_layer_widths_is_the_brute_force_optimum():
    rng = np.random.default_rng(4)
    L, O = 5, 4
    costs = np.tile([2.25, 2.875, 3.375, 4.5], (L, 1))
    for trial in range(6):
        errs = np.sort(rng.exponential(1.0, (L, O)), axis=1)[:, ::-1].copy()  # wider = lower error
        budget = [2.25, 2.5, 2.7, 3.0, 3.6, 4.5][trial]
        got = cb.layer_widths(errs, costs, budget)
        best = min((c for c in itertools.product(range(O), repeat=L) if costs[0][list(c)].mean() <= budget + 1e-12),
                   key=lambda c: errs[np.arange(L), list(c)].sum())
        assert math.isclose(errs[np.arange(L), got].sum(), errs[np.arange(L), list(best)].sum(), rel_tol=1e-12)
        assert costs[0][got].mean() <= budget + 1e-12
    with pytest.raises(Exception, match="no width"):
        cb.layer_widths(errs, costs, 2.0)


# ----------------------------------------------------------------- on a real (tiny) calibration store


@pytest.fixture(scope="module")
def fitted(tiny_store):
    from oscar.stats.fit import FitConfig, fit

    art = fit(tiny_store, FitConfig(variant="scaled", progress=False, threads=1))
    art.meta["clip_tuning"] = {"chosen_factor": 1.2}
    return art


def test_mix_artifact_from_the_store(fitted):
    """Per layer: the placement is the better rule on the calibration rows, the rotation is split_scaled_rotation
    of the store's query eigenbasis, clips are the searched ones times the tune factor; the native split format
    (QuantConfig.key_split), which LayerQuant runs."""
    from oscar.pipeline.models import load_config
    from oscar.stats.reduce import LayerStats, ReduceConfig, open_store
    from oscar.stats.split import SPLIT_RULES, fit_split_keys, layer_inputs, split_fake_quant
    from oscar.validate.methods import LayerQuant, bits_per_element, method_artifact

    config = load_config("tiny-llama")
    art = method_artifact("oscar-mix-int2", config, fitted)
    D, H, l = art.head_dim, art.num_kv_heads, 1
    assert art.quant.key_split == D // 4 and not art.meta.get("codec")
    rec = art.meta["split"]["layers"][l]
    assert rec["placement"] in SPLIT_RULES and art.meta["split"]["tune_factor"] == 1.2
    ls = LayerStats(open_store(fitted.meta["provenance"]["store"]), l, ReduceConfig())
    mu = fitted.k_mean[l].double().numpy()
    U, lam, sig2 = layer_inputs(ls, mu)
    _, k, _ = cb._rows(ls, seed=l)
    sf = fit_split_keys(U, lam, sig2, k - torch.from_numpy(mu)[:, None, :], ls.cov("q"), art.quant.key_parts(D),
                        np.round(np.arange(0.5, 1.0001, 0.05), 4))
    assert sf.rule == rec["placement"] and sf.errs[sf.rule] == min(sf.errs.values())
    assert torch.allclose(art.rot_k[l], sf.rot_k.float()) and torch.allclose(art.rot_q[l], sf.rot_q.float())
    assert torch.allclose(art.clip_k[l], (sf.clip * 1.2).clamp(max=1.0))
    art.validate()  # rot_q = rot_k^{-T}, clip_k (H, 2)
    # LayerQuant = centre, rot_k, split_fake_quant, back by rot_qᵀ; values at fp8 params
    lq = LayerQuant(art, l)
    x = torch.randn(1, H, 32, D, generator=torch.Generator().manual_seed(5))
    m = art.k_mean[l][None, :, None, :]
    want = split_fake_quant((x - m) @ art.rot_k[l], art.quant.key_parts(D), art.clip_k[l]) @ art.rot_q[l].transpose(-1, -2) + m
    assert torch.allclose(lq.keys(x), want, atol=1e-5)
    assert bits_per_element(art, D) <= cb.oscar_bits(fitted)
    assert np.allclose(rec["err_k"], sf.err, atol=1e-6)


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


def test_fit_variant_tiers_is_the_native_format(fitted):
    """`oscar fit --variant tiers`: split keys with key_top 2 and key_drop D/8 (2.5 bits at D = 64 by the memory
    accounting), per-part clips, the rotation of `fit_split_keys` with the tier parts; the not-stored directions
    are unscaled query eigenvectors; survives save/load; the simulator reads them as the key mean."""
    from oscar.stats.artifact import load_artifact, save_artifact
    from oscar.stats.fit import FitConfig, fit
    from oscar.validate.methods import LayerQuant, bits_per_element

    store = fitted.meta["provenance"]["store"]
    art = fit(store, FitConfig(variant="tiers", progress=False, threads=1))
    D, H = art.head_dim, art.num_kv_heads
    q = art.quant
    assert (q.key_split, q.key_top, q.key_drop, q.param_dtype) == (D // 4, 2, D // 8, "float8_e4m3fn")
    assert [(a, b, sp.bits) for a, b, sp in q.key_parts(D)] == [(0, D // 4, 4), (D // 4, D - D // 8, 2)]
    assert bits_per_element(art, D) == q.bits_per_element(D) == 0.5 * ((4 * D // 4 + 2 * (D - D // 4 - D // 8) + 32) / D
                                                                        + 2 + 16 / D)
    assert all(tuple(c.shape) == (H, 2) for c in art.clip_k)
    assert art.meta["layers"][0]["split"]["rule"] in ("lambda", "lambda*sigma2")
    nd = art.rot_k[0][:, :, D - D // 8:]  # (H, D, D/8): orthonormal columns, the same in rot_q
    assert torch.allclose(nd.transpose(-1, -2) @ nd, torch.eye(D // 8).expand(H, -1, -1), atol=1e-5)
    assert torch.allclose(art.rot_q[0][:, :, D - D // 8:], nd, atol=1e-6)
    x = torch.randn(1, H, 16, D, generator=torch.Generator().manual_seed(3))
    lq = LayerQuant(art, 0)
    x2 = x + torch.randn(1, H, 16, D // 8, generator=torch.Generator().manual_seed(4)) @ nd.transpose(-1, -2)
    assert torch.allclose(lq.keys(x2), lq.keys(x), atol=1e-4)  # a move along the dropped directions is not stored
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        save_artifact(art, f"{d}/a.safetensors")
        back = load_artifact(f"{d}/a.safetensors")
    assert back.quant == art.quant


@pytest.mark.parametrize("name", ["oscar-layer-int2", "oscar-mix-layer-int2", "oscar-layer-top1-int2",
                                  "oscar-mix-layer-top1-int2"])
def test_layer_artifact_from_the_store(fitted, name):
    """The widths are layer_widths of the recorded error table at oscar-int2's bits; LayerQuant uses each layer's
    format (oscar-mix-layer-int2: a "mix" layer is oscar-mix-int2's layer: rotation, clips, split keys)."""
    from oscar.pipeline.models import load_config
    from oscar.quant import fake_quant
    from oscar.stats.split import split_fake_quant
    from oscar.validate.methods import LayerQuant, bits_per_element, method_artifact

    config = load_config("tiny-llama")
    art = method_artifact(name, config, fitted)
    c, D = art.meta["codec"], art.head_dim
    opts = [tuple(o) for o in c["options"]]
    assert (("mix", 2) in opts) == ("mix" in name)
    errs = np.array(c["err"])
    kbits = lambda kb: (cb.split_quant(fitted).key_bits(D) if kb == "mix"  # noqa: E731
                        else cb._layer_spec(fitted, kb).bits_per_element(D))
    costs = np.array([[0.5 * (kbits(kb) + cb._layer_spec(fitted, vb).bits_per_element(D))
                       for kb, vb in opts]] * art.num_layers)
    tops = np.array(c["top1_changed"])
    obj = errs if "top1" not in name else tops + errs / (errs.max() + 1) / c["top1_rows"]
    assert c["chosen_by"] == ("top1" if "top1" in name else "output")
    assert [list(opts[o]) for o in cb.layer_widths(obj, costs, cb.oscar_bits(fitted))] == c["widths"]
    assert bits_per_element(art, D) <= cb.oscar_bits(fitted) + 1e-12
    total, base = ("top1_total", "top1_total_base") if "top1" in name else ("err_total", "err_total_base")
    assert c[total] <= c[base]  # never worse than every layer at the base width, by the objective chosen
    # wider options have lower calibrated error than the base, on every layer (the table is not noise)
    assert (errs[:, -1] < errs[:, 0]).all()
    x = torch.randn(1, art.num_kv_heads, 16, D, generator=torch.Generator().manual_seed(6))
    mix = method_artifact("oscar-mix-int2", config, fitted) if "mix" in name else None
    for l, (kb, vb) in enumerate(c["widths"]):
        lq = LayerQuant(art, l)
        m = art.k_mean[l][None, :, None, :]
        if kb == "mix":
            assert torch.equal(art.rot_k[l], mix.rot_k[l]) and torch.equal(art.clip_k[l], mix.clip_k[l])
            yq = split_fake_quant((x - m) @ art.rot_k[l], cb.split_parts(art), art.clip_k[l])
        else:
            assert torch.equal(art.rot_k[l], fitted.rot_k[l])
            yq = fake_quant((x - m) @ art.rot_k[l], cb._layer_spec(fitted, kb), art.clip_k[l].view(-1, 1, 1))
            if kb != fitted.quant.bits:
                assert (art.clip_k[l] == 1).all()
        assert torch.allclose(lq.keys(x), yq @ art.rot_q[l].transpose(-1, -2) + m, atol=1e-5)
        vq = fake_quant(x @ art.rot_v[l], cb._layer_spec(fitted, vb), art.clip_v[l].view(-1, 1, 1)) @ art.rot_v[l].transpose(-1, -2)
        assert torch.allclose(lq.values(x), vq, atol=1e-5)


def test_top1_changed_is_the_brute_force_count(fitted):
    """The top-1 table of layer_artifact: per option, the share of (head, query row) whose argmax key over the
    reservoir rows moves when the keys are quantized, counted by a plain loop in the model's own basis."""
    from oscar.quant import fake_quant

    c = cb.layer_artifact(fitted, objective="top1").meta["codec"]
    _, _, layers = cb.store_layers(fitted, "test")
    D = fitted.head_dim
    for l in (0, fitted.num_layers - 1):
        q, k, _ = cb._rows(layers[l], seed=l)  # (H, Nq, D), (H, N, D): the table's rows
        mu = fitted.k_mean[l].double()[:, None, :]
        for o, (kb, _) in enumerate(cb.LAYER_OPTIONS):
            R = fitted.rot_k[l].double()
            clip = fitted.clip_k[l].float().view(-1, 1, 1) if kb == fitted.quant.bits else 1.0
            kr = fake_quant(((k - mu) @ R).float(), cb._layer_spec(fitted, kb), clip).double()
            k_hat = kr @ torch.linalg.inv(R) + mu  # back in the model's basis
            moved = n = 0
            for h in range(q.shape[0]):
                for i in range(q.shape[1]):
                    moved += int(torch.argmax(k[h] @ q[h, i]) != torch.argmax(k_hat[h] @ q[h, i]))
                    n += 1
            assert c["top1_rows"] == n
            assert math.isclose(c["top1_changed"][l][o], moved / n, abs_tol=1e-6), (l, o)
    assert max(max(r) for r in c["top1_changed"]) > 0  # the table is not all zeros on this store


@pytest.mark.parametrize("path", ["oracle", "production"])
@pytest.mark.parametrize("scheme", ["oscar_mix", "oscar_tier"])
def test_ablation_mix_codec_is_the_model_level_quantizer(path, scheme):
    """MixCodec (the synthetic ablation's oscar_mix / oscar_tier) = split_fake_quant in its rotated space, bits from
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
    if scheme == "oscar_mix":
        assert bk == (8 * 3 + 24 * 2 + 32) / D
    else:  # 8 x 4 + 20 x 2, the last 4 channels not stored
        assert [(a, b, sp.bits) for a, b, sp in s.k.parts] == [(0, 8, 4), (8, 28, 2)] and bk == (8 * 4 + 20 * 2 + 32) / D
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


# ----------------------------------------------------------------- hypothesis 5: tiers (oscar-tier-int2)


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


def _tiers(D: int, variant: str = "tiers"):
    from oscar.stats.artifact import QuantConfig
    from oscar.stats.rotations import get_variant

    return get_variant(variant).fmt(QuantConfig(), D)


def test_tier_fake_quant_matches_brute_force():
    """Parts quantized per token on their own (the split quantizer); the channels after the last part read as 0."""
    from oscar.stats.split import split_fake_quant

    g = torch.Generator().manual_seed(3)
    B, H, T, D = 2, 3, 5, 32
    parts = _tiers(D).key_parts(D)
    segs = [(a, b, sp.bits) for a, b, sp in parts]
    assert segs == [(0, 8, 4), (8, 28, 2)] and all(sp.param_dtype == FP8_PARAM for _, _, sp in parts)
    y = torch.randn(B, H, T, D, generator=g) * torch.linspace(3, 0.3, D)
    clip = torch.tensor([[0.9, 0.8], [1.0, 0.7], [0.85, 1.0]])
    got = split_fake_quant(y, parts, clip).double().numpy()
    yn = y.numpy().astype(np.float64)
    want = np.zeros_like(got)
    for b, h, t in np.ndindex(B, H, T):
        for j, (a, e, bits) in enumerate(segs):
            want[b, h, t, a:e] = _brute_minmax(yn[b, h, t, a:e], bits, float(clip[h, j]))
    assert np.allclose(got, want, atol=1e-6)
    assert (got[..., 28:] == 0).all() and len(np.unique(got[0, 0, 0, :8])) <= 16


def test_tier_bits_through_the_memory_accounting():
    """Keys 16 x 4 + 40 x 2 codes + two fp8 pairs = 2.75 (the 8 not-stored channels cost nothing), values 2.25: 2.5."""
    from oscar.kernels.memory import report
    from oscar.pipeline.models import load_config
    from oscar.stats.artifact import identity_artifact
    from oscar.validate.methods import SERVING, bits_per_element, memory_row

    config = load_config("smollm2-135m")
    q = _tiers(64)
    art = identity_artifact(config, q, clip=1.0)
    art.clip_k = [torch.ones(art.num_kv_heads, 2) for _ in range(art.num_layers)]
    art.validate()
    assert (q.key_split, q.key_top, q.key_drop) == (16, 2, 8)
    assert q.key_bits(64) == (64 + 80 + 32) / 64 == 2.75 and q.value_bits(64) == 2.25
    assert bits_per_element(art, 64) == 2.5
    assert memory_row("oscar-int2", art, config, 4096, SERVING)["bits_per_element"] <= cb.BUDGET_BITS
    row = next(r for r in report(config, 4096)["rows"] if r["format"] == "int2-tiers-fp8")
    assert (row["key_split"], row["key_drop"]) == (16, 8) and row["bits_per_element"] == 2.5


def test_tier_drop_refuses_a_head_dim_it_cannot_cut():
    from oscar.common import OscarError
    from oscar.stats.artifact import tier_drop

    assert [(a, b, sp.bits) for a, b, sp in _tiers(128).key_parts(128)] == [(0, 32, 4), (32, 112, 2)]
    assert [(a, b, sp.bits) for a, b, sp in _tiers(16).key_parts(16)] == [(0, 8, 4), (8, 12, 2)]
    # the fewest dropped channels (a multiple of 4, >= half the wide part) that leave a Hadamard order in the middle
    assert [tier_drop(D) for D in (16, 32, 48, 64, 80, 128)] == [4, 4, 8, 8, 16, 16]
    for D in (16, 32, 48, 64, 80, 128):  # never over split keys' budget
        assert _tiers(D).key_bits(D) <= _tiers(D, "split").key_bits(D)
    with pytest.raises(OscarError, match="head_dim 12"):
        tier_drop(12)


def test_tier_artifact_from_the_store(fitted):
    """Per layer the rotation and clips are fit_split_keys' with the tier parts (the better rule on the calibration
    rows), clips x the tune factor; LayerQuant reads the not-stored directions as the key mean, so a key moved
    along them alone dequantizes to the same k̂ and leaves every logit of a query shifted alike."""
    from oscar.common import OscarError
    from oscar.pipeline.models import load_config
    from oscar.stats.reduce import LayerStats, ReduceConfig, open_store
    from oscar.stats.split import fit_split_keys, layer_inputs
    from oscar.validate.methods import LayerQuant, bits_per_element, method_artifact

    config = load_config("tiny-llama")
    art = method_artifact("oscar-tier-int2", config, fitted)
    D, H, l = art.head_dim, art.num_kv_heads, 1
    q, c = art.quant, art.meta["split"]
    assert (q.key_top, q.key_drop, c["tune_factor"]) == (2, D // 8, 1.2) and not art.meta.get("codec")
    ls = LayerStats(open_store(fitted.meta["provenance"]["store"]), l, ReduceConfig())
    mu = fitted.k_mean[l].double().numpy()
    U, lam, sig2 = layer_inputs(ls, mu)
    _, k, _ = cb._rows(ls, seed=l)
    parts = q.key_parts(D)
    assert [(a, b, sp.bits) for a, b, sp in parts] == [(0, D // 4, 4), (D // 4, D - D // 8, 2)]
    sf = fit_split_keys(U, lam, sig2, k - torch.from_numpy(mu)[:, None, :], ls.cov("q"), parts,
                        np.round(np.arange(0.5, 1.0001, 0.05), 4))
    assert sf.rule == c["layers"][l]["placement"]
    assert torch.allclose(art.rot_k[l], sf.rot_k.float()) and torch.allclose(art.clip_k[l], (sf.clip * 1.2).clamp(max=1.0))
    lq = LayerQuant(art, l)
    x = torch.randn(1, H, 16, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64).float()
    kh = lq.keys(x)
    m = art.k_mean[l][None, :, None, :]
    assert torch.allclose(((kh - m) @ art.rot_k[l])[..., D - D // 8:], torch.zeros(()), atol=1e-5)
    nd = art.rot_q[l][:, :, D - D // 8:]  # (H, D, D/8): R_Q's columns = the not-stored directions (unscaled U)
    x2 = x + (torch.randn(1, H, 16, D // 8, generator=torch.Generator().manual_seed(6)) @ nd.transpose(-1, -2))
    assert torch.allclose(lq.keys(x2), kh, atol=1e-4)
    assert bits_per_element(art, D) <= cb.oscar_bits(fitted)
    split = method_artifact("oscar-mix-int2", config, fitted)
    with pytest.raises(OscarError, match="oscar-tier-int2"):
        cb.tier_artifact(split)


def test_unclip_artifact_switches_off_the_key_clip_in_the_wide_layers_only(fitted, tmp_path):
    """bench/issue16_unclip.py (the clip confound of per-layer widths): key clip 1 exactly where the widths file
    widens keys; rotations, value clips and the other layers' key clips as they were; a widths file of another
    layer count is refused."""
    import importlib.util
    import json
    from pathlib import Path

    from oscar.stats.artifact import load_artifact, save_artifact

    spec = importlib.util.spec_from_file_location("_unclip", Path(__file__).parents[1] / "bench" / "issue16_unclip.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src, out, w = tmp_path / "a.safetensors", tmp_path / "u.safetensors", tmp_path / "w.json"
    save_artifact(fitted, str(src))
    base = load_artifact(str(src))
    L, b = base.num_layers, base.quant.bits
    wide = [L - 1]
    widths = [[b + 1 if l in wide else b, b] for l in range(L)]
    w.write_text(json.dumps({"oscar-layer-int2": {"widths": widths}}))
    assert mod.main(["--artifact", str(src), "--widths", str(w), "--out", str(out)]) == 0
    got = load_artifact(str(out))
    assert got.meta["unclipped_key_layers"] == wide
    for l in range(L):
        want = torch.ones_like(base.clip_k[l]) if l in wide else base.clip_k[l]
        assert torch.equal(got.clip_k[l], want)
        assert torch.equal(got.clip_v[l], base.clip_v[l]) and torch.equal(got.rot_k[l], base.rot_k[l])
    assert any(not torch.equal(base.clip_k[l], torch.ones_like(base.clip_k[l])) for l in wide)  # the test can fail
    w.write_text(json.dumps({"oscar-layer-int2": {"widths": widths[:-1]}}))
    with pytest.raises(SystemExit, match="layers"):
        mod.main(["--artifact", str(src), "--widths", str(w), "--out", str(out)])


def test_widths_artifact_is_layer_artifacts_format(fitted):
    """widths_artifact (the per-layer probes of a measured objective) builds exactly the format layer_artifact
    chose for the same widths: the codec, clips and rotations; bad widths are refused by name."""
    from oscar.common import OscarError

    la = cb.layer_artifact(fitted)
    w = cb.widths_artifact(fitted, la.meta["codec"]["widths"])
    assert w.meta["codec"]["widths"] == la.meta["codec"]["widths"] and w.meta["codec"]["kind"] == "layers"
    for l in range(fitted.num_layers):
        assert torch.equal(w.clip_k[l], la.clip_k[l]) and torch.equal(w.clip_v[l], la.clip_v[l])
        assert torch.equal(w.rot_k[l], la.rot_k[l])
    with pytest.raises(OscarError, match="widths must give"):
        cb.widths_artifact(fitted, [[2, 2]] * (fitted.num_layers - 1))
    with pytest.raises(OscarError, match="widths must give"):
        cb.widths_artifact(fitted, [[1, 2]] + [[2, 2]] * (fitted.num_layers - 1))


def test_copy_objective_widths_are_the_dp_of_the_given_table(fitted):
    """objective="copy": the widths are layer_widths of the measured table (not of the reservoir rows'); with
    one layer's probe far better than the rest, that layer is widened; the table must match the options."""
    from oscar.common import OscarError

    opts = ((2, 2), (3, 2), (4, 2))
    L, D = fitted.num_layers, fitted.head_dim
    err = np.zeros((L, 3))
    err[:, 1:] = 0.01  # widening hurts everywhere ...
    err[L - 1] = [0.0, -0.5, -0.9]  # ... except in the last layer
    c = cb.layer_artifact(fitted, opts, "oscar-layer-copy-int2", objective="copy", copy_err=err).meta["codec"]
    costs = np.array([[0.5 * (cb._layer_spec(fitted, kb).bits_per_element(D) + cb._layer_spec(fitted, vb).bits_per_element(D))
                       for kb, vb in opts]] * L)
    assert c["widths"] == [list(opts[o]) for o in cb.layer_widths(err, costs, cb.oscar_bits(fitted))]
    assert c["widths"][L - 1] == [4, 2] and all(w == [2, 2] for w in c["widths"][:-1]) and c["chosen_by"] == "copy"
    assert c["copy_err"] == err.round(6).tolist()
    with pytest.raises(OscarError, match="copy_err must be"):
        cb.layer_artifact(fitted, opts, objective="copy", copy_err=err[:, :2])
    with pytest.raises(OscarError, match="given with objective='copy' only"):
        cb.layer_artifact(fitted, opts, copy_err=err)


@pytest.mark.slow
def test_layer_copy_errors_against_plain_probes(fitted, tmp_path):
    """Each entry is (copied-span NLL with that layer alone widened) - (all at the base), recomputed here with the
    layer's format set by hand and full-logit cross-entropy; the probe log resumes and refuses another config."""
    import json
    from dataclasses import replace

    import torch.nn.functional as F

    from oscar.common import OscarError
    from oscar.validate.env import load_model
    from oscar.validate.methods import PROTOCOLS
    from oscar.validate.ppl import simulated
    from oscar.validate.tune import TuneConfig, calibration_ids, copy_windows, layer_copy_errors

    model, tok, _ = load_model("tiny-llama")
    opts = ((2, 2), (3, 2), (4, 2))
    cfg = TuneConfig(copy_windows=2, copy_length=512, copy_span=16)
    log = str(tmp_path / "probes.jsonl")
    err = layer_copy_errors(model, tok, fitted, opts, cfg, log=log, progress=False)
    L = fitted.num_layers
    assert err.shape == (L, 3) and (err[:, 0] == 0).all() and np.abs(err[:, 1:]).max() > 0
    sv = PROTOCOLS["serving"]
    wins = copy_windows(calibration_ids(tok, "pydoc", 2 * 496), 2, 512, 16, sv.sink, sv.recent)

    def nll(widths):  # the codec and clips written out, not through widths_artifact
        a = replace(fitted, meta={**fitted.meta, "codec": {"kind": "layers", "widths": widths}},
                    clip_k=[fitted.clip_k[l] if widths[l][0] == 2 else torch.ones_like(fitted.clip_k[l]) for l in range(L)])
        s = n = 0
        for win, pos, _ in wins:
            with simulated(model, a, sv), torch.no_grad():
                logits = model(input_ids=win, use_cache=False).logits.float()[0]  # (T, V)
            s += F.cross_entropy(logits[pos], win[0, pos + 1], reduction="sum").item()
            n += len(pos)
        return s / n

    base = nll([[2, 2]] * L)
    for l, o in ((0, 2), (L - 1, 1)):
        w = [[2, 2]] * L
        w[l] = list(opts[o])
        assert math.isclose(err[l, o], nll(w) - base, rel_tol=1e-4, abs_tol=1e-6), (l, o)
    lines = open(log).read().splitlines()
    assert len(lines) == 1 + 2 * L
    open(log, "w").write("\n".join(lines[:-1]) + "\n")  # interrupted before the last probe
    assert np.array_equal(layer_copy_errors(model, tok, fitted, opts, cfg, log=log, progress=False), err)
    assert len(open(log).read().splitlines()) == 1 + 2 * L
    with pytest.raises(OscarError, match="another artifact, options or copy config"):
        layer_copy_errors(model, tok, fitted, opts, replace(cfg, copy_span=24), log=log, progress=False)
    assert json.loads(lines[0])["layer"] == -1
    with pytest.raises(OscarError, match=r"options\[0\] must be the artifact's own width 2"):
        layer_copy_errors(model, tok, fitted, ((3, 3), (4, 4)), cfg, log=str(tmp_path / "other.jsonl"), progress=False)
    assert not (tmp_path / "other.jsonl").exists()


def test_layer_copy_gradients_resume_window_by_window(fitted, tmp_path):
    """The first-order estimate logs each window's sums as it finishes: a rerun after an interruption computes only
    the missing windows and returns exactly the uninterrupted table; a log read for its windows is trusted (an
    edited window changes the table by exactly its edit); a probe log or another config's log is refused. Per KV
    head (heads=True), the shares sum to the layer's entry."""
    import json
    from dataclasses import replace

    from oscar.common import OscarError
    from oscar.validate.env import load_model
    from oscar.validate.tune import TuneConfig, _copy_ident, layer_copy_gradients

    model, tok, _ = load_model("tiny-llama")
    opts = ((2, 2), (3, 2), (4, 2))
    cfg = TuneConfig(copy_windows=2, copy_length=512, copy_span=16)
    log = tmp_path / "gradients.jsonl"
    est = layer_copy_gradients(model, tok, fitted, opts, cfg, log=str(log), progress=False)
    assert np.array_equal(est, layer_copy_gradients(model, tok, fitted, opts, cfg, progress=False))
    lines = log.read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    assert [r["window"] for r in recs] == [0, 1] and np.abs(np.asarray(recs[1]["sums"])).max() > 0
    log.write_text(lines[0] + "\n")  # interrupted after the first window
    assert np.array_equal(layer_copy_gradients(model, tok, fitted, opts, cfg, log=str(log), progress=False), est)
    assert log.read_text().splitlines() == lines
    edited = {**recs[0], "sums": (2 * np.asarray(recs[0]["sums"])).tolist()}
    log.write_text(json.dumps(edited) + "\n" + lines[1] + "\n")
    n = recs[0]["tokens"] + recs[1]["tokens"]
    again = layer_copy_gradients(model, tok, fitted, opts, cfg, log=str(log), progress=False)
    assert np.allclose(again, est + np.asarray(recs[0]["sums"]).sum(1) / n, rtol=1e-12, atol=0)
    assert not np.allclose(again, est)
    per_head = layer_copy_gradients(model, tok, fitted, opts, cfg, log=str(log), progress=False, heads=True)
    assert per_head.shape == (fitted.num_layers, fitted.num_kv_heads, 3) and np.allclose(per_head.sum(1), again)
    with pytest.raises(OscarError, match="another artifact, options or copy config"):
        layer_copy_gradients(model, tok, fitted, opts, replace(cfg, copy_span=24), log=str(log), progress=False)
    probe = tmp_path / "probes.jsonl"  # what layer_copy_errors writes for the same artifact, options and config
    probe.write_text(json.dumps({"layer": -1, "option": 0, "nll": 1.0, "ident": _copy_ident(fitted, opts, cfg)}) + "\n")
    with pytest.raises(OscarError, match="another artifact, options or copy config"):
        layer_copy_gradients(model, tok, fitted, opts, cfg, log=str(probe), progress=False)


def test_channel_key_baseline_of_per_layer_widths_is_the_fits(fitted):
    """oscar-kc-int2 next to a per-layer artifact is the same baseline as next to the fit it was widened from (the
    `scaled` recipe, keys per channel, fp16 scale/zero: 2.5 bits), not the per-layer base grid's e4m3 (2.25)."""
    from oscar.validate.codebooks import COPY_OPTIONS, layer_artifact, native_layer_artifact
    from oscar.validate.methods import bits_per_element, channel_keys_artifact

    L = fitted.num_layers
    err = np.zeros((L, 3))
    err[0, 2] = -1.0
    native = native_layer_artifact(layer_artifact(fitted, COPY_OPTIONS, objective="copy", copy_err=err))
    assert native.layer_quant is not None and native.quant.param_dtype == "float8_e4m3fn"
    a, b = channel_keys_artifact(fitted), channel_keys_artifact(native)
    assert a.quant == b.quant and a.quant.param_dtype == "float16" and a.quant.key_axis == "channel"
    assert b.meta["variant"] == "scaled" and b.layer_quant is None
    assert bits_per_element(b, b.head_dim) == bits_per_element(a, a.head_dim)


def test_simulator_follows_the_model_device(fitted):
    """LayerQuant moves every tensor it reads to the K/V's device on first use (a model on a GPU: the widths stage
    runs the simulator where the tune put the model); checked on the meta device, where any tensor left on the CPU
    makes the matmul or the codec fail."""
    from oscar.validate.codebooks import native_layer_artifact, widths_artifact
    from oscar.validate.methods import LayerQuant

    L, H, D = fitted.num_layers, fitted.num_kv_heads, fitted.head_dim
    widths = [[2, 2]] * (L - 1) + [[4, 2]]
    for i, art in enumerate((fitted, widths_artifact(fitted, widths), native_layer_artifact(widths_artifact(fitted, widths)))):
        lq = LayerQuant(art, L - 1)
        x = torch.randn(1, H, 32, D)
        assert lq.keys(x).device.type == "cpu" and lq.device.type == "cpu"  # the CPU first: nothing moves
        if i == 0:  # fp16 parameters (e4m3's range check reads values, which the meta device has not)
            k, v = lq.keys(x.to("meta")), lq.values(x.to("meta"))
            assert k.device.type == v.device.type == "meta" and k.shape == v.shape == x.shape
        else:
            lq._on(torch.device("meta"))
        ts = [t for t in vars(lq).values() if isinstance(t, torch.Tensor)]
        ts += [t for c in (lq.codec_k, lq.codec_v) if c is not None for t in vars(c).values() if isinstance(t, torch.Tensor)]
        assert len(ts) >= 5 and all(t.device.type == "meta" for t in ts) and lq.device.type == "meta"


@pytest.mark.parametrize("T,sink,recent", [(200, 16, 32), (701, 64, 256), (333, 64, 256)])
def test_gradient_attention_is_the_simulator_and_its_derivative(fitted, T, sink, recent):
    """The estimate's autograd attention (validate.tune._grad_attention) computes the simulator's attention
    (validate.ppl.sim_attention: exact / INT2 per (query, key) by the fresh mask, pages of 16), and the gradient it
    gives the INT2 error leaves (keys, values) is the directional derivative of a loss on its output: central
    differences of the simulator with the stored keys (values) moved along a random direction (pages and windows not aligned; at T = 333 no
    query reads a stored key yet, so both are 0)."""
    from types import SimpleNamespace

    from oscar.validate import ppl, tune
    from oscar.validate.methods import LayerQuant, Protocol

    L, Hkv, D = fitted.num_layers, fitted.num_kv_heads, fitted.head_dim
    Hq = 2 * Hkv
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, h, T, D, generator=g) for h in (Hq, Hkv, Hkv))  # (B, H, T, D)
    lq, p = LayerQuant(fitted, 1), Protocol("t", sink=sink, recent=recent)
    mod = SimpleNamespace(layer_idx=1)
    tune._GRAD.update(quant=[None, lq], protocol=p, deltas=[None] * L, keys=[None] * L, vdeltas=[None] * L, values=[None] * L)
    ppl._SIM.update(quant=[None, lq], protocol=p)
    try:
        out = tune._grad_attention(mod, q, k, v)[0]  # (B, T, Hq, D)
        torch.testing.assert_close(out, ppl.sim_attention(mod, q, k, v)[0], atol=2e-5, rtol=1e-4)
        R = torch.randn(out.shape, generator=g)
        (out * R).sum().backward()
        reads = T - 1 - recent > sink + lq.key_group  # some query reads a stored key (or value)
        for side in ("keys", "values"):
            delta = tune._GRAD["deltas" if side == "keys" else "vdeltas"][1]  # (1, Hkv, n, D)
            d = torch.randn(delta.shape, generator=g)

            class Moved:  # the stored keys (or values) moved by t d
                key_group, quantized_until = lq.key_group, lq.quantized_until

                def __init__(self, t):
                    self.t = t

                def keys(self, x):
                    return lq.keys(x) + (self.t * d if side == "keys" else 0)

                def values(self, x):
                    return lq.values(x) + (self.t * d if side == "values" else 0)

            def f(t):
                ppl._SIM["quant"] = [None, Moved(t)]
                return float((ppl.sim_attention(mod, q, k, v)[0].double() * R).sum())

            eps = 1e-2
            fd = (f(eps) - f(-eps)) / (2 * eps)
            assert delta.shape[2] > 0 and (abs(fd) > 1.0) == reads, side
            assert math.isclose(float((delta.grad * d).sum()), fd, rel_tol=1e-2, abs_tol=0 if reads else 1e-9), side
    finally:
        tune._GRAD.update(quant=None, protocol=None, deltas=None, keys=None, vdeltas=None, values=None)
        ppl._SIM.update(quant=None, protocol=None)


QK_SHARPEN = 8.0


@pytest.mark.slow
def test_layer_copy_gradients_are_the_directional_derivative(fitted):
    """Entry (l, o) of the first-order estimate is d/dt of the copied-span NLL per token with layer l's stored keys
    at Q_0(k) + t (Q_o(k) - Q_0(k)), t = 0: here a central difference through the production simulator (its
    banded / flash attention, not the estimate's autograd one); `copy_widths_artifact` takes the DP of the table."""
    import torch.nn.functional as F

    from oscar.common import OscarError
    from oscar.validate.codebooks import COPY_OPTIONS, layer_artifact, widths_artifact
    from oscar.validate.env import load_model
    from oscar.validate.methods import PROTOCOLS, LayerQuant
    from oscar.validate.ppl import simulated
    from oscar.validate.tune import (TuneConfig, calibration_ids, copy_widths_artifact, copy_windows,
                                     layer_copy_gradients)

    model, tok, _ = load_model("tiny-llama")
    with torch.no_grad():  # sharper attention than the random init's, so the NLL reads the stored keys
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_SHARPEN)
    cfg = TuneConfig(copy_windows=2, copy_length=512, copy_span=16)
    est = layer_copy_gradients(model, tok, fitted, COPY_OPTIONS, cfg, progress=False)
    L, sv = fitted.num_layers, PROTOCOLS["serving"]
    assert est.shape == (L, 3) and (est[:, 0] == 0).all() and np.abs(est[:, 1:]).max() > 0
    wins = copy_windows(calibration_ids(tok, "pydoc", 2 * 496), 2, 512, 16, sv.sink, sv.recent)
    q = [[LayerQuant(widths_artifact(fitted, [list(o)] * L), l) for l in range(L)] for o in COPY_OPTIONS]

    class Between:  # layer l's keys (or one KV head's) a fraction t of the way from the base width to option o
        def __init__(self, lq0, lqo, t, head=None):
            self.lq0, self.lqo, self.t, self.head, self.key_group = lq0, lqo, t, head, lq0.key_group

        def keys(self, k):
            k0 = self.lq0.keys(k)
            d = self.lqo.keys(k) - k0  # (B, Hkv, T, D)
            if self.head is not None:
                d = d * (torch.arange(d.shape[1]) == self.head).view(1, -1, 1, 1)
            return k0 + self.t * d

        def values(self, v):
            v0 = self.lq0.values(v)
            return v0 + self.t * (self.lqo.values(v) - v0)  # the options here that widen keys leave values as they are

        def quantized_until(self, T, sink, recent):
            return self.lq0.quantized_until(T, sink, recent)

    def nll(l, o, t, head=None, quants=q):
        sim = simulated(model, widths_artifact(fitted, [[2, 2]] * L), sv)
        sim.quant[l] = Between(quants[0][l], quants[o][l], t, head)
        s = n = 0
        with sim, torch.no_grad():
            for win, pos, _ in wins:
                logits = model(input_ids=win, use_cache=False).logits.float()[0]  # (T, V)
                s += F.cross_entropy(logits[pos], win[0, pos + 1], reduction="sum").item()
                n += len(pos)
        return s / n

    eps = 0.05
    for l, o in ((0, 2), (L - 1, 1), (L // 2, 2)):
        fd = (nll(l, o, eps) - nll(l, o, -eps)) / (2 * eps)
        # |est| ~ 1e-4 per token here; later layers' rounding steps (the estimate passes them straight through, the
        # difference sees them) and float32 rounding of the difference: measured within 11 %, allowed 20 %
        assert math.isclose(est[l, o], fd, rel_tol=0.2, abs_tol=2e-6), (l, o, est[l, o], fd)
    per_head = layer_copy_gradients(model, tok, fitted, COPY_OPTIONS, cfg, progress=False, heads=True)  # (L, Hkv, O)
    l, o = max(((l, o) for l in range(L) for o in (1, 2)), key=lambda lo: abs(est[lo]))
    for h in range(fitted.num_kv_heads):  # each head's share: the derivative with only that head's keys moving
        fd = (nll(l, o, eps, h) - nll(l, o, -eps, h)) / (2 * eps)
        assert math.isclose(per_head[l, h, o], fd, rel_tol=0.2, abs_tol=2e-6), (l, h, o, per_head[l, h, o], fd)
    assert np.allclose(per_head.sum(1), est, rtol=1e-12, atol=0)
    art, err = copy_widths_artifact(model, tok, fitted, cfg, progress=False, estimate="gradient")
    assert np.array_equal(err, est) and art.meta["layer_widths"]["estimate"] == "gradient"
    assert art.meta["layer_widths"]["widths"] == layer_artifact(fitted, COPY_OPTIONS, objective="copy",
                                                                copy_err=est).meta["codec"]["widths"]
    kv = ((2, 2), (2, 3), (3, 3))  # values widened too: the value leaf's term, and keys + values adding
    est_kv = layer_copy_gradients(model, tok, fitted, kv, cfg, progress=False)
    q_kv = [[LayerQuant(widths_artifact(fitted, [list(o)] * L), l) for l in range(L)] for o in kv]
    l = int(np.abs(est_kv[:, 1]).argmax())
    fd = (nll(l, 1, eps, quants=q_kv) - nll(l, 1, -eps, quants=q_kv)) / (2 * eps)
    assert abs(est_kv[l, 1]) > 1e-5 and math.isclose(est_kv[l, 1], fd, rel_tol=0.2, abs_tol=2e-6), (l, est_kv[l, 1], fd)
    est3 = layer_copy_gradients(model, tok, fitted, ((2, 2), (3, 2)), cfg, progress=False)
    assert np.allclose(est_kv[:, 2], est3[:, 1] + est_kv[:, 1], rtol=1e-9, atol=1e-15)
    with pytest.raises(OscarError, match="widen from there"):
        layer_copy_gradients(model, tok, fitted, ((2, 2), (1, 2)), cfg, progress=False)
    with pytest.raises(OscarError, match="unknown copy protocol 'fast'"):
        layer_copy_gradients(model, tok, fitted, COPY_OPTIONS, TuneConfig(copy_protocol="fast"), progress=False)
    with pytest.raises(OscarError, match="unknown estimate"):
        copy_widths_artifact(model, tok, fitted, cfg, progress=False, estimate="guess")


@pytest.mark.slow
def test_validate_widths_cli_writes_a_served_per_layer_artifact(fitted, tmp_path, capsys):
    """`oscar validate widths`: the copy probe's DP written as the cache's per-layer format (oscar-artifact/3) within the
    artifact's bits by the memory accounting, which OscarCache then serves (generate runs, layer formats as chosen)."""
    from oscar.__main__ import main
    from oscar.artifact_header import read_metadata
    from oscar.kernels.cache import OscarCache
    from oscar.kernels.memory import artifact_bits_per_element
    from oscar.stats.artifact import load_artifact, save_artifact
    from oscar.validate.env import load_model

    src, out = str(tmp_path / "scaled.safetensors"), str(tmp_path / "widths.safetensors")
    save_artifact(fitted, src)
    assert main(["validate", "widths", "--model", "tiny-llama", "--artifact", src, "--windows", "2", "--length", "512",
                 "--out", out, "--no-progress"]) == 0
    assert read_metadata(out)["format"] == "oscar-artifact/3"
    art = load_artifact(out)
    widths = art.meta["layer_widths"]["widths"]
    kbits = [art.quant_for(l).bits + (art.quant_for(l).key_top if art.quant_for(l).key_split else 0)
             for l in range(art.num_layers)]
    assert kbits == [kb for kb, _ in widths] and all(vb == 2 for _, vb in widths)
    assert artifact_bits_per_element(art) <= artifact_bits_per_element(fitted) + 1e-12
    assert f"{artifact_bits_per_element(art):.3f} bits per element" in capsys.readouterr().out
    model, tok, _ = load_model("tiny-llama")
    try:
        cache = OscarCache.from_artifact(model, art, max_len=256)
        ids = tok("def f(x):\n    return x + 1\n" * 6, return_tensors="pt").input_ids
        model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
        assert [pc.cfg.quant.key_split for pc in cache.pool.layers] == [art.quant_for(l).key_split
                                                                       for l in range(art.num_layers)]
    finally:
        model.set_attn_implementation("sdpa")
