"""A wrong pairing is refused first: an artifact fitted for another model (plain or per-layer widths) is refused by
`oscar validate niah|ppl` and `oscar export` in one line naming both sides, before any method is judged, any
weight is loaded or any output is made; a method the user named that cannot run is refused the same way, and a
default method list leaves out only what the model cannot serve, said in the report's header and run.json."""

from __future__ import annotations

import json
import os

import pytest

from oscar.common import OscarError


@pytest.fixture(scope="module")
def qwen_artifacts(stores, tmp_path_factory) -> dict[str, str]:
    """tiny-qwen3 (head_dim 64) artifacts: the scaled fit and its per-layer widths (layer 0's keys at 3 bits)."""
    from oscar.stats.artifact import save_artifact
    from oscar.stats.fit import FitConfig, fit
    from oscar.recipe.widths import widths_artifact

    d = tmp_path_factory.mktemp("qwen")
    art = fit(stores("tiny-qwen3"), FitConfig(variant="scaled", progress=False, threads=1))
    out = {"plain": str(d / "plain.safetensors"), "widths": str(d / "widths.safetensors")}
    save_artifact(art, out["plain"])
    save_artifact(widths_artifact(art, [[3, 2]] + [[2, 2]] * (art.num_layers - 1)), out["widths"])
    return out


@pytest.fixture()
def no_weights(monkeypatch):
    """Fails the test if a validation command loads model weights (it must refuse before)."""
    from oscar.validate import env

    def load(*a, **k):
        raise AssertionError("model weights were loaded before the refusal")

    monkeypatch.setattr(env, "_load", load)


def _refused(capsys, *argv) -> str:
    from oscar.__main__ import main

    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("kind", ["plain", "widths"])
@pytest.mark.parametrize("check,extra", [("niah", ["--lengths", "1k", "--samples", "1"]),
                                         ("ppl", ["--lengths", "1k", "--tokens", "1024"])])
@pytest.mark.parametrize("methods", [None, "oscar-int2"])
def test_cross_model_artifact_refused_first(tmp_path, capsys, qwen_artifacts, no_weights, kind, check, extra, methods):
    out = tmp_path / "out"
    art = qwen_artifacts[kind]
    line = _refused(capsys, "validate", check, "--model", "tiny-llama", "--artifact", art, "--out", str(out),
                    "--no-progress", *extra, *(["--methods", methods] if methods else []))
    assert line == (f"oscar validate: error: --artifact {art} (fitted for tiny-qwen3@seed=0) cannot serve model "
                    "tiny-llama: artifact does not match the model (head_dim: artifact 64 vs model 32); fit an "
                    "artifact for this model")
    assert not out.exists()


def test_export_refuses_another_models_gguf(tmp_path, capsys):
    """The shipped Qwen2.5-0.5B artifact into the embedded SmolLM2 GGUF (the default --model-gguf)."""
    from oscar.stats.interop import embedded_gguf

    art = os.path.join(os.path.dirname(__file__), "..", "reports", "examples", "qwen2.5-0.5b", "artifact.safetensors")
    out = tmp_path / "x"
    line = _refused(capsys, "export", art, "--format", "gguf-rot", "--out", str(out))
    assert line == (f"oscar export: error: --artifact {art} (fitted for qwen2.5-0.5b) cannot serve model "
                    f"{embedded_gguf()}: artifact does not match the model (num_layers: artifact 24 vs model 30, "
                    "num_kv_heads: artifact 2 vs model 3); fit an artifact for this model")
    assert not out.exists()


@pytest.mark.parametrize("methods", ["bf16,kivi2", "kivi2"])
@pytest.mark.parametrize("check", ["niah", "ppl"])
def test_a_named_method_that_cannot_run_is_refused(tmp_path, capsys, scaled_artifact, no_weights, check, methods):
    """kivi2's 64-token key groups cannot serve tiny-llama's head_dim 32: named, it is an error (`--methods kivi2`:
    every method asked for would be skipped), not a skip."""
    out = tmp_path / "out"
    line = _refused(capsys, "validate", check, "--model", "tiny-llama", "--artifact", scaled_artifact, "--methods",
                    methods, "--out", str(out), "--lengths", "1k", "--no-progress")
    assert line == ("oscar validate: error: method(s) kivi2 cannot run on model tiny-llama (kivi2: cannot serve "
                    "head_dim 32: group_size 64 does not divide head_dim 32 (per-token groups of channels)); leave it "
                    "out of --methods")
    assert not out.exists()


def test_run_refuses_a_named_method_before_calibrating(tmp_path, capsys):
    out = tmp_path / "run"
    line = _refused(capsys, "run", "--model", "tiny-llama", "--no-ray", "--samples", "1", "--methods",
                    "bf16,kivi2,oscar-int2", "--out", str(out))
    assert line.startswith("oscar run: error: method(s) kivi2 cannot run on model tiny-llama (kivi2: cannot serve "
                           "head_dim 32") and line.endswith("leave it out of --methods")
    assert not out.exists()


def test_a_default_list_leaves_out_only_what_the_model_cannot_serve(capsys):
    from transformers import LlamaConfig

    from oscar.stats.artifact import QuantConfig, identity_artifact
    from oscar.validate.methods import choose_methods

    def config(D):
        return LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=D)

    listed = ["bf16", "naive-int2", "kivi2", "hadamard-int2", "oscar-int2"]  # (the refits need a store)
    c32 = config(32)
    arts, dropped = choose_methods(listed, c32, identity_artifact(c32, QuantConfig()), default=True,
                                   model="m32")
    assert list(dropped) == ["kivi2"] and "oscar-int2" in arts
    assert "leaving method kivi2 out of the default list: cannot serve head_dim 32" in capsys.readouterr().err
    # head_dim 30: no INT2 format packs it, so every method reading the artifact would be left out: refused
    c30 = config(30)
    with pytest.raises(OscarError, match=r"^no method reading the artifact can run on model m30: every one of the "
                                         r"default list is left out \(naive-int2: cannot serve head_dim 30"):
        choose_methods(listed, c30, identity_artifact(c30, QuantConfig()), default=True, model="m30")


@pytest.mark.slow
def test_validate_default_list_records_what_it_left_out(tmp_path, capsys, scaled_artifact):
    """`oscar validate ppl` without --methods on tiny-llama: kivi2 is left out (said, recorded for the report's
    header); exit 0 with the artifact's method measured."""
    from oscar.__main__ import main
    from oscar.reports.build import build_report

    out = tmp_path / "out"
    assert main(["validate", "ppl", "--model", "tiny-llama", "--artifact", scaled_artifact, "--out", str(out),
                 "--lengths", "256", "--tokens", "256", "--protocol", "strict", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "leaving method kivi2 out of the default list" in err
    assert json.load(open(out / "skipped_methods.json")) == {
        "kivi2": "cannot serve head_dim 32: group_size 64 does not divide head_dim 32 (per-token groups of channels)"}
    import pandas as pd

    assert "oscar-int2" in set(pd.read_parquet(out / "ppl.parquet").method)
    head = build_report(str(out)).markdown.split("## Headline")[0]
    assert "Not measured: `kivi2`, left out of the default method list" in head
