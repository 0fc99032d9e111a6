"""Attention-level retrieval on held-out captured q/k/v: shortcuts == brute force; the overlap and
provenance checks fire on overlapping / foreign data and pass on disjoint data; a real tiny model end to end."""

import json
import math

import numpy as np
import pytest
import torch

from oscar.common import OscarError
from oscar.stats.artifact import QuantConfig, identity_artifact
from oscar.validate.attention import (AttnConfig, Window, margin_bin, plan_windows, quantize_stream, run_attention,
                                      sequence_lengths, stream_rows_needed, trial_metrics, window_keys_int2)
from oscar.validate.heldout import NGRAM, check_disjoint, ngram_hashes
from oscar.kernels.simulate import LayerQuant


class _Cfg:
    num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, hidden_size = 1, 4, 2, 16, 64

    def to_dict(self):
        return {k: getattr(self, k) for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                              "head_dim", "hidden_size")}


@pytest.mark.parametrize("quant", [QuantConfig(bits=2), QuantConfig(bits=2, key_axis="channel", group_size=8)])
@pytest.mark.parametrize("n", [64, 61])  # whole groups; a trailing incomplete per-channel group (kept exact)
def test_trials_equal_explicit_loop(quant, n):
    """Stream quantized once + window slice + batched trial == quantizing the context alone and a loop over keys."""
    lq = LayerQuant(identity_artifact(_Cfg(), quant), 0, pages=False)
    G = lq.key_group
    g = torch.Generator().manual_seed(0)
    Hkv, Gq, D, S, s0 = 2, 2, 16, 200, 3
    with torch.random.fork_rng():  # StudentT draws from the global generator: seeded here, whatever ran before
        torch.manual_seed(0)
        Ks = torch.distributions.StudentT(4).sample((Hkv, S, D)) * torch.linspace(0.5, 3, D)  # heavy tails
    Vs = torch.randn(Hkv, S, D, generator=g)
    K0, V0 = torch.randn(Hkv, s0, D, generator=g) * 2, torch.randn(Hkv, s0, D, generator=g)
    Q = torch.randn(Hkv, Gq, D, generator=g) * 2
    Kq, Vq = quantize_stream(lq, Ks, Vs)
    a = 2 * 8  # aligned to every group size used here
    r = trial_metrics(Window(K0, V0, Ks[:, a:a + n], Vs[:, a:a + n]),
                      Window(K0, V0, window_keys_int2(Kq, Ks, a, n, G), Vq[:, a:a + n]), Q)
    # brute force: the context's own INT2 reading (groups from its first non-sink key), then loops
    Kw, Vw = Ks[:, a:a + n].clone(), Vs[:, a:a + n].clone()
    nf = n // G * G
    Kb = Kw.clone()
    Kb[:, :nf] = lq.keys(Kw[None, :, :nf])[0]
    Vb = lq.values(Vw[None])[0]
    for h in range(Hkv):
        for j in range(Gq):
            q = Q[h, j]
            le = [float(Kw[h, t] @ q) for t in range(n)]
            lh = [float(Kb[h, t] @ q) for t in range(n)]
            best = max(range(n), key=lambda t: le[t])
            sec = max((t for t in range(n) if t != best), key=lambda t: le[t])
            assert int(r["needle"][h, j]) == best
            # a float32 dot of D terms is within D u sum|k_i q_i| of exact (u = 2^-24), on either side, and the
            # margin is a difference of two of them: its bound, not a relative one (the difference cancels)
            dot_err = D * 2.0 ** -24 * float((Kw[h, best].abs() @ q.abs()) + (Kw[h, sec].abs() @ q.abs()))
            assert float(r["margin"][h, j]) == pytest.approx((le[best] - le[sec]) / math.sqrt(D), rel=1e-6,
                                                             abs=2 * dot_err / math.sqrt(D))
            rank = sum(1 for t in range(n) if lh[t] > lh[best])
            assert int(r["rank_int2"][h, j]) == rank and float(r["top1"][h, j]) == float(rank == 0)
            full = [float(K0[h, t] @ q) for t in range(s0)] + le
            fullq = [float(K0[h, t] @ q) for t in range(s0)] + lh
            pe = torch.softmax(torch.tensor(full) / math.sqrt(D), 0)
            pq = torch.softmax(torch.tensor(fullq) / math.sqrt(D), 0)
            VV, VVq = torch.cat([V0[h], Vw[h]]), torch.cat([V0[h], Vb[h]])
            o = sum(pe[t] * VV[t] for t in range(s0 + n))
            oh = sum(pq[t] * VVq[t] for t in range(s0 + n))
            assert float(r["out_rel_err"][h, j]) == pytest.approx(float((oh - o).norm() / o.norm()), rel=1e-4)
            assert float(r["needle_weight"][h, j]) == pytest.approx(float(pe[s0 + best]), rel=1e-4)
            assert float(r["needle_weight_int2"][h, j]) == pytest.approx(float(pq[s0 + best]), rel=1e-4)


def test_layout_helpers():
    lens = sequence_lengths(10_000, 4096, 64)
    assert lens[:-1] == [4096, 4096] and sum(n - 64 for n in lens) == 10_000 and 64 < lens[-1] <= 4096
    stream = stream_rows_needed([4096, 8192], 64, 64, 8)
    w = plan_windows([4096, 8192], stream, 64, 64, 8, seed=0)
    for N, aa in w.items():
        assert len(aa) == 8 == len(set(aa)) and all(a % 64 == 0 and a + N - 64 <= stream for a in aa)
    with pytest.raises(OscarError, match="needs"):
        plan_windows([9000], 1000, 64, 64, 8, 0)
    assert margin_bin(0.0) == "0-0.125" and margin_bin(0.3) == "0.25-0.5" and margin_bin(9.0) == ">=4"


def test_ngram_hashes_are_windows():
    t = np.arange(40) % 7
    h = ngram_hashes(t, 5)
    assert len(h) == 36
    for i in range(36):  # equal windows hash equal; t has period 7
        for j in range(36):
            assert (h[i] == h[j]) == bool(np.array_equal(t[i:i + 5], t[j:j + 5]))


def test_overlap_check_fires_on_shared_text_and_passes_on_disjoint():
    rng = np.random.default_rng(0)
    cal = rng.integers(0, 1000, size=(2, 3, 100))                 # (blocks, seqs, T)
    mask = np.ones_like(cal, dtype=np.uint8)
    mask[1, 2, 60:] = 0                                            # padding is not calibration text
    held = [rng.integers(1000, 2000, size=300), rng.integers(1000, 2000, size=90)]
    rep = check_disjoint(held, cal, mask)
    assert rep["shared_ngrams"] == 0 and rep["calibration_tokens"] == int(mask.sum()) and rep["heldout_tokens"] == 390
    # 31 shared tokens are a phrase, not a copied block: passes; 32 refuse
    bad = [held[0].copy(), held[1]]
    bad[0][100:131] = cal[0, 1, 10:41]
    check_disjoint(bad, cal, mask)
    bad[0][100:132] = cal[0, 1, 10:42]
    with pytest.raises(OscarError, match="held-out sequence 0 .* repeats 32 tokens of calibration sequence 1"):
        check_disjoint(bad, cal, mask)
    # a calibration sequence copied whole, anywhere: refused
    with pytest.raises(OscarError, match="repeats"):
        check_disjoint([np.concatenate([held[1], cal[1, 0]])], cal, mask)
    # tokens only under padding do not count
    pad = [np.concatenate([held[1], cal[1, 2, 60:100]])]
    check_disjoint(pad, cal, mask)
    assert NGRAM == 32


# ------------------------------------------------------------------ a real (tiny) model, store and artifact

def _store_and_artifact(tmp, corpus="pydoc", name="s"):
    from oscar.pipeline.calibrate import CalibConfig, calibrate
    from oscar.stats.artifact import save_artifact
    from oscar.stats.fit import FitConfig, fit

    store = str(tmp / f"{name}.zarr")
    calibrate(CalibConfig(model="tiny-qwen3", corpus=corpus, store=store, seq_len=128, sink=4, seqs_per_block=2,
                          tokens=4 * 128, reservoir=32, seed=1, threads=1), progress=False)
    art = str(tmp / f"{name}.safetensors")
    save_artifact(fit(store, FitConfig(variant="centered", progress=False, threads=1)), art)
    return store, art


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _store_and_artifact(tmp_path_factory.mktemp("attn"))


def test_rowcapture_rows_are_what_attention_receives():
    """RowCapture's k/v equal the model's own KV cache (post-RoPE); q reproduces the o_proj input through SDPA."""
    from oscar.pipeline.capture import RowCapture, base_model, install
    from oscar.pipeline.models import load_model

    model, _, _ = load_model("tiny-qwen3")
    ids = torch.arange(5, 45)[None]                                              # (1, 40)
    seen = {}
    attn = base_model(model).layers[2].self_attn
    hook = attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("o", a[0].detach().clone()))
    from oscar.kernels.cpu_attention import native_prefill

    with torch.no_grad(), native_prefill(model):  # the attention the capture's SDPA runs (native on CPU): bit-equal K/V
        ref = base_model(model)(input_ids=ids, use_cache=True).past_key_values
    hook.remove()
    install(model)
    cap = RowCapture(layers=(0, 2))
    with cap.batch(torch.ones_like(ids)):
        base_model(model)(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    for l in (0, 2):
        assert torch.equal(cap.k[l][0], ref.layers[l].keys[0]) and torch.equal(cap.v[l][0], ref.layers[l].values[0])
    q, k, v = cap.q[2][0][None], cap.k[2][0][None], cap.v[2][0][None]
    o = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                         is_causal=True, scale=attn.scaling)  # (1, Hq, T, D)
    torch.testing.assert_close(o.transpose(1, 2).reshape(1, 40, -1), seen["o"], rtol=1e-4, atol=1e-5)


def test_run_attention_end_to_end(tiny, tmp_path):
    import pandas as pd

    store, art = tiny
    cfg = AttnConfig(out=str(tmp_path / "o"), store=store, artifact=art, methods=["naive-int2", "kivi2", "oscar-int2"],
                     lengths=[256, 1024], windows=3, sink=4, seq_len=320, layers=[0, 3])
    summary = run_attention(cfg, progress=False)
    df = pd.read_parquet(tmp_path / "o" / "attention.parquet")
    meta = json.load(open(tmp_path / "o" / "attention.json"))
    Hq = 8
    assert len(df) == 2 * 2 * 3 * 3 * Hq and set(summary.method) == {"naive-int2", "kivi2", "oscar-int2"}
    assert meta["overlap_check"]["shared_ngrams"] == 0 and meta["provenance_check"]["checked"]
    assert meta["heldout"]["tokens"] == sum(meta["sequence_lengths"]) and meta["kind"].startswith("attention-level")
    assert all(n <= 320 for n in meta["sequence_lengths"])
    assert (df.margin >= 0).all() and df.top1.isin([0.0, 1.0]).all() and (df.out_rel_err > 0).all()
    assert (df.margin_bin == df.margin.map(margin_bin)).all()
    assert ((df.rank_int2 == 0) == (df.top1 == 1)).all()
    n = df.length - 4
    assert ((df.needle_back >= 0) & (df.needle_back < n)).all()  # the needle lies inside the context
    assert (df.query_pos == (df.start + n - 1) % 316 + 4).all()  # the query is the context's last token
    # the needle is the same real key for every method (chosen on exact logits)
    per = df.groupby(["layer", "q_head", "length", "window"]).needle_pos.nunique()
    assert (per == 1).all()
    # the report names it for what it is and draws the margin curve
    from oscar.reports.build import build_report

    md = open(build_report(str(tmp_path / "o")).md_path).read()
    sec = md[md.index("## Attention-level retrieval on held-out captured q/k/v (not a model run)"):]
    assert "not an end-to-end model run" in sec and "top-1 kept, by margin (nats)" in sec
    assert f"{meta['heldout']['tokens']:,} held-out tokens" in sec and "no resampling" in sec
    assert (tmp_path / "o" / "report" / "attention_retrieval.png").exists()


def test_run_attention_refuses_overlap_and_foreign_artifact(tiny, tmp_path):
    from oscar.validate.env import heldout_text

    store, art = tiny
    # a corpus made of the held-out text itself: its calibration store shares the held-out sequences' text
    words = heldout_text("pydoc").split()[:3000]
    paras = [" ".join(words[i:i + 300]) for i in range(0, 3000, 300)]
    path = tmp_path / "leak.txt"
    path.write_text("\n\n".join(paras))
    leak_store, leak_art = _store_and_artifact(tmp_path, corpus=str(path), name="leak")
    base = dict(methods=["naive-int2", "oscar-int2"], lengths=[2048], windows=2, sink=4, seq_len=1024, layers=[0])
    with pytest.raises(OscarError, match="repeats 32 tokens of calibration sequence .* refusing"):
        run_attention(AttnConfig(out=str(tmp_path / "o1"), store=leak_store, artifact=leak_art, **base), progress=False)
    with pytest.raises(OscarError, match="fitted on corpus fingerprint"):
        run_attention(AttnConfig(out=str(tmp_path / "o2"), store=leak_store, artifact=art, **base), progress=False)
    assert not (tmp_path / "o1" / "attention.parquet").exists()


def test_attention_bad_inputs(tiny, tmp_path):
    store, art = tiny
    kw = dict(out=str(tmp_path), sink=4, seq_len=256, lengths=[256])
    with pytest.raises(OscarError, match="does not exist"):
        run_attention(AttnConfig(store=str(tmp_path / "nope"), methods=["naive-int2"], **kw), progress=False)
    with pytest.raises(OscarError, match="needs --artifact"):
        run_attention(AttnConfig(store=store, methods=["oscar-int2"], **kw), progress=False)
    with pytest.raises(OscarError, match="out of range"):
        run_attention(AttnConfig(store=store, methods=["naive-int2"], layers=[5], **kw), progress=False)
    with pytest.raises(OscarError, match="exceed the sink"):
        run_attention(AttnConfig(store=store, methods=["naive-int2"], **{**kw, "lengths": [4]}), progress=False)
    with pytest.raises(OscarError, match="exceeds the model's context"):
        run_attention(AttnConfig(store=store, methods=["naive-int2"], **{**kw, "seq_len": 16384}), progress=False)


def test_heldout_sequences_pydoc_then_docstrings():
    from oscar.pipeline.models import load_tokenizer
    from oscar.validate.heldout import heldout_sequences, stdlib_docstrings

    docs = stdlib_docstrings(5000)
    assert docs and all(len(d.split()) >= 8 for d in docs) and len(set(docs)) == len(docs)
    assert stdlib_docstrings(5000) == docs  # deterministic: sorted paths, no imports
    tok = load_tokenizer("tiny-qwen3")
    h = heldout_sequences(tok, 20000, 4096)
    assert [len(s) for s in h.seqs] == [4096] * 4 + [20000 - 4 * 4096]
    assert h.sources[0] == "heldout:pydoc" and h.sources[-1] == "stdlib-docstrings"
    assert h.info["corpus_heldout_tokens"] + h.info["docstring_tokens"] == 20000 and h.info["docstrings"] > 0
    assert heldout_sequences(tok, 20000, 4096).fingerprint == h.fingerprint
