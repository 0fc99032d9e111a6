"""Fit: Hadamard/bit reversal, reduction, spectrum, tails, rotations, clip search, bad input.

Synthetic stores (tests/helpers/synthetic_store.py) with planted spectra are written to disk
in the documented format and fitted through the public functions.
"""

import math
import sys

import numpy as np
import pytest
import torch

from oscar.common import OscarError, config_fingerprint
from oscar.stats.artifact import calibrated_length, describe, load_artifact, save_artifact
from oscar.stats.fit import FitConfig, fit
from oscar.stats.hadamard import bitrev_perm, hadamard, perm_matrix
from oscar.stats.reduce import LayerStats, ReduceConfig, block_means, open_store, reduce
from oscar.stats.rotations import VARIANTS

from helpers.synthetic_store import SynthSpec, write_synthetic_store


def _cfg(**kw):
    kw.setdefault("progress", False)
    kw.setdefault("threads", 1)
    return FitConfig(**kw)


def _llama(L=2, H=2, D=16, nq=4):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=L, num_attention_heads=nq, num_key_value_heads=H, head_dim=D,
                       hidden_size=nq * D, intermediate_size=64, vocab_size=1000)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("s") / "store")
    truth = write_synthetic_store(p, SynthSpec(k_mean=3.0, fingerprint=config_fingerprint(_llama()), seed=3))
    return p, truth


def _is_pow2(n):
    return n & (n - 1) == 0


# --- Hadamard and bit reversal ------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 64, 128])
def test_sylvester_matches_explicit(n):
    H = hadamard(n)
    expl = np.array([[(-1) ** bin(i & j).count("1") for j in range(n)] for i in range(n)]) / math.sqrt(n)
    assert np.array_equal(H, expl)


@pytest.mark.parametrize("n", [12, 20, 24, 40, 48, 80, 96, 160])
def test_paley_kron_orthogonal(n):
    H = hadamard(n)
    assert np.abs(H @ H.T - np.eye(n)).max() < 1e-12
    assert np.allclose(np.abs(H) * math.sqrt(n), 1.0)  # ±1/sqrt(n) entries


@pytest.mark.parametrize("n", [2, 8, 64, 128])
def test_bitrev_matches_explicit(n):
    k = n.bit_length() - 1
    expl = [int(format(j, f"0{k}b")[::-1], 2) if k else 0 for j in range(n)]
    assert bitrev_perm(n).tolist() == expl
    x = np.random.default_rng(0).standard_normal((3, n))
    assert np.array_equal(x @ perm_matrix(bitrev_perm(n)), x[:, bitrev_perm(n)])


def test_bitrev_mixed_radix_is_permutation():
    for n in (24, 40, 96, 160):
        assert sorted(bitrev_perm(n).tolist()) == list(range(n))


def test_unsupported_head_dim_names_alternatives(tmp_path):
    with pytest.raises(OscarError, match="random.*identity"):
        hadamard(72)
    p = str(tmp_path / "s36")
    write_synthetic_store(p, SynthSpec(num_layers=1, num_kv_heads=1, head_dim=36, num_blocks=2, rows=64, reservoir=32))
    with pytest.raises(OscarError, match="head_dim 36"):
        fit(p, _cfg())
    art = fit(p, _cfg(variant="identity"))  # the named alternative works
    assert art.head_dim == 36


# --- rotations ------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_rotations_orthogonal(store, name):
    view = open_store(store[0])
    ls = LayerStats(view, 0, ReduceConfig())
    rot = VARIANTS[name].build(ls, np.random.default_rng(0))
    eye = np.eye(16)
    # every variant's R_V and query transform are orthogonal; R_K too, except `scaled` (and `split`, which
    # builds on it), whose R_K is the dual of its orthogonal-times-diagonal R_Q: R_Qᵀ R_K = I keeps q·k exact
    orth = (rot.rot_v,) + ((rot.rot_k,) if rot.rot_q is None else ())
    for R in orth:
        assert R.dtype == np.float64 and R.shape == (2, 16, 16)
        assert np.abs(R @ np.swapaxes(R, -1, -2) - eye).max() < 1e-10
        assert np.abs(np.swapaxes(R, -1, -2) @ R - eye).max() < 1e-10
    if rot.rot_q is not None:
        assert name in ("scaled", "split")
        assert np.abs(np.swapaxes(rot.rot_q, -1, -2) @ rot.rot_k - eye).max() < 1e-10
        assert np.abs(rot.rot_k @ np.swapaxes(rot.rot_k, -1, -2) - eye).max() > 1e-2  # really scaled


def test_importance_scales_minimise_the_logit_error_bound():
    """d = (λ/σ²)^¼ minimises (Σ d²σ²)(Σ λ/d²) — the per-token logit error after H — at (Σ σ√λ)²
    (Cauchy–Schwarz), against random scalings by brute force; energy Σ d²σ² = Σ σ² is kept."""
    from oscar.stats.rotations import importance_scales

    rng = np.random.default_rng(0)
    lam, sig2 = rng.gamma(0.5, size=(3, 16)) + 0.05, rng.gamma(0.5, size=(3, 16)) + 0.05
    d = importance_scales(lam, sig2, floor=0.0)
    obj = lambda d: (d**2 * sig2).sum(-1) * (lam / d**2).sum(-1)  # noqa: E731
    assert np.allclose(obj(d), (np.sqrt(sig2 * lam).sum(-1)) ** 2)
    assert np.allclose((d**2 * sig2).sum(-1), sig2.sum(-1))
    for _ in range(200):
        assert (obj(d * np.exp(rng.normal(0, 0.3, d.shape))) >= obj(d) * (1 - 1e-12)).all()
    assert (obj(np.ones_like(d)) > 1.2 * obj(d)).all()  # misaligned spectra: a real gain over d = 1
    # floors keep directions that no query reads (λ = 0) finite
    lam[:, :4] = 0.0
    assert np.isfinite(importance_scales(lam, sig2)).all() and (importance_scales(lam, sig2) > 0).all()


def test_scaled_variant_fits_lower_key_error_and_roundtrips(store, tmp_path):
    """The scaled variant: rot_q = rot_k^{-T} in the artifact (format /2), logits exact, and the
    searched clip's q-weighted key error below the orthogonal centred recipe's on the same store."""
    p = store[0]
    cen, sc = fit(p, _cfg(variant="centered")), fit(p, _cfg(variant="scaled"))
    assert cen.rot_q is None and sc.rot_q is not None
    out = str(tmp_path / "scaled.safetensors")
    save_artifact(sc, out)
    back = load_artifact(out)
    assert back.meta["format"] == "oscar-artifact/2" and all(torch.equal(a, b) for a, b in zip(back.rot_q, sc.rot_q))
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 30, 16, generator=g).double(), torch.randn(2, 20, 16, generator=g).double()
    mu, Rk, Rq = sc.k_mean[0].double(), sc.rot_k[0].double(), sc.rot_q[0].double()
    got = (q @ Rq) @ ((k - mu[:, None]) @ Rk).transpose(-1, -2) + q @ mu[:, :, None]
    assert torch.allclose(got, q @ k.transpose(-1, -2), atol=1e-4)
    err = lambda a: np.mean([np.mean(lm["clip"]["k"]["err"]) for lm in a.meta["layers"]])  # noqa: E731
    print(f"q-weighted key error: centered {err(cen):.4f}, scaled {err(sc):.4f}")
    assert err(sc) < err(cen)
    # values are untouched by the variant
    assert all(torch.equal(a, b) for a, b in zip(cen.rot_v, sc.rot_v))


def test_artifact_with_inconsistent_rot_q_refused(store, tmp_path):
    sc = fit(store[0], _cfg(variant="scaled"))
    sc.rot_q[1] = sc.rot_k[1].clone()  # not the dual of a non-orthogonal rot_k
    with pytest.raises(OscarError, match=r"layers.1.rot_q is not rot_k\^\(-T\)"):
        sc.validate()


def test_rot_k_reproduces_from_stored_cq(store):
    import zarr

    p, truth = store
    art = fit(p, _cfg(variant="oscar"))
    g = zarr.open_group(p, mode="r")
    Hm = hadamard(16) @ perm_matrix(bitrev_perm(16))
    for l in range(2):
        Cq = g[f"layers/{l}/q_gram"][:].sum(0) / g[f"layers/{l}/q_count"][:].sum()  # (H, D, D)
        for h in range(2):
            w, U = np.linalg.eigh(Cq[h])
            U = U[:, ::-1]
            for j in range(16):  # documented sign convention: largest-|.| entry positive
                if U[np.argmax(np.abs(U[:, j])), j] < 0:
                    U[:, j] *= -1
            R = U @ Hm
            assert np.abs(art.rot_k[l][h].double().numpy() - R).max() < 1e-5
            # and the planted leading subspace is what it found
            s = np.linalg.svd(U[:, :4].T @ truth[(l, h)]["U_q"][:, :4], compute_uv=False)
            assert s.min() > 0.95


def test_logits_invariant_under_rotation(store):
    art = fit(store[0], _cfg(variant="centered"))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 50, 16, generator=g), torch.randn(2, 40, 16, generator=g)
    Rk, mu = art.rot_k[0].double(), art.k_mean[0].double()
    q, k = q.double(), k.double()
    ref = q @ k.transpose(-1, -2)
    assert torch.allclose((q @ Rk) @ (k @ Rk).transpose(-1, -2), ref, atol=1e-5)
    # centred: q·k = (q R)·((k - μ) R) + q·μ
    cent = (q @ Rk) @ ((k - mu[:, None]) @ Rk).transpose(-1, -2) + (q @ mu[:, :, None])
    assert torch.allclose(cent, ref, atol=1e-5)
    Rv = art.rot_v[0].double()
    v = torch.randn(2, 40, 16, generator=g).double()
    S = torch.softmax(ref / 4, -1)
    assert torch.allclose((S @ (v @ Rv)) @ Rv.transpose(-1, -2), S @ v, atol=1e-5)  # o = (S V_rot) R_Vᵀ


# --- spectrum: d_eff, pruning, stability --------------------------------------------

@pytest.mark.parametrize("rank", [2, 5])
def test_deff_recovers_planted_rank(tmp_path, rank):
    p = str(tmp_path / "s")
    write_synthetic_store(p, SynthSpec(num_layers=1, num_kv_heads=2, rank=rank, seed=rank))
    art = fit(p, _cfg(clip=False))
    assert art.meta["layers"][0]["d_eff"]["q"] == [rank, rank]
    assert art.meta["layers"][0]["d_eff"]["o"] == [rank, rank]


def test_spurious_eigenvalue_pruned(tmp_path):
    p = str(tmp_path / "s")
    write_synthetic_store(p, SynthSpec(num_layers=1, num_kv_heads=2, num_blocks=8, rank=4, spurious=(0, 0, 3, 1.0), seed=5))
    m = fit(p, _cfg(clip=False)).meta["layers"][0]
    assert m["d_gap_raw"]["q"][0] == 5  # without pruning the spike counts as signal
    assert len(m["pruned"]["q"][0]) == 1 and m["d_eff"]["q"][0] == 4
    assert m["pruned"]["q"][1] == [] and m["d_eff"]["q"][1] == 4


def test_unstable_head_falls_back_to_hadamard(tmp_path):
    p = str(tmp_path / "s")
    write_synthetic_store(p, SynthSpec(num_layers=1, num_kv_heads=2, num_blocks=6, unstable=((0, 1),), seed=6))
    art = fit(p, _cfg(clip=False))
    fb = art.meta["fallbacks"]
    assert [(f["layer"], f["head"], f["side"]) for f in fb] == [(0, 1, "k")]
    assert "unstable" in fb[0]["reason"]
    Hm = hadamard(16) @ perm_matrix(bitrev_perm(16))
    assert np.abs(art.rot_k[0][1].double().numpy() - Hm).max() < 1e-6
    assert np.abs(art.rot_k[0][0].double().numpy() - Hm).max() > 0.1  # the stable head keeps its eigenbasis


# --- reduction and heavy tails -----------------------------------------------------

def test_reduce_estimators_match_bruteforce():
    rng = np.random.default_rng(0)
    sums = rng.standard_normal((7, 3, 3)) * 10
    counts = rng.integers(5, 20, 7)
    assert np.allclose(reduce(sums, counts, "plain"), sums.sum(0) / counts.sum())
    means = np.stack([sums[b] / counts[b] for b in range(7)])
    med = np.median(means, 0)
    w, V = np.linalg.eigh(0.5 * (med + med.T))
    assert np.allclose(reduce(sums, counts, "mom"), (V * np.clip(w, 0, None)) @ V.T)
    assert np.allclose(block_means(sums, counts), means)
    from scipy.stats import trim_mean

    tm = trim_mean(means, 0.15, axis=0)
    w, V = np.linalg.eigh(0.5 * (tm + tm.T))
    assert np.allclose(reduce(sums, counts, "trimmed", trim=0.15), (V * np.clip(w, 0, None)) @ V.T)


def test_kurtosis_and_hill_against_bruteforce():
    from oscar.pipeline.store import excess_kurtosis
    from oscar.stats.tails import hill

    rng = np.random.default_rng(1)
    x = rng.standard_t(5, size=(4000, 3)) + 0.5
    k = excess_kurtosis(len(x), x.sum(0), (x**2).sum(0), (x**3).sum(0), (x**4).sum(0))
    c = x - x.mean(0)
    assert np.allclose(k, (c**4).mean(0) / (c**2).mean(0) ** 2 - 3.0, rtol=1e-8)  # central moments, brute force
    pareto = (1 - rng.random(20000)) ** (-1 / 3.0)  # tail index 3
    assert abs(hill(pareto) - 3.0) < 0.4


def _subspace_dist(U, V):
    s = np.linalg.svd(U.T @ V, compute_uv=False)
    return math.sqrt(max(0.0, len(s) - float((s**2).sum())))


def test_robust_estimate_beats_sample_covariance_on_student_t(tmp_path):
    """ν = 3: the median-of-means leading subspace is closer to the planted one (measured)."""
    d_plain, d_auto = [], []
    for seed in range(3):
        p = str(tmp_path / f"t{seed}")
        truth = write_synthetic_store(p, SynthSpec(num_layers=1, num_kv_heads=4, num_blocks=16, rows=200, tail="t",
                                                   nu=3.0, rank=3, signal=4.0, decay=0.6, floor=1.0, seed=seed))
        view = open_store(p)
        ls = LayerStats(view, 0, ReduceConfig(estimator="auto", shrinkage="none"))
        assert all(t.heavy for t in ls.tails("q")), "Student-t(3) heads must be flagged heavy"
        C_auto = ls.cov("q")
        assert ls.record["estimator"]["q"] == ["mom"] * 4
        C_plain = LayerStats(view, 0, ReduceConfig(estimator="plain", shrinkage="none")).cov("q")
        for h in range(4):
            true = truth[(0, h)]["U_q"][:, :3]
            d_plain.append(_subspace_dist(np.linalg.eigh(C_plain[h])[1][:, ::-1][:, :3], true))
            d_auto.append(_subspace_dist(np.linalg.eigh(C_auto[h])[1][:, ::-1][:, :3], true))
    print(f"sin-theta distance to the planted subspace: plain {np.mean(d_plain):.3f}, robust {np.mean(d_auto):.3f}")
    assert np.mean(d_auto) < 0.85 * np.mean(d_plain)


def test_gaussian_heads_use_plain(store):
    ls = LayerStats(open_store(store[0]), 0, ReduceConfig())
    ls.cov("q")
    assert not any(t.heavy for t in ls.tails("q")) and ls.record["estimator"]["q"] == ["plain", "plain"]


# --- clip search -------------------------------------------------------------------------

def _constructed_keys(n=64):
    """Rows: one channel at -6, one at +6, and 32 channels holding each of {-3, -1, 1, 3} 8 times.
    2-bit minmax grid at ratio r: {-6r, -2r, 2r, 6r}. Near r = 0.55 every value rounds to the
    same level, so the error is 2(6-6r)² + 16(3-6r)² + 16(1-2r)², minimised at r* = 784/1424."""
    row = np.array([-6.0, 6.0] + [-3.0, -1.0, 1.0, 3.0] * 8)
    return np.stack([np.random.default_rng(i).permutation(row) for i in range(n)])


def test_clip_search_finds_constructed_optimum():
    from oscar.quant import QuantSpec
    from oscar.stats.clip import choose, key_errors

    spec = QuantSpec(bits=2)
    k0 = torch.tensor(_constructed_keys()).float()
    k1 = torch.tensor(np.random.default_rng(1).choice([-3.0, -1.0, 1.0, 3.0], size=(64, 34))).float()
    k1[:, 0], k1[:, 1] = -3.0, 3.0  # values on the r = 1 grid: optimum r = 1, error 0
    k = torch.stack([k0, k1])  # (H=2, N, D)
    Cq = torch.eye(34).expand(2, 34, 34)
    cands = np.round(np.arange(0.3, 1.0001, 0.005), 4)
    errs = key_errors(k, Cq, spec, cands)
    r_star = 784 / 1424
    assert abs(cands[errs[:, 0].argmin()] - r_star) <= 0.005
    assert cands[errs[:, 1].argmin()] == 1.0 and errs[:, 1].min() == 0.0
    c = choose(errs, cands, per_head_gain=0.02, noclip=errs[-1])
    assert c.per_head and abs(c.clip[0] - r_star) <= 0.005 and c.clip[1] == 1.0
    c1 = choose(errs[:, :1], cands, 0.02, errs[-1, :1])
    assert not c1.per_head


def test_static_clip_search_finds_constructed_optimum():
    from oscar.quant import QuantSpec
    from oscar.stats.clip import candidates, choose, key_errors

    spec = QuantSpec(bits=2, mode="static")
    rng = np.random.default_rng(2)
    x = rng.choice([-3.0, -1.0, 1.0, 3.0], size=(1, 256, 16))
    x[0, :3, 0] = 30.0  # rare outliers set max|x| = 30; the optimum threshold stays 3
    k = torch.tensor(x).float()
    cands = candidates(spec, k, None, np.round(np.arange(0.02, 1.0001, 0.02), 4))
    errs = key_errors(k, torch.eye(16)[None], spec, cands)
    c = choose(errs, cands, 0.02, errs[-1])
    assert c.clip[0] == pytest.approx(3.0, rel=1e-6)


def test_fit_clips_recorded_and_better_than_noclip(store):
    art = fit(store[0], _cfg(variant="centered"))
    for lm in art.meta["layers"]:
        for side in ("k", "v"):
            assert sum(lm["clip"][side]["err"]) <= sum(lm["clip"][side]["err_noclip"]) + 1e-12
    assert all(0.5 <= float(c) <= 1.0 for c in torch.cat(art.clip_k + art.clip_v))


def test_static_mode_and_channel_keys_fit(store):
    from oscar.stats.artifact import QuantConfig

    a = fit(store[0], _cfg(quant=QuantConfig(mode="static")))
    assert all((c > 0).all() and (c > 1.0).any() for c in a.clip_k)  # absolute thresholds, not ratios
    b = fit(store[0], _cfg(quant=QuantConfig(key_axis="channel")))
    assert b.quant.key_axis == "channel"


# --- artifact, provenance, CLI ----------------------------------------------------------

def test_artifact_roundtrip_check_model_and_describe(store, tmp_path):
    p, _ = store
    art = fit(p, _cfg(variant="centered"))
    out = str(tmp_path / "a.safetensors")
    save_artifact(art, out)
    back = load_artifact(out)
    assert back.k_mean is not None and torch.equal(back.rot_k[1], art.rot_k[1])
    m = back.meta
    assert m["variant"] == "centered" and m["provenance"]["blocks"] == [0, 1, 2, 3]
    assert m["provenance"]["tokens"] == 4 * 260 and len(m["provenance"]["store_fingerprint"]) == 16
    assert calibrated_length(back) == m["provenance"]["seq_len"] == 260  # the positions the statistics cover
    assert set(m["layers"][0]) >= {"d_eff", "stability", "kurtosis", "tail_index", "heavy", "estimator", "clip_k"}
    back.check_model(_llama())
    with pytest.raises(OscarError, match="num_kv_heads"):
        back.check_model(_llama(H=4, nq=8))
    with pytest.raises(OscarError, match="fingerprint"):
        back.check_model(_llama(nq=2))  # same attention shapes (H=2, D=16), different model
    text = describe(out)
    assert "variant centered" in text and "fallbacks: 0" in text and "rot_k (2, 16, 16)" in text
    assert "in sequences of 260" in text
    split = str(tmp_path / "s.safetensors")
    save_artifact(fit(p, _cfg(variant="split")), split)  # a (wide, narrow) key clip pair per head
    text = describe(split)
    assert "variant split" in text and "clip k: " in text and "clip_k (2, 2)" in text


def test_cli_fit_and_variants(store, tmp_path, capsys):
    from oscar.__main__ import main

    out = str(tmp_path / "c.safetensors")
    assert main(["fit", store[0], "--out", out, "--variant", "hadamard", "--quiet", "--threads", "1", "--no-tune", "--widths", "none"]) == 0
    assert load_artifact(out).meta["variant"] == "hadamard"
    out8 = str(tmp_path / "c8.safetensors")  # 8-bit scale/zero: the clip search fits that format
    assert main(["fit", store[0], "--out", out8, "--variant", "hadamard", "--quiet", "--threads", "1", "--no-tune", "--widths", "none",
                 "--param-dtype", "float8_e4m3fn"]) == 0
    assert load_artifact(out8).quant.param_dtype == "float8_e4m3fn" and load_artifact(out).quant.param_dtype == "float16"
    assert main(["fit", store[0], "--out", out, "--variant", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown variant 'bogus'" in err and "oscar" in err and "shared-layer" in err
    assert main(["variants"]) == 0


def test_calibration_report_section(store, tmp_path):
    from oscar.reports.calibration import calibration_section

    a = str(tmp_path / "a.safetensors")
    save_artifact(fit(store[0], _cfg()), a)
    r = calibration_section(a, store[0], str(tmp_path / "rep"))
    assert len(r["figures"]) == 6 and all(open(f, "rb").read(4) == b"\x89PNG" for f in r["figures"])
    assert r["summary"]["d_eff_k"]["median"] == 4 and "## Calibration" in open(r["markdown"]).read()
    assert "tuned end to end" not in open(r["markdown"]).read()
    art = fit(store[0], _cfg())  # a tuned artifact's record shows up in the section
    art.meta["clip_tuning"] = {"config": {"tokens": 2048, "protocol": "strict"}, "nll_per_token": {"1.0": 3.2, "1.1": 3.1},
                               "chosen_factor": 1.1, "mean_clip_k_before": 0.7, "mean_clip_k_after": 0.77}
    save_artifact(art, a)
    text = open(calibration_section(a, store[0], str(tmp_path / "rep2"))["markdown"]).read()
    assert "Key clips tuned end to end: × **1.1**" in text and "×1.1 3.1000" in text


def test_calibration_report_reads_headers_through_the_one_reader(tmp_path):
    """The report refuses what `oscar.artifact_header.read_metadata` refuses, with its messages."""
    from safetensors.torch import save_file

    from oscar.reports.calibration import calibration_section

    junk, plain = tmp_path / "junk.safetensors", str(tmp_path / "plain.safetensors")
    junk.write_bytes(b"not a safetensors file")
    save_file({"x": torch.zeros(2)}, plain)
    with pytest.raises(OscarError, match="not a readable safetensors artifact"):
        calibration_section(str(junk), None, str(tmp_path / "r1"))
    with pytest.raises(OscarError, match="no 'oscar' metadata"):
        calibration_section(plain, None, str(tmp_path / "r2"))


# --- bad input ---------------------------------------------------------------------------

def _small(tmp_path, name="s", **kw):
    p = str(tmp_path / name)
    write_synthetic_store(p, SynthSpec(num_layers=2, num_kv_heads=1, head_dim=8, num_blocks=4, rows=64, reservoir=32, **kw))
    return p


def test_incomplete_store_refused_or_partial(tmp_path, capsys):
    import zarr

    p = _small(tmp_path)
    zarr.open_group(p, mode="r+")["done"][2, 1] = 0
    with pytest.raises(OscarError, match="incomplete.*--partial"):
        fit(p, _cfg())
    art = fit(p, _cfg(partial=True))
    assert "WARNING: --partial" in capsys.readouterr().err
    assert art.meta["provenance"]["partial"] is True and art.meta["provenance"]["blocks"] == [0, 1, 3]


def test_nan_sums_and_counts_refused(tmp_path):
    import zarr

    from oscar.pipeline.store import FORMAT_V1, CalibStore

    p = _small(tmp_path, "a")
    st = CalibStore(p, mode="r+")  # a NaN written by the store's writer: checksums agree, the NaN check refuses it
    arrays = {n: st.array(f"layers/1/{n}")[1] for n in st.spec}
    arrays["o_gram"][0, 0, 0] = np.nan
    st.write_layer(1, 1, arrays)
    with pytest.raises(OscarError, match=r"layers/1/o_gram has NaN/Inf in block\(s\) \[1\]"):
        fit(p, _cfg())
    p = _small(tmp_path, "b")
    zarr.open_group(p, mode="r+").attrs["format"] = FORMAT_V1  # a foreign float q_count in a store without checksums
    lg = zarr.open_group(p, mode="r+")["layers/0"]
    del lg["q_count"]
    a = lg.create_array("q_count", shape=(4,), dtype="float64", chunks=(1,))
    a[:] = [64.0, np.nan, 64.0, 64.0]
    with pytest.raises(OscarError, match="q_count has NaN"):
        fit(p, _cfg())


def test_unknown_variant_and_estimator():
    with pytest.raises(OscarError, match="valid: .*oscar.*random"):
        FitConfig(variant="nope")
    with pytest.raises(OscarError, match="unknown estimator"):
        FitConfig(reduce=ReduceConfig(estimator="median"))


def test_not_a_store(tmp_path):
    import zarr

    g = zarr.open_group(str(tmp_path / "x"), mode="w")
    g.attrs["format"] = "something-else"
    with pytest.raises(OscarError, match="store format"):
        fit(str(tmp_path / "x"), _cfg())


def test_shrinkage_helps_small_samples_and_keeps_eigenvectors():
    from oscar.stats.reduce import ledoit_wolf, oas

    rng = np.random.default_rng(4)
    D, n = 16, 20
    lam = np.linspace(3.0, 0.5, D)
    U = np.linalg.qr(rng.standard_normal((D, D)))[0]
    Sigma = (U * lam) @ U.T
    e_raw, e_oas, e_lw = [], [], []
    for _ in range(20):
        X = rng.standard_normal((n, D)) * np.sqrt(lam) @ U.T
        S = X.T @ X / n
        So, rho = oas(S, n)
        Sl, rho_l = ledoit_wolf(S, X)
        assert 0 < rho <= 1 and 0 < rho_l <= 1 and np.isclose(np.trace(So), np.trace(S))
        assert np.allclose(So @ S, S @ So) and np.allclose(Sl @ S, S @ Sl)  # commute: same eigenvectors
        e_raw.append(np.linalg.norm(S - Sigma))
        e_oas.append(np.linalg.norm(So - Sigma))
        e_lw.append(np.linalg.norm(Sl - Sigma))
    assert np.mean(e_oas) < np.mean(e_raw) and np.mean(e_lw) < np.mean(e_raw)


def test_fit_records_shrinkage_for_small_stores(tmp_path):
    p = str(tmp_path / "s")
    write_synthetic_store(p, SynthSpec(num_layers=1, num_kv_heads=1, num_blocks=2, rows=40, reservoir=32))
    m = fit(p, _cfg(clip=False)).meta["layers"][0]
    assert m["shrinkage"]["q"][0] > 0  # 80 rows < 10 * D


def test_report_module_does_not_import_kernels():
    import subprocess
    import sys

    code = ("import sys, oscar.reports.calibration; "
            "sys.exit(any(m.startswith('oscar.kernels') or m == 'oscar.stats.artifact' for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
