"""Model-level TurboQuant (tq-int2) and SpectralQuant (sq-int2): torch references vs brute force,
the same quantizers as the synthetic ablation's codecs, and the artifacts built from a real store."""

import math

import numpy as np
import pytest
import torch

from oscar.validate import codebooks as cb
from oscar.validate.ablation.schemes import Ctx, TQCodec, lloyd_max


def _nearest(u: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Brute force: the level closest to each entry (every level tried)."""
    return levels[np.abs(u[..., None] - levels).argmin(-1)]


def test_tq_fake_quant_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(2, 3, 7, 64, generator=g) * torch.linspace(0.1, 5, 64)  # (B, Hkv, T, D)
    segs = cb.tq_segments(64)
    assert segs == [(0, 16, 3), (16, 64, 2)]
    got = cb.tq_fake_quant(y, segs).double().numpy()
    want = np.empty_like(got)
    yn = y.double().numpy()
    for a, b, bits in segs:
        levels = lloyd_max(bits, "beta", b - a)[0]
        for idx in np.ndindex(*yn.shape[:-1]):
            v = yn[idx][a:b]
            n = float(np.float16(np.linalg.norm(v)))  # the stored fp16 norm
            want[idx][a:b] = _nearest(v / n, levels) * n
    assert np.allclose(got, want, atol=1e-5 * np.abs(want).max())
    # distortion of a Beta Lloyd–Max code on random directions: 3 bits beat 2 bits
    err = ((got - yn) ** 2)
    rel = [err[..., a:b].sum() / (yn[..., a:b] ** 2).sum() for a, b, _ in segs]
    assert rel[0] < rel[1] < 0.2


def test_tq_single_segment_is_the_ablation_codec():
    """One segment over all of D with the same rotation is schemes.TQCodec (the ablation's TurboQuant)."""
    D = 32
    x = torch.randn(50, D, generator=torch.Generator().manual_seed(1))
    codec = TQCodec(2).fit({"k": x}, "k", Ctx("production", seed=3))
    want = codec.decode(codec.encode(x))
    got = cb.tq_fake_quant(x @ codec.R, [(0, D, 2)]) @ codec.R.T
    assert torch.allclose(got, want, atol=1e-5)


def test_tq_rotation_orthogonal_outliers_first():
    D = 64
    energy = np.random.default_rng(0).random(D)
    energy[[5, 40, 63]] = 100.0
    R = cb.tq_rotation(energy, torch.Generator().manual_seed(0))
    assert torch.allclose(R.T @ R, torch.eye(D, dtype=R.dtype), atol=1e-10)
    # the 3-bit block (first D/4 rotated coordinates) mixes exactly the D/4 highest-energy channels
    rows = set(torch.nonzero(R[:, :16].abs().sum(1) > 0).flatten().tolist())
    assert rows == set(np.argsort(-energy)[:16].tolist()) and {5, 40, 63} <= rows


def test_sq_fake_quant_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    H, D = 2, 16
    std = torch.rand(H, D, generator=g) + 0.2
    widths = torch.tensor([[3, 3, 2, 2] + [1] * 12, [4, 2, 2, 2, 2] + [1] * 10 + [0]])
    y = torch.randn(1, H, 9, D, generator=g) * std[None, :, None, :]
    got = cb.sq_fake_quant(y, widths, std).double().numpy()
    want = np.zeros_like(got)
    yn, sn = y.double().numpy(), std.double().numpy()
    for h in range(H):
        for j in range(D):
            b = int(widths[h, j])
            if b:
                want[0, h, :, j] = _nearest(yn[0, h, :, j] / sn[h, j], lloyd_max(b, "gaussian")[0]) * sn[h, j]
    assert np.allclose(got, want, atol=1e-5)


def test_codec_bits_per_element():
    tq = cb.LayerCodec("tq", segments=cb.tq_segments(64))
    assert tq.bits_per_element(64) == (16 * 3 + 48 * 2 + 32) / 64 == 2.75
    assert cb.LayerCodec("tq", segments=cb.tq_segments(128)).bits_per_element(128) == 2.5  # the paper's D
    sq = cb.LayerCodec("sq", widths=torch.tensor([[5, 5, 1, 1]]), std=torch.ones(1, 4))
    assert sq.bits_per_element(4) == 3.0


# ----------------------------------------------------------------- on a real (tiny) calibration store


@pytest.fixture(scope="module")
def fitted(tiny_store):
    from oscar.stats.fit import FitConfig, fit

    return fit(tiny_store, FitConfig(variant="centered", progress=False, threads=1))


@pytest.mark.parametrize("name", ["tq-int2", "sq-int2"])
def test_layerquant_runs_the_codebook_format(fitted, name):
    """LayerQuant with the method's artifact = centre, rotate, the codebook round trip, rotate back
    (computed here from the artifact's tensors and the brute-force nearest level)."""
    from oscar.pipeline.models import load_config
    from oscar.kernels.simulate import LayerQuant
    from oscar.validate.methods import bits_per_element, method_artifact

    config = load_config("tiny-llama")
    art = method_artifact(name, config, fitted)
    assert method_artifact(name, config, fitted) is art  # cached per store
    l, H, D = 1, art.num_kv_heads, art.head_dim
    lq = LayerQuant(art, l)
    k = torch.randn(1, H, 16, D, generator=torch.Generator().manual_seed(4)) * 2
    if name == "sq-int2":  # SQ's codebook is scaled to the calibrated spectrum: rows drawn from it
        std = art.extra[f"layers.{l}.std_k"][:, None, :]  # (H, 1, D)
        k = (k / 2 * std) @ art.rot_k[l].transpose(-1, -2) + art.k_mean[l][:, None, :]
    got_k, got_v = lq.keys(k).double(), lq.values(k).double()
    R, Rv = art.rot_k[l].double(), art.rot_v[l].double()
    mu = art.k_mean[l].double()[None, :, None, :]
    if name == "tq-int2":
        assert torch.allclose(R @ R.transpose(-1, -2), torch.eye(D, dtype=R.dtype).expand(H, D, D), atol=1e-5)
        yk, yv = (k.double() - mu) @ R, k.double() @ Rv
        want_k = torch.from_numpy(_tq_brute(yk.numpy(), cb.tq_segments(D))) @ R.transpose(-1, -2) + mu
        want_v = torch.from_numpy(_tq_brute(yv.numpy(), cb.tq_segments(D))) @ Rv.transpose(-1, -2)
        assert bits_per_element(art, D) == pytest.approx((D // 4 * 3 + 3 * D // 4 * 2 + 32) / D)
    else:
        vm = art.extra[f"layers.{l}.v_mean"].double()[None, :, None, :]
        yk, yv = (k.double() - mu) @ R, (k.double() - vm) @ Rv
        wk, wv = (art.extra[f"layers.{l}.widths_{s}"] for s in "kv")
        sk, sv = (art.extra[f"layers.{l}.std_{s}"].double() for s in "kv")
        want_k = torch.from_numpy(_sq_brute(yk.numpy(), wk, sk.numpy())) @ R.transpose(-1, -2) + mu
        want_v = torch.from_numpy(_sq_brute(yv.numpy(), wv, sv.numpy())) @ Rv.transpose(-1, -2) + vm
        assert (wk.sum(-1) == 2 * D).all() and (wv.sum(-1) == 2 * D).all()  # the 2-bit budget, no metadata
        assert bits_per_element(art, D) == 2.0
    tol = 1e-4 * float(k.abs().max())
    assert (got_k - want_k).abs().max() < tol and (got_v - want_v).abs().max() < tol
    # quantization really happened, and it is a fair INT2 code (error well below the signal)
    rel = float(((got_k - k) ** 2).sum() / (k**2).sum())
    assert 1e-4 < rel < 0.5


def _tq_brute(y, segs):
    out = np.empty_like(y)
    for a, b, bits in segs:
        levels = lloyd_max(bits, "beta", b - a)[0]
        for idx in np.ndindex(*y.shape[:-1]):
            n = float(np.float16(np.linalg.norm(y[idx][a:b])))
            out[idx][a:b] = _nearest(y[idx][a:b] / n, levels) * n
    return out


def _sq_brute(y, widths, std):
    out = np.zeros_like(y)
    for h in range(y.shape[1]):
        for j in range(y.shape[-1]):
            b = int(widths[h, j])
            if b:
                out[:, h, :, j] = _nearest(y[:, h, :, j] / std[h, j], lloyd_max(b, "gaussian")[0]) * std[h, j]
    return out


def test_codebook_methods_need_the_store(fitted, tmp_path):
    from dataclasses import replace

    from oscar.common import OscarError
    from oscar.pipeline.models import load_config
    from oscar.validate.methods import method_artifact

    config = load_config("tiny-llama")
    with pytest.raises(OscarError, match="tq-int2 needs --artifact"):
        method_artifact("tq-int2", config, None)
    gone = replace(fitted, meta=dict(fitted.meta, provenance=dict(fitted.meta["provenance"], store=str(tmp_path / "gone"),
                                                                 store_fingerprint="x")))
    with pytest.raises(OscarError, match="does not exist"):
        method_artifact("sq-int2", config, gone)


def test_every_method_has_a_note_the_report_lists():
    """Each registered method says what it is and what it lacks; memory.json carries it to the report."""
    from oscar.pipeline.models import load_config
    from oscar.reports.build import _memory_section
    from oscar.stats.artifact import identity_artifact
    from oscar.validate.methods import METHOD_NOTES, METHODS, memory_row
    from oscar.scoring.protocols import SERVING

    assert set(METHODS) <= set(METHOD_NOTES) and all(METHOD_NOTES[m] for m in METHODS)
    assert "re-implementation" in METHOD_NOTES["oscar-ref-int2"]
    config = load_config("tiny-llama")
    mem = [memory_row(m, None if m == "bf16" else identity_artifact(config), config, 1024, SERVING) for m in METHODS]
    md = "\n".join(_memory_section(mem))
    for m in METHODS:
        assert f"- `{m}`: {METHOD_NOTES[m]}" in md


def test_searched_baselines_get_their_formats_knobs(fitted):
    """kivi2-clip / hadamard-clip-int2: the data-free baselines' formats, with clips from oscar-int2's
    search on the same store (and centering where it is not a no-op)."""
    from oscar.pipeline.models import load_config
    from oscar.validate.methods import method_artifact, searched_baseline
    from oscar.validate.ablation.schemes import hadamard as sylvester

    config = load_config("tiny-llama")
    kc = method_artifact("kivi2-clip", config, fitted)
    assert (kc.quant.key_axis, kc.quant.group_size) == ("channel", 32)  # kivi2's 64 where head_dim allows (here 32)
    assert kc.k_mean is None and all(torch.equal(r, torch.eye(kc.head_dim).expand_as(r)) for r in kc.rot_k)
    hc = searched_baseline("hadamard-clip-int2", fitted)
    assert hc.k_mean is not None and hc.quant.key_axis == "token"
    for a in (kc, hc):
        assert a.meta["fit"]["clip_searched"] and a.quant.page_size == fitted.quant.page_size
        assert a.meta["provenance"]["store"] == fitted.meta["provenance"]["store"]
        assert any((c < 1).any() for c in a.clip_k + a.clip_v)  # the search moved some clip off 1.0
    H = sylvester(hc.head_dim).float()
    assert torch.allclose(hc.rot_k[0][0].abs(), H.abs(), atol=1e-6)  # a Hadamard (column order aside)
