"""Per-layer key widths by the copy probe (oscar/recipe/widths.py): the DP against brute force, the measured and first-order
copy tables, and the served per-layer artifact `oscar fit --widths copy` writes."""

import itertools
import math

import numpy as np
import pytest
import torch

from oscar.kernels import window_attention
from oscar.quant import FP8_PARAM, QuantSpec, fp8_round
from oscar.scoring import layer_formats as lf
from oscar.recipe import widths as wd


def test_layer_widths_is_the_brute_force_optimum():
    rng = np.random.default_rng(4)
    L, O = 5, 4
    costs = np.tile([2.25, 2.875, 3.375, 4.5], (L, 1))
    for trial in range(6):
        errs = np.sort(rng.exponential(1.0, (L, O)), axis=1)[:, ::-1].copy()  # wider = lower error
        budget = [2.25, 2.5, 2.7, 3.0, 3.6, 4.5][trial]
        got = wd.layer_widths(errs, costs, budget)
        best = min((c for c in itertools.product(range(O), repeat=L) if costs[0][list(c)].mean() <= budget + 1e-12),
                   key=lambda c: errs[np.arange(L), list(c)].sum())
        assert math.isclose(errs[np.arange(L), got].sum(), errs[np.arange(L), list(best)].sum(), rel_tol=1e-12)
        assert costs[0][got].mean() <= budget + 1e-12
    with pytest.raises(Exception, match="no width"):
        wd.layer_widths(errs, costs, 2.0)


@pytest.fixture(scope="module")
def fitted(tiny_store):
    from oscar.stats.fit import FitConfig, fit

    art = fit(tiny_store, FitConfig(variant="scaled", progress=False, threads=1))
    art.meta["clip_tuning"] = {"chosen_factor": 1.2}
    return art


def test_widths_artifact_is_layer_artifacts_format(fitted):
    """widths_artifact (the per-layer probes of a measured objective) builds exactly the format layer_artifact
    chose for the same widths: the codec, clips and rotations; bad widths are refused by name."""
    from oscar.common import OscarError

    err = np.zeros((fitted.num_layers, 3))
    err[0, 2] = -1.0  # the first layer's keys widened to 4 bits, the rest at 2
    la = wd.layer_artifact(fitted, wd.COPY_OPTIONS, "oscar-layer-copy-int2", err)
    w = wd.widths_artifact(fitted, la.meta["codec"]["widths"])
    assert w.meta["codec"]["widths"] == la.meta["codec"]["widths"] and w.meta["codec"]["kind"] == "layers"
    for l in range(fitted.num_layers):
        assert torch.equal(w.clip_k[l], la.clip_k[l]) and torch.equal(w.clip_v[l], la.clip_v[l])
        assert torch.equal(w.rot_k[l], la.rot_k[l])
    with pytest.raises(OscarError, match="widths must give"):
        wd.widths_artifact(fitted, [[2, 2]] * (fitted.num_layers - 1))
    with pytest.raises(OscarError, match="widths must give"):
        wd.widths_artifact(fitted, [[1, 2]] + [[2, 2]] * (fitted.num_layers - 1))


def test_copy_objective_widths_are_the_dp_of_the_given_table(fitted):
    """The widths are layer_widths of the measured table (not of the reservoir rows') with its ties at the spread
    between stores; with one layer's probe far better than the rest, that layer is widened; the table must match
    the options."""
    from oscar.common import OscarError, narrower_on_ties

    opts = ((2, 2), (3, 2), (4, 2))
    L, D = fitted.num_layers, fitted.head_dim
    err = np.zeros((L, 3))
    err[:, 1:] = 0.01  # widening hurts everywhere ...
    err[L - 1] = [0.0, -0.5, -0.9]  # ... except in the last layer
    c = wd.layer_artifact(fitted, opts, "oscar-layer-copy-int2", err).meta["codec"]
    costs = np.array([[0.5 * (lf.layer_spec(fitted, kb).bits_per_element(D) + lf.layer_spec(fitted, vb).bits_per_element(D))
                       for kb, vb in opts]] * L)
    assert c["widths"] == [list(opts[o]) for o in wd.layer_widths(narrower_on_ties(err), costs, lf.oscar_bits(fitted))]
    assert c["widths"][L - 1] == [4, 2] and all(w == [2, 2] for w in c["widths"][:-1]) and c["chosen_by"] == "copy"
    assert c["copy_err"] == err.round(6).tolist()
    with pytest.raises(OscarError, match="copy_err must be"):
        wd.layer_artifact(fitted, opts, "oscar-layer-copy-int2", err[:, :2])


@pytest.mark.slow
def test_layer_copy_errors_against_plain_probes(fitted, tmp_path):
    """Each entry is (copied-span NLL with that layer alone widened) - (all at the base), recomputed here with the
    layer's format set by hand and full-logit cross-entropy; the probe log resumes and refuses another config."""
    import json
    from dataclasses import replace

    import torch.nn.functional as F

    from oscar.common import OscarError
    from oscar.validate.env import load_model
    from oscar.scoring.protocols import PROTOCOLS
    from oscar.kernels.window_attention import simulated
    from oscar.recipe.tune import TuneConfig, calibration_ids, copy_windows
    from oscar.recipe.widths import layer_copy_errors

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
    from oscar.recipe.tune import TuneConfig
    from oscar.recipe.widths import _copy_ident, layer_copy_gradients

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
    from oscar.recipe.widths import COPY_OPTIONS, layer_artifact, native_layer_artifact
    from oscar.validate.methods import bits_per_element, channel_keys_artifact

    L = fitted.num_layers
    err = np.zeros((L, 3))
    err[0, 2] = -1.0
    native = native_layer_artifact(layer_artifact(fitted, COPY_OPTIONS, "oscar-layer-copy-int2", err))
    assert native.layer_quant is not None and native.quant.param_dtype == "float8_e4m3fn"
    a, b = channel_keys_artifact(fitted), channel_keys_artifact(native)
    assert a.quant == b.quant and a.quant.param_dtype == "float16" and a.quant.key_axis == "channel"
    assert b.meta["variant"] == "scaled" and b.layer_quant is None
    assert bits_per_element(b, b.head_dim) == bits_per_element(a, a.head_dim)


def test_simulator_follows_the_model_device(fitted):
    """LayerQuant moves every tensor it reads to the K/V's device on first use (a model on a GPU: the widths stage
    runs the simulator where the tune put the model); checked on the meta device, where any tensor left on the CPU
    makes the matmul or the codec fail."""
    from oscar.recipe.widths import native_layer_artifact, widths_artifact
    from oscar.kernels.simulate import LayerQuant

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
        ts = [t for o in (lq, lq.rot) for t in vars(o).values() if isinstance(t, torch.Tensor)]  # its LayerRotation's too
        ts += [t for c in (lq.codec_k, lq.codec_v) if c is not None for t in vars(c).values() if isinstance(t, torch.Tensor)]
        assert len(ts) >= 5 and all(t.device.type == "meta" for t in ts) and lq.device.type == "meta"


@pytest.mark.parametrize("block", [256, 48])
@pytest.mark.parametrize("T,sink,recent", [(200, 16, 32), (701, 64, 256), (333, 64, 256)])
def test_gradient_attention_is_the_simulator_and_its_derivative(fitted, T, sink, recent, block, monkeypatch):
    """The estimate's autograd attention (kernels.grad_attention._grad_attention) computes the simulator's attention
    (kernels.window_attention.sim_attention: exact / INT2 per (query, key) by the fresh mask, pages of 16), and the gradient it
    gives the INT2 error leaves (keys, values) is the directional derivative of a loss on its output: central
    differences of the simulator with the stored keys (values) moved along a random direction (pages and windows not aligned; at T = 333 no
    query reads a stored key yet, so both are 0). Query blocks of 256 and 48 (lengths not their multiples: one
    block at T = 200, a boundary page split between blocks at 48)."""
    from types import SimpleNamespace

    from oscar.kernels import grad_attention as ga

    monkeypatch.setattr(ga, "QUERY_BLOCK", block)

    from oscar.kernels.simulate import LayerQuant
    from oscar.kernels.protocol import Protocol

    L, Hkv, D = fitted.num_layers, fitted.num_kv_heads, fitted.head_dim
    Hq = 2 * Hkv
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, h, T, D, generator=g) for h in (Hq, Hkv, Hkv))  # (B, H, T, D)
    lq, p = LayerQuant(fitted, 1), Protocol("t", sink=sink, recent=recent)
    mod = SimpleNamespace(layer_idx=1)
    ga._GRAD.update(quant=[None, lq], protocol=p, deltas=[None] * L, keys=[None] * L, vdeltas=[None] * L, values=[None] * L)
    window_attention._SIM.update(quant=[None, lq], protocol=p)
    try:
        out = ga._grad_attention(mod, q, k, v)[0]  # (B, T, Hq, D)
        torch.testing.assert_close(out, window_attention.sim_attention(mod, q, k, v)[0], atol=2e-5, rtol=1e-4)
        R = torch.randn(out.shape, generator=g)
        (out * R).sum().backward()
        reads = T - 1 - recent > sink + lq.key_group  # some query reads a stored key (or value)
        for side in ("keys", "values"):
            delta = ga._GRAD["deltas" if side == "keys" else "vdeltas"][1]  # (1, Hkv, n, D)
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
                window_attention._SIM["quant"] = [None, Moved(t)]
                return float((window_attention.sim_attention(mod, q, k, v)[0].double() * R).sum())

            eps = 1e-2
            fd = (f(eps) - f(-eps)) / (2 * eps)
            assert delta.shape[2] > 0 and (abs(fd) > 1.0) == reads, side
            assert math.isclose(float((delta.grad * d).sum()), fd, rel_tol=1e-2, abs_tol=0 if reads else 1e-9), side
    finally:
        ga._GRAD.update(quant=None, protocol=None, deltas=None, keys=None, vdeltas=None, values=None)
        window_attention._SIM.update(quant=None, protocol=None)


QK_SHARPEN = 8.0


@pytest.mark.slow
def test_layer_copy_gradients_are_the_directional_derivative(fitted):
    """Entry (l, o) of the first-order estimate is d/dt of the copied-span NLL per token with layer l's stored keys
    at Q_0(k) + t (Q_o(k) - Q_0(k)), t = 0: here a central difference through the production simulator (its
    banded / flash attention, not the estimate's autograd one); `copy_widths_artifact` takes the DP of the table."""
    import torch.nn.functional as F

    from oscar.common import OscarError
    from oscar.recipe.widths import COPY_OPTIONS, layer_artifact, widths_artifact
    from oscar.validate.env import load_model
    from oscar.kernels.simulate import LayerQuant
    from oscar.scoring.protocols import PROTOCOLS
    from oscar.kernels.window_attention import simulated
    from oscar.recipe.tune import TuneConfig, calibration_ids, copy_windows
    from oscar.recipe.widths import copy_widths_artifact, layer_copy_gradients

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
    assert art.meta["layer_widths"]["widths"] == layer_artifact(fitted, COPY_OPTIONS, "oscar-layer-copy-int2",
                                                                est).meta["codec"]["widths"]
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
def test_fit_widths_cli_writes_a_served_per_layer_artifact(tiny_store, fitted, tmp_path, capsys):
    """`oscar fit --widths copy`: the copy probe's DP written as the cache's per-layer format (oscar-artifact/3) within the
    fit's bits by the memory accounting, which OscarCache then serves (generate runs, layer formats as chosen)."""
    from oscar.__main__ import main
    from oscar.artifact_header import read_metadata
    from oscar.kernels.cache import OscarCache
    from oscar.kernels.memory import artifact_bits_per_element
    from oscar.stats.artifact import load_artifact
    from oscar.validate.env import load_model

    out = str(tmp_path / "widths.safetensors")
    assert main(["fit", tiny_store, "--no-tune", "--widths", "copy", "--threads", "1", "--out", out, "--no-progress"]) == 0
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
