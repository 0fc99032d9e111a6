"""Constraints checked up front: every default validation method on head dims 30, 32, 48, 56, 64, 128 is
either run or skipped with a reason (never crashed on); calibration refuses what no stage can serve;
sliding-window models are refused by every stage with one message."""

from __future__ import annotations

import re

import pytest
import torch

from oscar.common import OscarError, config_fingerprint
from oscar.constraints import SLIDING_WINDOW, format_problems
from oscar.defaults import DEFAULT_METHODS

from helpers.synthetic_store import SynthSpec, write_synthetic_store


def _config(D: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=D, max_position_embeddings=512)


# what each default method must do per head_dim: "run" or a fragment of the skip reason
EXPECT = {
    30: {m: "not a whole number of bytes" for m in DEFAULT_METHODS if m != "bf16"} | {"bf16": "run",
                                                                                     "hadamard-int2": "power-of-two"},
    32: {"kivi2": "group_size 64 does not divide head_dim 32"},
    48: {"kivi2": "group_size 64 does not divide head_dim 48", "hadamard-int2": "power-of-two",
         "oscar-ref-int2": "Hadamard"},
    56: {"kivi2": "group_size 64 does not divide head_dim 56", "hadamard-int2": "power-of-two",
         "oscar-ref-int2": "Hadamard"},
    64: {},
    128: {},
}


def _fitted(D: int, tmp_path):
    """An `oscar fit` artifact for a model of head_dim D (a synthetic store; provenance kept for refits)."""
    from oscar.stats.artifact import QuantConfig, identity_artifact
    from oscar.stats.fit import FitConfig, fit

    cfg = _config(D)
    if format_problems(D):  # no store can be fitted for it (calibration refuses): a shape-valid stand-in
        return cfg, identity_artifact(cfg, QuantConfig())
    store = str(tmp_path / f"d{D}.zarr")
    write_synthetic_store(store, SynthSpec(num_layers=1, num_kv_heads=1, num_q_heads=2, head_dim=D, num_blocks=3,
                                           rows=96, reservoir=64, fingerprint=config_fingerprint(cfg)))
    variant = "oscar" if D != 56 else "random"  # 56 has no Hadamard: the user fits a variant without one
    return cfg, fit(store, FitConfig(variant=variant, progress=False, threads=1))


@pytest.mark.parametrize("D", sorted(EXPECT))
def test_every_default_method_runs_or_is_skipped_with_a_reason(D, tmp_path, capsys):
    from oscar.kernels.simulate import LayerQuant
    from oscar.validate.methods import resolve_methods

    cfg, fitted = _fitted(D, tmp_path)
    arts, skipped = resolve_methods(list(DEFAULT_METHODS), cfg, fitted, out=str(tmp_path / "out"))
    err = capsys.readouterr().err
    assert all(f"skipping method {m}: {r}" in err for m, r in skipped.items())
    assert set(arts) | set(skipped) == set(DEFAULT_METHODS) and not set(arts) & set(skipped)
    for m in DEFAULT_METHODS:
        want = EXPECT[D].get(m, "run")
        if want == "run":
            assert m in arts, (m, skipped.get(m))
        else:
            assert m in skipped and want in skipped[m], (m, skipped.get(m))
    g = torch.Generator().manual_seed(D)
    for m, art in arts.items():  # what runs, runs: fake-quantize K/V as the cache stores them
        if art is None:
            continue
        lq = LayerQuant(art, 0)
        T = 2 * max(lq.key_group, 16)
        k, v = torch.randn(1, 1, T, D, generator=g), torch.randn(1, 1, T, D, generator=g)
        kq, vq = lq.keys(k), lq.values(v)
        assert kq.shape == k.shape and torch.isfinite(kq).all() and torch.isfinite(vq).all(), m
    if skipped:
        import json

        assert json.load(open(tmp_path / "out" / "skipped_methods.json")) == skipped  # the report lists them


def test_report_lists_skipped_methods(tmp_path):
    import json

    from oscar.reports.build import build_report

    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "c.md").write_text("# calibration\n")
    (tmp_path / "skipped_methods.json").write_text(json.dumps({"kivi2": "cannot serve head_dim 48: group_size 64"}))
    text = build_report(str(tmp_path)).markdown
    assert "## Methods skipped" in text and "| kivi2 | cannot serve head_dim 48: group_size 64 |" in text


def _save(config, d):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(d)
    return str(d)


def test_calibration_refuses_head_dim_30_up_front(tmp_path):
    from oscar.pipeline.calibrate import CalibConfig, calibrate

    d = _save(_config(30), tmp_path / "hd30")  # no tokenizer in it: the check must come before any loading
    with pytest.raises(OscarError, match=r"no INT2 cache can serve head_dim 30 .*not a whole number of bytes"):
        calibrate(CalibConfig(model=d, store=str(tmp_path / "s.zarr")), progress=False)
    assert not (tmp_path / "s.zarr").exists()


def test_fit_refuses_a_format_that_cannot_serve_the_store(tmp_path):
    from oscar.stats.artifact import QuantConfig
    from oscar.stats.fit import FitConfig, fit

    store = str(tmp_path / "s.zarr")
    write_synthetic_store(store, SynthSpec(num_layers=1, num_kv_heads=1, head_dim=48, num_blocks=2, rows=32, reservoir=16))
    with pytest.raises(OscarError, match="group_size 64 does not divide head_dim 48"):
        fit(store, FitConfig(quant=QuantConfig(group_size=64), progress=False, threads=1))


def test_sliding_window_refused_by_every_stage_with_one_message(tmp_path):
    from transformers import AutoModelForCausalLM, MistralConfig

    from oscar.kernels.cache import OscarCache
    from oscar.pipeline.calibrate import CalibConfig, calibrate
    from oscar.stats.artifact import identity_artifact
    from oscar.validate.env import load_model

    cfg = MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32, sliding_window=16, max_position_embeddings=256)
    d = _save(cfg, tmp_path / "mistral")
    with pytest.raises(OscarError, match=re.escape(SLIDING_WINDOW)):
        calibrate(CalibConfig(model=d, store=str(tmp_path / "s.zarr")), progress=False)
    with pytest.raises(OscarError, match=re.escape(SLIDING_WINDOW)):
        load_model(d)  # every validation command loads its model through this
    m = AutoModelForCausalLM.from_pretrained(d)
    with pytest.raises(OscarError, match=re.escape(SLIDING_WINDOW)):
        OscarCache.from_artifact(m, identity_artifact(m.config))
