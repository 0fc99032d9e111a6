"""The latent attention-level test: its errors against a brute-force reading of the same rows in the expanded
(per-head K/V) form, its summary, its refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from oscar.common import OscarError
from oscar.kernels.latent import LatentLayerQuant
from oscar.pipeline import capture as C
from oscar.pipeline.calibrate import CalibConfig, calibrate
from oscar.pipeline.models import load_model
from oscar.stats.latent import LatentFitConfig, fit_latent
from oscar.validate.latent_attention import LatentAttnConfig, layer_errors, record_layers, run_latent_attention


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("la") / "calib.zarr"
    calibrate(CalibConfig(model="tiny-glm5", store=str(path), seq_len=96, sink=4, seqs_per_block=1, tokens=96 * 2,
                          reservoir=32, threads=1), progress=False)
    return str(path)


def test_errors_equal_the_expanded_form(store):
    """Score and output errors of one layer recomputed from per-head keys and values expanded through kv_b_proj, the
    way transformers reads the latent (no absorbed form)."""
    model, tok, _ = load_model("tiny-glm5", attn_implementation="eager", latent=True)
    C.install(model, "eager")
    ids = np.asarray(tok("A held-out sentence for the latent test. " * 12)["input_ids"][:120])
    rec = record_layers(model, [ids])[0][2]
    art = fit_latent(store, LatentFitConfig(variant="attention"))
    lq = LatentLayerQuant(art, 2)
    sink, recent = 4, 32
    got = layer_errors(rec, lq, sink, recent)
    m = rec["module"]
    H, dn, dv = m.num_heads, m.qk_nope_head_dim, m.v_head_dim
    W = m.kv_b_proj.weight.detach().double()                                      # (H (dn + dv), r)
    c = rec["c"][0].double()                                                       # (T, r)
    T = c.shape[0]
    b = lq.quantized_until(T, sink, recent)
    c_hat = c.clone()
    c_hat[sink:b] = lq.latents(c[sink:b].float()).double()                         # the history as served
    kv, kv_hat = (c @ W.T).view(T, H, dn + dv), (c_hat @ W.T).view(T, H, dn + dv)  # expanded per head
    q = rec["q"][0].double()                                                       # (H, T, dn + dr)
    kp = rec["k_pe"][0].double()
    logits = lambda kvx: (torch.einsum("htd,shd->hts", q[..., :dn], kvx[..., :dn])  # noqa: E731
                          + (q[..., dn:] @ kp.T)) * rec["scale"]
    le, lh = logits(kv), logits(kv_hat)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    hist = torch.zeros(T, dtype=torch.bool)
    hist[sink:b] = True
    sel = causal & hist[None, :]
    latent_part = torch.einsum("htd,shd->hts", q[..., :dn], kv[..., :dn])          # the logits' latent part
    want_score = float(((lh - le)[:, sel] / rec["scale"]).square().sum() / latent_part[:, sel].square().sum())
    assert got["score_err"] == pytest.approx(want_score, rel=1e-4)                 # float32 absorbed vs float64 here
    mask = rec["mask"][0, 0].double()                                              # additive (T, T), DSA applied
    o = lambda l, kvx: torch.einsum("hts,shd->thd", torch.softmax(l + mask, -1), kvx[..., dn:])  # noqa: E731
    oe, oq = o(le, kv), o(lh, kv_hat)
    assert got["output_err"] == pytest.approx(float((oq - oe).square().sum() / oe.square().sum()), rel=1e-3)
    ov = o(le, kv_hat) - oe                                                        # exact scores, INT2 values
    assert got["value_err"] == pytest.approx(float(ov.square().sum() / oe.square().sum()), rel=1e-3)


def test_run_writes_every_unit_and_pairs_the_fits(store, tmp_path):
    s = run_latent_attention(LatentAttnConfig(store=store, out=str(tmp_path), seq_len=128, sequences=2, sink=4,
                                              recent=32))
    df = pd.read_parquet(tmp_path / "latent_attention.parquet")
    assert len(df) == 4 * 3 * 2 and set(df.variant) == {"attention", "reference", "hadamard", "identity"}
    assert (df[["score_err", "value_err", "output_err"]] > 0).all().all()
    assert set(s["attention_vs_reference"]) == {"score_err", "value_err", "output_err"}
    assert json.load(open(tmp_path / "latent_attention.json"))["disjoint"]["shared_ngrams"] == 0


def test_refusals(store, tmp_path):
    with pytest.raises(OscarError, match="unknown latent variant"):
        LatentAttnConfig(store=store, out=str(tmp_path), variants=["scaled"])
    p = subprocess.run([sys.executable, "-m", "oscar", "validate", "latent-attention", "--store", str(tmp_path / "no"),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
