"""Issue 16's key formats (validate/codebooks.py): oscar-lm-int2 (per-token norms + Lloyd-Max codebooks fitted
on calibration keys) and oscar-sparse-int2 (oscar-int2's keys + the per-page entries of largest error exact),
each against a brute-force reference, and their bits against the 2.5 budget through the memory accounting."""

import math

import numpy as np
import pytest
import torch

from oscar.quant import FP8_PARAM, QuantSpec, fake_quant
from oscar.validate import codebooks as cb
from oscar.validate.ablation.schemes import lloyd_max


def _direct_lloyd(x: np.ndarray, levels: np.ndarray, iters: int = 500) -> np.ndarray:
    """Brute force Lloyd on one row of samples: every sample to its nearest level (all tried), centroids."""
    lv = levels.copy()
    for _ in range(iters):
        near = np.abs(x[:, None] - lv[None, :]).argmin(-1)
        new = np.array([x[near == j].mean() if (near == j).any() else lv[j] for j in range(len(lv))])
        if np.abs(new - lv).max() < 1e-12:
            break
        lv = new
    return np.sort(lv)


def test_lloyd_fit_matches_a_direct_lloyd_iteration():
    rng = np.random.default_rng(0)
    x = np.stack([rng.standard_normal(300) * 2 + 1, rng.standard_t(3, 300), rng.exponential(1.0, 300)])  # (3, 300)
    got = cb.lloyd_fit(torch.from_numpy(x), 2, iters=1000, tol=1e-13).numpy()
    for c in range(3):
        init = np.quantile(x[c], (np.arange(4) + 0.5) / 4)
        want = _direct_lloyd(x[c], init, 1000)
        assert np.allclose(got[c], want, atol=1e-8), (c, got[c], want)
    # a fixed point: each level is the mean of the samples nearest to it
    for c in range(3):
        near = np.abs(x[c][:, None] - got[c][None]).argmin(-1)
        assert np.allclose([x[c][near == j].mean() for j in range(4)], got[c], atol=1e-7)


def test_lloyd_fit_on_gaussian_samples_is_the_gaussian_lloyd_max_codebook():
    x = torch.randn(1, 200_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = cb.lloyd_fit(x, 2)[0].numpy()
    assert np.allclose(got, lloyd_max(2, "gaussian")[0], atol=0.02)


def test_lm_fake_quant_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    B, H, T, D, G = 2, 3, 5, 16, 8
    y = torch.randn(B, H, T, D, generator=g) * torch.linspace(0.2, 3, D)
    levels = torch.randn(H, D, 4, generator=g).sort(-1).values
    got = cb.lm_fake_quant(y, levels, G).double().numpy()
    yn, lv = y.double().numpy(), levels.double().numpy()
    want = np.empty_like(yn)
    for b, h, t in np.ndindex(B, H, T):
        for a in range(0, D, G):
            seg = yn[b, h, t, a:a + G]
            n = float(np.float16(np.linalg.norm(seg.astype(np.float32)))) / math.sqrt(G)  # the stored fp16 norm
            for j in range(a, a + G):
                want[b, h, t, j] = lv[h, j][np.abs(seg[j - a] / n - lv[h, j]).argmin()] * n
    assert np.allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_sparse_selection_matches_sorting_the_errors_by_hand():
    g = torch.Generator().manual_seed(3)
    B, H, T, D, page, n_out = 1, 2, 48, 16, 16, 5
    y = torch.randn(B, H, T, D, generator=g) * torch.linspace(0.5, 2, D)
    y[0, 1, 7, 3] = 40.0  # an outlier: clipped away by the dense code, kept by the side list
    spec, clip = QuantSpec(bits=2), torch.tensor([0.8, 0.9]).view(-1, 1, 1)
    got = cb.sparse_fake_quant(y, spec, clip, n_out, page)
    dense = fake_quant(y, spec, clip)
    want = dense.clone()
    for h in range(H):
        for p in range(T // page):
            errs = [(float((y - dense)[0, h, t, d].abs()), t, d) for t in range(p * page, (p + 1) * page) for d in range(D)]
            for _, t, d in sorted(errs, reverse=True)[:n_out]:  # the n_out largest errors of the page
                want[0, h, t, d] = y[0, h, t, d].half().float()
    assert torch.equal(got, want)
    assert got[0, 1, 7, 3] == 40.0
    exact = (got != dense).reshape(B, H, T // page, page * D).sum(-1)
    assert (exact <= n_out).all() and (exact >= n_out - 1).all()  # (an entry's fp16 may equal its INT2 reading)
    with pytest.raises(Exception, match="per page"):
        cb.sparse_fake_quant(y[..., :20, :], spec, clip, n_out, page)


def test_sparse_round_trip_is_exact_where_listed_and_no_worse_elsewhere():
    y = torch.randn(1, 1, 32, 64, generator=torch.Generator().manual_seed(4)) * 3
    spec = QuantSpec(bits=2)
    out = cb.sparse_fake_quant(y, spec, 1.0, 9, 16)
    dense = fake_quant(y, spec, 1.0)
    assert ((out - y).abs() <= (dense - y).abs() + 1e-3).all()
    assert float(((out - y) ** 2).sum()) < float(((dense - y) ** 2).sum())


def test_sparse_count_fills_the_budget():
    D, page = 64, 16
    k, v = QuantSpec(bits=2), QuantSpec(bits=2, param_dtype=FP8_PARAM)
    assert k.bits_per_element(D) == 2.5 and v.bits_per_element(D) == 2.25
    assert cb.sparse_index_bits(page, D) == 10
    n = cb.sparse_outliers(k, v, page, D, 2.5)
    assert n == 9  # 0.25 bits x 1024 entries = 256 bits per page, 26 bits an entry
    codec = cb.LayerCodec("sparse", spec=k, n_out=n, page=page)
    assert 0.5 * (codec.bits_per_element(D) + v.bits_per_element(D)) <= 2.5
    assert 0.5 * (cb.LayerCodec("sparse", spec=k, n_out=n + 1, page=page).bits_per_element(D) + v.bits_per_element(D)) > 2.5
    with pytest.raises(Exception, match="no room"):
        cb.sparse_outliers(k, QuantSpec(bits=2), page, D, 2.5)


def test_budget_at_head_dim_64_through_the_memory_accounting():
    """The 2.5-bit budget of issue 16, read where the reports read it (memory_row -> bits_per_element)."""
    from oscar.pipeline.models import load_config
    from oscar.stats.artifact import QuantConfig, identity_artifact
    from oscar.validate.methods import SERVING, bits_per_element, memory_row

    config = load_config("smollm2-135m")
    base = identity_artifact(config, QuantConfig(bits=2), clip=1.0)
    D = base.head_dim
    assert D == 64 and cb.oscar_bits(base) == 2.5
    sp = cb.sparse_artifact(base)
    assert sp.meta["codec"]["n_out"] == 9
    g = cb.lm_norm_group(base)
    assert g == 32
    levels = {f"layers.{l}.levels_k": torch.zeros(base.num_kv_heads, D, 4) for l in range(base.num_layers)}
    lm = cb._derived(base, "oscar-lm-int2", {"kind": "lm", "bits": 2, "norm_group": g}, levels)
    assert bits_per_element(lm, D) == 2.5
    assert bits_per_element(sp, D) == pytest.approx(0.5 * (2.5 + 9 * 26 / 1024 + 2.25))
    for name, a in (("oscar-lm-int2", lm), ("oscar-sparse-int2", sp)):
        row = memory_row(name, a, config, 4096, SERVING)
        assert row["bits_per_element"] <= cb.BUDGET_BITS


# ----------------------------------------------------------------- on a real (tiny) calibration store


@pytest.fixture(scope="module")
def fitted(tiny_store):
    from oscar.stats.fit import FitConfig, fit

    return fit(tiny_store, FitConfig(variant="scaled", progress=False, threads=1))


def test_lm_codebooks_come_from_the_calibration_keys(fitted):
    """levels_k = Lloyd on the store's reservoir keys, centred, rotated and normalised by the artifact."""
    from oscar.stats.reduce import LayerStats, ReduceConfig, open_store

    art = cb.lm_artifact(fitted)
    l, H, D = 1, art.num_kv_heads, art.head_dim
    g = art.meta["codec"]["norm_group"]
    ls = LayerStats(open_store(fitted.meta["provenance"]["store"]), l, ReduceConfig())
    k = torch.from_numpy(ls.rows("k").astype(np.float32))
    y = (k - fitted.k_mean[l][:, None, :]) @ fitted.rot_k[l]
    for h, j in ((0, 0), (H - 1, D - 1)):
        seg = y[h][:, (j // g) * g:(j // g + 1) * g]
        n = seg.norm(dim=-1).half().float() / math.sqrt(g)
        u = (y[h][:, j] / n).double().numpy()
        init = np.quantile(u, (np.arange(4) + 0.5) / 4)
        assert np.allclose(art.extra[f"layers.{l}.levels_k"][h, j].numpy(), _direct_lloyd(u, init), atol=1e-4)


@pytest.mark.parametrize("name", ["oscar-lm-int2", "oscar-sparse-int2"])
def test_layerquant_runs_the_issue16_format(fitted, name):
    """LayerQuant = centre, rotate by rot_k, the key format, back by rot_qᵀ; values oscar-int2's grid
    (fp8 scale/zero for sparse); the rest of oscar-int2's artifact untouched."""
    from oscar.pipeline.models import load_config
    from oscar.validate.methods import LayerQuant, bits_per_element, method_artifact

    config = load_config("tiny-llama")
    art = method_artifact(name, config, fitted)
    assert method_artifact(name, config, fitted) is art  # cached
    assert art.rot_k is fitted.rot_k and art.clip_v is fitted.clip_v and art.quant == fitted.quant
    l, H, D = 2, art.num_kv_heads, art.head_dim
    lq = LayerQuant(art, l)
    assert lq.key_group == art.quant.page_size
    k = torch.randn(1, H, 32, D, generator=torch.Generator().manual_seed(5))
    mu = art.k_mean[l][None, :, None, :]
    y = (k - mu) @ art.rot_k[l]
    ck = art.clip_k[l].view(-1, 1, 1)
    if name == "oscar-lm-int2":
        yq = cb.lm_fake_quant(y, art.extra[f"layers.{l}.levels_k"], art.meta["codec"]["norm_group"])
        vspec = art.quant.value_spec(D)
    else:
        yq = cb.sparse_fake_quant(y, art.quant.key_spec(D), ck, art.meta["codec"]["n_out"], art.quant.page_size)
        vspec = QuantSpec(bits=2, param_dtype=FP8_PARAM)
    want_k = yq @ art.rot_q[l].transpose(-1, -2) + mu
    want_v = fake_quant(k @ art.rot_v[l], vspec, art.clip_v[l].view(-1, 1, 1)) @ art.rot_v[l].transpose(-1, -2)
    assert torch.allclose(lq.keys(k), want_k, atol=1e-5) and torch.allclose(lq.values(k), want_v, atol=1e-5)
    assert bits_per_element(art, D) <= cb.oscar_bits(fitted)  # equal bits to oscar-int2 (3.0 at this D = 32)


# ----------------------------------------------------------------- the same quantizers in the synthetic ablation


@pytest.mark.parametrize("path", ["oracle", "production"])
def test_ablation_codecs_are_the_model_level_quantizers(path):
    """LMCodec / SparseCodec (validate/ablation/schemes.py) = lm_fake_quant / sparse_fake_quant in their
    rotated space, with bits counted from the stored fields at oscar_scaled's budget."""
    from oscar.validate.ablation.schemes import Ctx, make_scheme

    g = torch.Generator().manual_seed(6)
    D = 32
    x = {n: torch.randn(256, D, generator=g).double() * torch.linspace(0.3, 2, D).double() for n in "qkv"}
    ctx = Ctx(path, 0)
    x = {n: t.to(ctx.dtype) for n, t in x.items()}
    te = torch.randn(64, D, generator=g).to(ctx.dtype) * 2
    lm = make_scheme("oscar_lm", 2).fit(x, ctx)
    base = make_scheme("oscar_scaled", 2).fit(x, Ctx(path, 0))
    got, bits = lm.k.roundtrip(te)
    y = (te - lm.k.mu) @ lm.k.R
    want = cb.lm_fake_quant(y[None, None], lm.k.levels[None], lm.k.g)[0, 0] @ lm.k.Rinv + lm.k.mu
    assert torch.allclose(got, want, atol=1e-5) and lm.k.g == D // 2
    assert bits == base.k.roundtrip(te)[1] == 2 + 32 / D  # equal bits to oscar_scaled's keys
    sp = make_scheme("oscar_sparse", 2).fit(x, ctx)
    got, bk = sp.k.roundtrip(te)
    y = (te - sp.k.mu) @ sp.k.R
    want = cb.sparse_fake_quant(y[None, None], sp.k.spec, sp.k.c, sp.k.n_out, sp.k.page)[0, 0] @ sp.k.Rinv + sp.k.mu
    assert torch.allclose(got, want, atol=1e-5)
    bv = sp.v.roundtrip(te)[1]
    assert bv == 2 + 16 / D and 0.5 * (bk + bv) <= 2 + 32 / D  # fp8 value params pay for the side list
    assert bk == 2 + 32 / D + sp.k.n_out * (16 + cb.sparse_index_bits(16, D)) / (16 * D)
