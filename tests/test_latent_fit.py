"""The latent (MLA) fit against brute force: each variant's rotation from its statistic, the mean, the per-group
clip search; the artifact round trip and every refusal between latent and per-head files."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from oscar.common import OscarError
from oscar.pipeline.calibrate import CalibConfig, calibrate
from oscar.pipeline.store import CalibStore, reduce
from oscar.stats.artifact import (LatentQuant, load_artifact, load_latent_artifact, save_artifact,
                                  save_latent_artifact, identity_artifact)
from oscar.stats.hadamard import bitrev_perm
from oscar.stats.latent import LatentFitConfig, fit_latent, group_errors, mixer
from oscar.modelconfig import preset_config


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("latent-fit") / "calib.zarr"
    # 3 blocks (the block-wise estimators and the stability check need them), 96-token windows
    calibrate(CalibConfig(model="tiny-deepseek-v3", store=str(path), seq_len=96, sink=4, seqs_per_block=1,
                          tokens=96 * 3, reservoir=64, threads=1), progress=False)
    return str(path)


def _moments(store: str, l: int) -> dict:
    st = CalibStore(store)
    r = {k: reduce(st, k, [l])[l] for k in ("c_gram", "qa_gram", "c_sum", "count", "q_count")}
    return {"Cc": r["c_gram"] / r["count"], "Cq": r["qa_gram"] / r["q_count"], "mean": r["c_sum"] / r["count"]}


@pytest.mark.parametrize("variant,stat", [("attention", "Cq"), ("reference", "Cc")])
def test_rotation_is_the_statistic_s_eigenbasis_then_the_mixer(store, variant, stat):
    art = fit_latent(store, LatentFitConfig(variant=variant, clip=False))
    for l in range(art.num_layers):
        R = art.rot[l].double().numpy()
        np.testing.assert_allclose(R @ R.T, np.eye(R.shape[0]), atol=1e-6)  # float32 storage of an orthogonal R
        m = _moments(store, l)
        # undo the fixed factor: the columns left must diagonalise the statistic, eigenvalues in descending order
        V = R @ mixer(R.shape[0], 128).T
        D = V.T @ m[stat] @ V
        scale = np.abs(m[stat]).max()
        assert np.abs(D - np.diag(np.diag(D))).max() < 1e-5 * scale
        d = np.diag(D)
        np.testing.assert_allclose(np.sort(d), np.linalg.eigvalsh(m[stat]), atol=1e-6 * scale)
        if not art.meta["layers"][l]["pruned"]:  # spurious leading eigenvalues re-rank their directions
            assert (np.diff(d) <= 1e-6 * scale).all()
        mean = art.mean[l].double().numpy()
        np.testing.assert_allclose(mean, m["mean"] if variant == "attention" else 0, rtol=1e-6, atol=1e-7)
    if variant == "attention":  # the diagnostics come from the blocks: a stability per layer
        assert all(np.isfinite(d["stability"]) for d in art.meta["layers"])


def test_bit_reversal_deals_the_leading_directions_to_every_group():
    r, g = 512, 128
    perm = bitrev_perm(r)
    # (x @ P)[j] = x[perm[j]]: eigen-direction i lands at output position where perm == i
    pos = np.argsort(perm)
    assert sorted(pos[i] // g for i in range(r // g)) == list(range(r // g))


def _minmax(x: torch.Tensor, ratio: float, bits: int = 2) -> torch.Tensor:
    """An independent 2-bit minmax quantizer of whole rows (one group): range [min, max] x ratio, round half up."""
    lo, hi = x.min(-1, keepdim=True).values * ratio, x.max(-1, keepdim=True).values * ratio
    s = ((hi - lo) / (2**bits - 1)).clamp_min(1e-8)
    return (((x - lo) / s + 0.5).floor().clamp(0, 2**bits - 1)) * s + lo


def test_group_errors_equal_brute_force():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 256, generator=g) * torch.linspace(0.2, 3.0, 256)      # (N, r)
    A = torch.randn(256, 256, generator=g)
    W = [A @ A.T / 256, torch.eye(256)]
    ratios = np.array([0.6, 0.8, 1.0])
    got = group_errors(x, W, LatentQuant(), ratios)
    for i, c in enumerate(ratios):
        for j in range(2):
            s = slice(128 * j, 128 * (j + 1))
            e = _minmax(x[:, s].double(), c) - x[:, s].double()
            want = sum(float(((e @ Wm[s, s].double()) * e).sum() / ((x.double() @ Wm.double()) * x.double()).sum())
                       for Wm in W)
            assert got[i, j] == pytest.approx(want, rel=1e-4)  # float32 products in the fit, float64 here


def test_clips_minimise_the_weighted_error(store):
    art = fit_latent(store, LatentFitConfig())
    for d in art.meta["layers"]:
        assert all(e <= n + 1e-12 for e, n in zip(d["err"], d["err_noclip"]))
        assert all(0.5 <= c <= 1.0 for c in d["clip"])
    assert any(c < 1.0 for d in art.meta["layers"] for c in d["clip"])  # INT2 minmax gains from clipping


def test_latent_artifact_round_trip_and_refusals(store, tmp_path):
    art = fit_latent(store, LatentFitConfig())
    p = str(tmp_path / "lat.safetensors")
    save_latent_artifact(art, p)
    back = load_latent_artifact(p)
    assert all(torch.equal(a, b) for a, b in zip(art.rot + art.mean + art.clip, back.rot + back.mean + back.clip))
    back.check_model(preset_config("tiny-deepseek-v3"))
    with pytest.raises(OscarError, match="latent artifact does not match the model .kv_lora_rank: artifact 256 vs "
                                         "model 512"):
        other = preset_config("tiny-deepseek-v3")
        other.kv_lora_rank = 512
        back.check_model(other)
    with pytest.raises(OscarError, match="is a latent .MLA. artifact"):
        load_artifact(p)  # a per-head reader
    q = str(tmp_path / "gqa.safetensors")
    save_artifact(identity_artifact(preset_config("tiny-llama")), q)
    with pytest.raises(OscarError, match="is a per-head artifact"):
        load_latent_artifact(q)


def test_fit_cli_on_a_latent_store(store, tmp_path):
    out = tmp_path / "a.safetensors"
    run = lambda *a: subprocess.run([sys.executable, "-m", "oscar", "fit", store, "--out", str(out), *a],  # noqa: E731
                                    capture_output=True, text=True)
    p = run()
    assert p.returncode == 2 and "no per-layer widths; pass --widths none" in p.stderr and not out.exists()
    p = run("--no-tune", "--widths", "none", "--variant", "oscar")
    assert p.returncode == 2 and "--variant oscar is a per-head recipe" in p.stderr and not out.exists()
    p = run("--no-tune", "--widths", "none", "--variant", "reference")
    assert p.returncode == 0, p.stderr
    assert load_latent_artifact(str(out)).meta["variant"] == "reference"
    p = subprocess.run([sys.executable, "-m", "oscar", "inspect", str(out)], capture_output=True, text=True)
    assert p.returncode == 0 and "oscar-latent-artifact/1, variant reference" in p.stdout


def test_per_head_fit_refuses_a_latent_store(store):
    from oscar.stats.fit import fit

    with pytest.raises(OscarError, match="is a latent store .oscar-calib-latent/1"):
        fit(store)


def test_export_import_latent_rotations_bit_for_bit(store, tmp_path):
    art = fit_latent(store, LatentFitConfig())
    a = str(tmp_path / "a.safetensors")
    save_latent_artifact(art, a)
    run = lambda *x: subprocess.run([sys.executable, "-m", "oscar", *x], capture_output=True, text=True)  # noqa: E731
    p = run("export", a, "--format", "sglang-oscar", "--out", str(tmp_path / "sg"))
    assert p.returncode == 0, p.stderr
    obj = torch.load(tmp_path / "sg" / "latent_rotation_oscar.pt", weights_only=True)
    assert obj["kind"] == "mla_latent" and obj["group_size"] == 128 and obj["layers"][0]["rotation"].shape == (256, 256)
    p = run("import", str(tmp_path / "sg"), "--format", "sglang-oscar", "--out", str(tmp_path / "b.safetensors"),
            "--model", "tiny-deepseek-v3")
    assert p.returncode == 0, p.stderr
    back = load_latent_artifact(str(tmp_path / "b.safetensors"))
    assert all(torch.equal(x, y) for x, y in zip(art.rot + art.mean + art.clip, back.rot + back.mean + back.clip))
    assert back.quant == art.quant and back.meta["variant"] == art.meta["variant"]
    p = run("export", a, "--format", "gguf-rot", "--out", str(tmp_path / "g"))
    assert p.returncode == 2 and "exports as --format sglang-oscar" in p.stderr and not (tmp_path / "g").exists()
    p = run("import", str(tmp_path / "sg"), "--format", "sglang-oscar", "--out", str(tmp_path / "c.safetensors"),
            "--model", "tiny-glm5")  # another model's shapes / config: refused, nothing written
    assert p.returncode == 2 and "latent artifact does not match the model" in p.stderr
    assert not (tmp_path / "c.safetensors").exists()
