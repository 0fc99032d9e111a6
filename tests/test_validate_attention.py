"""Attention-level retrieval on store reservoirs: shortcut == brute force; obvious cases behave."""

import numpy as np
import pytest
import torch

from oscar.common import OscarError
from oscar.stats.artifact import QuantConfig, identity_artifact
from oscar.validate.attention import AttnConfig, _ShapeConfig, run_attention, trial_metrics
from oscar.validate.methods import LayerQuant


def _store(path, L=2, H=2, D=16, B=2, R=40, seed=0):
    """A store with the public reservoir arrays (docs/store-format.md), heavy-tailed rows."""
    import zarr

    g = zarr.open_group(str(path), mode="w")
    g.attrs.update(format="oscar-calib/1", model={"name": "t", "fingerprint": None, "num_layers": L, "num_q_heads": 2 * H,
                                                  "num_kv_heads": H, "head_dim": D})
    rng = np.random.default_rng(seed)
    g.create_array("done", data=np.ones((B, L), np.uint8))
    for l in range(L):
        for x in ("q", "k", "v"):
            a = rng.standard_t(4, size=(B, H, R, D)).astype(np.float32)
            a[..., 0] *= 8  # an outlier channel, as real keys have
            g.create_array(f"layers/{l}/{x}_res", data=a)
        g.create_array(f"layers/{l}/res_count", data=np.array([R, R - 5], np.int64))
    return str(path)


@pytest.mark.parametrize("quant", [QuantConfig(bits=2), QuantConfig(bits=2, key_axis="channel", group_size=8)])
def test_trial_shortcut_equals_full_quantization(quant):
    cfg = _ShapeConfig({"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                        "hidden_size": 64})
    lq = LayerQuant(identity_artifact(cfg, quant), 0)
    g = torch.Generator().manual_seed(0)
    N, sink = 100, 4
    K, V = torch.randn(2, N, 16, generator=g), torch.randn(2, N, 16, generator=g)
    G = lq.key_group
    bk = sink + (N - sink) // G * G
    Kq, Vq = K.clone(), V.clone()
    Kq[:, sink:bk] = lq.keys(K[None, :, sink:bk])[0]
    Vq[:, sink:] = lq.values(V[None, :, sink:])[0]
    for pos in (sink, 37, 99):
        h, q = 1, torch.randn(16, generator=g)
        kn, vn = torch.randn(16, generator=g) * 3, torch.randn(16, generator=g)
        r = trial_metrics(lq, K, V, Kq, Vq, h, q, pos, kn, vn, sink)
        # brute force: plant, quantize everything, attend
        Kp, Vp = K.clone(), V.clone()
        Kp[h, pos], Vp[h, pos] = kn, vn
        Kb, Vb = Kp.clone(), Vp.clone()
        Kb[:, sink:bk] = lq.keys(Kp[None, :, sink:bk])[0]
        Vb[:, sink:] = lq.values(Vp[None, :, sink:])[0]
        pe = torch.softmax(Kp[h] @ q / 4, 0)
        pq = torch.softmax(Kb[h] @ q / 4, 0)
        o, oh = pe @ Vp[h], pq @ Vb[h]
        assert r["top1"] == float(int((Kb[h] @ q).argmax()) == pos)
        assert r["out_rel_err"] == pytest.approx(float((oh - o).norm() / o.norm()), rel=1e-4)
        assert r["needle_weight_int2"] == pytest.approx(float(pq[pos]), rel=1e-4)


def test_run_attention_on_store(tmp_path):
    store = _store(tmp_path / "s.zarr")
    easy = run_attention(AttnConfig(out=str(tmp_path / "o"), store=store, methods=["naive-int2", "hadamard-int2"],
                                    lengths=[256, 1000], trials=4, margin=30.0, sink=8), progress=False)
    assert (easy.top1 == 1.0).all()  # a needle 30 std ahead survives INT2
    assert (easy.out_rel_err > 0).all()
    import pandas as pd

    df = pd.read_parquet(tmp_path / "o" / "attention.parquet")
    assert len(df) == 2 * 2 * 2 * 4 and set(df.length) == {256, 1000}
    hard = run_attention(AttnConfig(out=str(tmp_path / "h"), store=store, methods=["naive-int2"], lengths=[1000],
                                    trials=8, margin=0.01, sink=8), progress=False)
    assert hard.top1.iloc[0] < 1.0  # a needle barely ahead is lost by naive INT2 at least sometimes


def test_attention_bad_inputs(tmp_path):
    with pytest.raises(OscarError, match="does not exist"):
        run_attention(AttnConfig(out=str(tmp_path), store=str(tmp_path / "nope"), methods=["naive-int2"]), progress=False)
    store = _store(tmp_path / "s.zarr")
    with pytest.raises(OscarError, match="needs --artifact"):
        run_attention(AttnConfig(out=str(tmp_path), store=store, methods=["oscar-int2"]), progress=False)
    with pytest.raises(OscarError, match="out of range"):
        run_attention(AttnConfig(out=str(tmp_path), store=store, methods=["naive-int2"], layers=[5]), progress=False)
