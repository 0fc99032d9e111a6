"""`oscar fit` makes the shipped recipe (oscar/recipe/driver.py): fit -> key-clip tune -> per-layer key widths, each step
skipped on a rerun whose inputs match; `--no-tune --widths none` is the plain fit, without the model."""

from __future__ import annotations

import os

import pytest
import torch

from oscar.__main__ import main
from oscar.recipe.driver import RecipeConfig, RecipePaths, Stages, run_recipe, store_inputs
from oscar.stats.artifact import load_artifact
from oscar.stats.fit import FitConfig, fit
from oscar.recipe.tune import TuneConfig, tune_key_clip
from oscar.validate.env import load_model
from oscar.recipe.widths import copy_widths_artifact


def _tensors(art) -> dict[str, torch.Tensor]:
    out = {}
    for name in ("rot_k", "rot_v", "rot_q", "clip_k", "clip_v", "k_mean"):
        for i, t in enumerate(getattr(art, name) or []):
            out[f"{name}.{i}"] = t
    return out


def _same(a, b) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    assert a.quant == b.quant and a.layer_quant == b.layer_quant


def test_plain_fit_needs_no_model(tiny_store, tmp_path, monkeypatch):
    """--no-tune --widths none: the fit stage's artifact bit for bit, no model loaded, no steps directory."""
    import oscar.validate.env as env

    monkeypatch.setattr(env, "load_model", lambda *a, **k: pytest.fail("the plain fit loaded a model"))
    out = str(tmp_path / "plain.safetensors")
    assert main(["fit", tiny_store, "--out", out, "--no-tune", "--widths", "none", "--quiet", "--threads", "1"]) == 0
    _same(load_artifact(out), fit(tiny_store, FitConfig(variant="scaled", progress=False, threads=1)))
    assert not os.path.exists(str(tmp_path / "plain.recipe"))


def test_recipe_equals_its_steps_and_resumes(tiny_store, tmp_path):
    """run_recipe's artifact equals fit, tune and widths called one by one; a rerun runs no step (no model
    loaded); another tune objective reruns the tune and the widths, not the fit."""
    rcfg = RecipeConfig(widths_windows=2, widths_length=512, progress=False)
    work = str(tmp_path / "w")
    os.makedirs(work)
    paths = RecipePaths(fit=f"{work}/fit.safetensors", tuned=f"{work}/tuned.safetensors", out=str(tmp_path / "a.safetensors"),
                        logs=work)
    fcfg = FitConfig(variant="scaled", progress=False, threads=1)
    loaded = []

    def model():
        if not loaded:
            loaded.append(load_model("tiny-llama"))
        return loaded[0]

    _, corpus, fp = store_inputs(tiny_store)
    rec = run_recipe(tiny_store, paths, fcfg, rcfg, Stages(work), fp, model)
    got = load_artifact(paths.out)

    m, tok, _ = model()
    tuned, trec = tune_key_clip(m, tok, fit(tiny_store, fcfg), TuneConfig(corpus=corpus), progress=False)
    want, _ = copy_widths_artifact(m, tok, tuned, TuneConfig(corpus=corpus, copy_windows=2, copy_length=512),
                                   progress=False, estimate="gradient")
    _same(got, want)
    assert rec["clip_tuning"]["chosen_factor"] == trec["chosen_factor"] == got.meta["clip_tuning"]["chosen_factor"]
    assert got.meta["layer_widths"]["widths"] == want.meta["layer_widths"]["widths"]

    before = {p: os.path.getmtime(p) for p in (paths.fit, paths.tuned, paths.out)}
    st = Stages(work)
    assert run_recipe(tiny_store, paths, fcfg, rcfg, st, fp, lambda: pytest.fail("a finished recipe loaded the model")) == {}
    assert {p: os.path.getmtime(p) for p in before} == before and set(st.seconds) == {"fit", "tune", "widths"}

    rec2 = run_recipe(tiny_store, paths, fcfg, RecipeConfig(objective="copy", widths_windows=2, widths_length=512,
                                                             progress=False), Stages(work), fp, model)
    assert "clip_tuning" in rec2 and "widths" in rec2 and os.path.getmtime(paths.fit) == before[paths.fit]


def test_cli_tune_only_reads_the_store_s_model_and_corpus(tiny_store, tmp_path, capsys):
    """`oscar fit STORE --widths none`: the fit tuned on the store's own calibration text with the store's model."""
    out = str(tmp_path / "t.safetensors")
    assert main(["fit", tiny_store, "--out", out, "--widths", "none", "--quiet", "--threads", "1"]) == 0
    art = load_artifact(out)
    assert art.meta["clip_tuning"]["config"]["corpus"] == "pydoc" and art.layer_quant is None
    assert f"key clips x{art.meta['clip_tuning']['chosen_factor']}" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "t.recipe")) == ["fit.safetensors", "stages"]


def test_split_variant_with_widths_refused_before_any_work(tiny_store, tmp_path, capsys):
    out = tmp_path / "s.safetensors"
    assert main(["fit", tiny_store, "--out", str(out), "--variant", "split", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--variant split already splits the keys" in err
    assert os.listdir(tmp_path) == []
