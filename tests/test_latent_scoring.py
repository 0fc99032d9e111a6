"""Needles and perplexity of an MLA model through its INT2 latent cache (oscar/scoring/latent.py, validate niah/ppl)."""

import json
import os

import pandas as pd
import pytest
import torch

from oscar.common import OscarError
from oscar.kernels.latent import LatentSimCache
from oscar.kernels.protocol import Protocol
from oscar.pipeline.calibrate import CalibConfig, calibrate
from oscar.pipeline.models import load_model
from oscar.scoring.latent import latent_window_nll, page_chunks
from oscar.scoring.nll import hidden_nll, window_nll
from oscar.stats.artifact import save_latent_artifact
from oscar.stats.latent import LatentFitConfig, fit_latent
from oscar.validate.niah import NiahConfig, run_niah
from oscar.validate.ppl import PplConfig, run_ppl


def _fit(d, name):
    store = str(d / f"{name}.zarr")
    calibrate(CalibConfig(model=name, store=store, seq_len=96, sink=4, seqs_per_block=1, tokens=96 * 2,
                          reservoir=32, threads=1), progress=False)
    art = fit_latent(store, LatentFitConfig())
    path = str(d / f"{name}.safetensors")
    save_latent_artifact(art, path)
    return path, art


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("ls"), "tiny-glm5")


def _ids(tok, n):
    return tok("Pages of latents leave the recent window one at a time. " * 20, return_tensors="pt").input_ids[:, :n]


# GLM-5's DSA indexer picks its top-k among index scores that a random-init model ties at zero (ReLU), and
# transformers breaks those ties differently per chunking once the top-k binds (past 64 tokens in tiny-glm5):
# its windows stay within 64 tokens; DeepSeek-V3 has no indexer.
@pytest.mark.parametrize("name,T,recent", [("tiny-deepseek-v3", 83, 0), ("tiny-deepseek-v3", 83, 16),
                                           ("tiny-glm5", 62, 16)])
def test_page_chunks_read_what_token_by_token_decoding_reads(fitted, tmp_path, name, T, recent):
    """One page per chunk gives every query the history token-by-token decoding through the same cache gives it
    (INT2 once its page ended more than `recent` tokens before); chunks off the page grid do not."""
    art = fitted[1] if name == "tiny-glm5" else _fit(tmp_path, name)[1]
    model, tok, _ = load_model(name, latent=True)
    ids = _ids(tok, T)  # not a whole number of pages
    proto = Protocol("p", sink=4, recent=recent)

    def hidden(chunks):
        cache = LatentSimCache(art, sink=proto.sink, recent=proto.recent)
        with torch.no_grad():
            return torch.cat([model.model(input_ids=ids[:, a:b], cache=cache, use_cache=True).last_hidden_state
                              for a, b in chunks], 1)  # (1, T, H)

    T = ids.shape[1]
    steps = hidden([(t, t + 1) for t in range(T)])
    paged = hidden(page_chunks(T, proto.sink, proto.recent, art.quant.page_size))
    # float32 re-association between chunkings; an INT2 page read one page early moves states by ~1e-2 of their scale
    tol = dict(rtol=1e-4, atol=1e-4 * steps.abs().max().item())
    torch.testing.assert_close(paged, steps, **tol)
    shifted = hidden([(0, 4 + recent + 8)] + [(a, min(a + 16, T)) for a in range(4 + recent + 8, T, 16)])
    assert not torch.allclose(shifted, steps, **tol)
    nll = latent_window_nll(model, art, proto, ids, prefixes=(40,))
    want = hidden_nll(model.lm_head, steps, ids, prefixes=(40,))
    assert nll[1] == want[1] and abs(nll[0] - want[0]) < 1e-3 * want[0]
    assert abs(nll[2][0][0] - want[2][0][0]) < 1e-3 * want[2][0][0]
    assert abs(nll[0] - window_nll(model, ids)[0]) > 1e-3  # INT2 showed


def test_validate_needles_and_perplexity_of_an_mla_model(fitted, tmp_path):
    path = fitted[0]
    out = str(tmp_path / "niah")
    df = run_niah(NiahConfig(out=out, model="tiny-glm5", artifact=path, methods=["bf16", "oscar-int2", "hadamard-int2"],
                             tasks=["niah_single_1"], lengths=[256], samples=2, protocol="strict"), progress=False,
                  workers=1)
    assert sorted(df.method) == ["bf16", "hadamard-int2", "oscar-int2"] and set(df.samples) == {2}
    bpe = df.set_index("method").bits_per_element
    assert bpe["bf16"] == 16 and bpe["oscar-int2"] == 2.5  # 2 bits + fp32 scale and zero per 128 values
    lines = [json.loads(l) for l in open(os.path.join(out, "niah_samples.jsonl"))]
    assert len(lines) == 6 and all(l["prompt_tokens"] > 200 for l in lines)
    mem = {(r["method"], r["protocol"], r["context"]): r for r in json.load(open(os.path.join(out, "memory.json")))}
    # per history token over 2 layers: 128 B codes... of a 256-value latent: 64 B codes + 16 B scales + 2 x 32 B RoPE
    hist = mem[("oscar-int2", "strict", 32768)]["bytes_per_token_history"]
    from oscar.modelconfig import preset_config
    from oscar.common import latent_shapes

    s = latent_shapes(preset_config("tiny-glm5"))
    L, r, p = s["num_layers"], s["kv_lora_rank"], s["rope_dim"]
    assert hist == L * (r * 2 / 8 + (r // 128) * 2 * 4 + p * 2 + 4 / 16)  # + the page table's 4 B per 16 tokens
    from oscar.reports.build import build_report

    build_report(out)  # the report's memory section reads the latent cache's rows as such
    rep = open(os.path.join(out, "report.md")).read()
    assert "## Memory (latent cache bytes per token: c_kv + RoPE key" in rep and "K+V bytes" not in rep

    pout = str(tmp_path / "ppl")
    pdf = run_ppl(PplConfig(out=pout, model="tiny-glm5", artifact=path, methods=["bf16", "oscar-int2"], contexts=[128],
                            protocols=["strict", "serving"], tokens=256), progress=False, workers=1)
    win = [json.loads(l) for l in open(os.path.join(pout, "ppl_windows.jsonl"))]
    assert sorted((w["method"], w["protocol"]) for w in win) == [("bf16", "-")] * 2 + [("oscar-int2", "serving")] * 2 \
        + [("oscar-int2", "strict")] * 2  # bf16 once, whatever the protocol
    ppl = pdf.set_index(["method", "protocol"]).ppl
    assert ppl["oscar-int2", "strict"] != ppl["bf16", "strict"]  # INT2 read from position 80 on (sink 64, pages)
    # serving keeps the first 64 + 256 tokens exact: a 128-token window is the plain model's, up to float rounding
    assert ppl["oscar-int2", "serving"] == pytest.approx(ppl["bf16", "serving"], rel=1e-5)


def test_needles_through_the_paged_latent_cache_equal_the_simulator(fitted, tmp_path):
    """`--engine cache`: the INT2 rows through the paged latent cache, every step decoded by its kernel (the torch
    reference on CPU), answer as the simulator does (the two read the same INT2 history)."""
    kw = dict(model="tiny-glm5", artifact=fitted[0], methods=["bf16", "oscar-int2"], tasks=["niah_single_1"],
              lengths=[200], samples=2, protocol="strict")
    run_niah(NiahConfig(out=str(tmp_path / "sim"), **kw), progress=False, workers=1)
    run_niah(NiahConfig(out=str(tmp_path / "cache"), engine="cache", **kw), progress=False, workers=1)
    preds = [{(r["index"], r["method"]): r["pred"] for r in map(json.loads, open(tmp_path / d / "niah_samples.jsonl"))}
             for d in ("sim", "cache")]
    assert len(preds[0]) == 4 and preds[0] == preds[1]


def test_latent_runs_refuse_what_they_cannot_serve(fitted, tmp_path):
    path = fitted[0]
    base = dict(out=str(tmp_path / "x"), model="tiny-glm5", artifact=path, tasks=["niah_single_1"], lengths=[256],
                samples=1)
    with pytest.raises(OscarError, match="kivi2 cannot run on model tiny-glm5 .kivi2: quantizes per-head K/V"):
        run_niah(NiahConfig(methods=["bf16", "kivi2"], **base), progress=False)
    with pytest.raises(OscarError, match="--engine cache is built for needles in one process"):
        run_ppl(PplConfig(out=str(tmp_path / "x"), model="tiny-glm5", artifact=path, methods=["oscar-int2"],
                          contexts=[64], tokens=64, engine="cache"), progress=False)
    with pytest.raises(OscarError, match="strict-token.*whole pages"):
        run_ppl(PplConfig(out=str(tmp_path / "p"), model="tiny-glm5", artifact=path, methods=["oscar-int2"],
                          contexts=[64], protocols=["strict-token"], tokens=64), progress=False, workers=1)
    assert not os.path.exists(str(tmp_path / "x"))


def test_a_prefill_handed_to_the_latent_backend_keeps_the_dsa_indexer_keys(fitted):
    """GLM-5's indexer scores every past key at each step: a prefill taken over without its indexer keys would
    let the next token attend to itself alone."""
    from transformers import DynamicCache

    from oscar.kernels.backends import CacheSpec, make_cache

    art = fitted[1]
    model, tok, _ = load_model("tiny-glm5", latent=True)
    ids = _ids(tok, 81)  # past the top-k of 64: the indexer chooses
    proto = Protocol("p", sink=4, recent=0)
    with torch.no_grad():
        direct = LatentSimCache(art, sink=4, recent=0)
        model(ids[:, :80], cache=direct, use_cache=True)
        want = model(ids[:, 80:], cache=direct, use_cache=True).logits
        pre = DynamicCache(config=model.config)
        model(ids[:, :80], cache=pre, use_cache=True)
        for a in (art, None):
            got = model(ids[:, 80:], cache=make_cache(CacheSpec.one(a, proto, prefill=pre), "latent"), use_cache=True).logits
            if a is None:
                exact = LatentSimCache(art, sink=1024)
                model(ids[:, :80], cache=exact, use_cache=True)
                want = model(ids[:, 80:], cache=exact, use_cache=True).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert pre.layers[0].indexer_keys.shape[1] == 80  # the prefill itself untouched


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_needles_and_perplexity_on_two_stages_equal_one_process(fitted, ray_head, tmp_path):
    """tiny-glm5 on 2 stages of a real local Ray cluster (the boundary before layer 2: layer 1 reuses layer 0's DSA
    top-k), each stage its own layers' latent cache: the same greedy answers and, up to float summation order (the
    last stage sums float64 per-token NLLs, one process float32 chunks of 512: < 1e-6 relative), the same window NLLs."""
    from oscar.cluster.pipeline import ClusterConfig
    from oscar.cluster.scoring import StagedScorer
    from oscar.common import set_threads

    path = fitted[0]
    nk = dict(model="tiny-glm5", artifact=path, methods=["bf16", "oscar-int2"], tasks=["niah_single_1"],
              lengths=[200], samples=2, protocol="strict")
    pk = dict(model="tiny-glm5", artifact=path, methods=["bf16", "oscar-int2"], contexts=[120],
              protocols=["strict"], tokens=240)
    set_threads(1)  # each stage actor runs one thread
    run_niah(NiahConfig(out=str(tmp_path / "n1"), **nk), progress=False, workers=1)
    run_ppl(PplConfig(out=str(tmp_path / "p1"), **pk), progress=False, workers=1)
    with StagedScorer("tiny-glm5", ClusterConfig(stages=2, cpus_per_stage=1, layers="0:2,2:3"),
                      address=ray_head.address) as sc:
        run_niah(NiahConfig(out=str(tmp_path / "n2"), **nk), progress=False, stages=sc)
        run_ppl(PplConfig(out=str(tmp_path / "p2"), **pk), progress=False, scorer=sc)

    def read(d, f, key, val):
        return {key(r): val(r) for r in map(json.loads, open(os.path.join(d, f)))}

    ans = [read(str(tmp_path / d), "niah_samples.jsonl", lambda r: (r["length"], r["index"], r["method"]),
                lambda r: r["pred"]) for d in ("n1", "n2")]
    assert len(ans[0]) == 4 and ans[0] == ans[1]
    nll = [read(str(tmp_path / d), "ppl_windows.jsonl", lambda r: (r["method"], r["protocol"], r["window"]),
                lambda r: r["nll"]) for d in ("p1", "p2")]
    assert nll[0].keys() == nll[1].keys() and len(nll[0]) == 4
    for k in nll[0]:
        assert nll[1][k] == pytest.approx(nll[0][k], rel=1e-6), k


def _tune(art, scorer=None):
    from oscar.common import set_threads
    from oscar.recipe.tune import TuneConfig, tune_key_clip

    cfg = TuneConfig(tokens=256, factors=(1.0, 1.5, 3.0))
    set_threads(1)
    if scorer is not None:
        return tune_key_clip(None, None, art, cfg, scorer=scorer)
    model, tok, _ = load_model("tiny-glm5", latent=True)
    return tune_key_clip(model, tok, art, cfg, progress=False)


def test_latent_clip_tune_in_one_process(fitted):
    """The recipe's clip tune on a latent artifact: one factor on every group's clip (capped at 1), chosen by the
    strict NLL of calibration text through the latent cache; the copy objective is refused by name."""
    from oscar.recipe.tune import TuneConfig, tune_key_clip

    art = fitted[1]
    tuned, rec = _tune(art)
    assert len(set(rec["nll_per_token"].values())) == 3  # the clips reach the history read from INT2
    f = rec["chosen_factor"]
    for a, b in zip(tuned.clip, art.clip):
        assert torch.equal(a, (b * f).clamp(max=1.0))
    model, tok, _ = load_model("tiny-glm5", latent=True)
    with pytest.raises(OscarError, match="strict-NLL objective through the latent cache"):
        tune_key_clip(model, tok, art, TuneConfig(tokens=256, objective="copy"), progress=False)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.full
@pytest.mark.timeout(900)
def test_latent_clip_tune_on_two_stages(fitted, ray_head):
    """2 stages score every factor as one process does (up to the float32 cross-entropy's summation order; the
    record rounds to 1e-6) and choose the same (the stages' latent scoring itself: the needles and perplexity test
    above, in every tier)."""
    from oscar.cluster.pipeline import ClusterConfig
    from oscar.cluster.scoring import StagedScorer

    art = fitted[1]
    _, rec = _tune(art)
    with StagedScorer("tiny-glm5", ClusterConfig(stages=2, cpus_per_stage=1, layers="0:2,2:3", dtype="float64"),
                      address=ray_head.address) as sc:
        _, rec2 = _tune(art, sc)
    assert rec2["chosen_factor"] == rec["chosen_factor"]
    assert all(rec2["nll_per_token"][k] == pytest.approx(v, rel=1e-6, abs=1e-6) for k, v in rec["nll_per_token"].items())