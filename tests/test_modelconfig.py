"""The shared model leaf: one layer_of, one config loader, one locator of the embedded GGUF."""

import json
import os

import pytest

from oscar.common import OscarError
from oscar.modelconfig import (EMBEDDED_GGUF, EMBEDDED_MODEL, PRESETS, embedded_gguf_path, layer_of,
                               load_model_config, read_config)


@pytest.mark.parametrize("key,want", [
    ("model.layers.3.self_attn.q_proj.weight", 3),            # checkpoint names (pipeline's regex)
    ("model.language_model.layers.12.mlp.gate.weight", 12),   # nested decoders
    ("layers.0.input_layernorm.weight", 0),                   # stage-relative names (cluster's regex)
    ("layers.7.mlp.experts.3.down_proj.weight", 7),           # expert index after the layer index
    ("model.embed_tokens.weight", None), ("model.norm.weight", None), ("lm_head.weight", None),
    ("model.extra_layers.3.w", None),                         # another module called *_layers
    ("model.layers.x.w", None), ("model.layers.3", None),     # no index / no tensor under it
])
def test_layer_of(key, want):
    assert layer_of(key) == want


def test_layer_of_agrees_with_the_preset_checkpoints():
    """Every decoder-layer tensor of a preset's state dict maps to its own layer, nothing else does."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = load_model_config("tiny-glm4-moe")
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    got = {layer_of(k) for k in m.state_dict()}
    assert got == set(range(cfg.num_hidden_layers)) | {None}


def test_load_model_config_specs(tmp_path):
    c = load_model_config("tiny-llama@seed=3")
    assert c.num_hidden_layers == PRESETS["tiny-llama"]["num_hidden_layers"] and c.oscar_origin["seed"] == 3
    e = load_model_config(EMBEDDED_MODEL)  # the GGUF's metadata, no conversion
    assert (e.num_hidden_layers, e.num_key_value_heads) == (30, 3)
    assert os.path.basename(embedded_gguf_path()) == EMBEDDED_GGUF
    c.save_pretrained(tmp_path)  # a directory, its config.json, another JSON file
    for p in (tmp_path, tmp_path / "config.json"):
        assert load_model_config(str(p)).to_dict() == read_config(str(tmp_path)).to_dict()
    (tmp_path / "other.json").write_text((tmp_path / "config.json").read_text())
    assert load_model_config(str(tmp_path / "other.json")).num_key_value_heads == 2
    shipped = load_model_config("glm-4.7", shipped=os.path.join(os.path.dirname(__file__), "..", "cluster", "configs"))
    assert shipped.model_type == "glm4_moe"


def test_load_model_config_bad_input(tmp_path):
    with pytest.raises(OscarError, match="unknown model 'no-such-model'"):
        load_model_config("no-such-model")
    with pytest.raises(OscarError, match="empty model spec"):
        load_model_config(" ")
    with pytest.raises(OscarError, match="only presets take options"):
        load_model_config(f"{EMBEDDED_MODEL}@seed=1")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(OscarError, match="not a readable JSON model config"):
        load_model_config(str(tmp_path / "junk.json"))
    (tmp_path / "list.json").write_text(json.dumps([1, 2]))
    with pytest.raises(OscarError, match="not a JSON object"):
        load_model_config(str(tmp_path / "list.json"))
    with pytest.raises(OscarError, match="cannot read model config in"):
        load_model_config(str(tmp_path))  # a directory without config.json
    (tmp_path / "x.gguf").write_bytes(b"nope")
    with pytest.raises(OscarError, match="GGUF"):
        load_model_config(str(tmp_path / "x.gguf"))


def test_config_fingerprint_matches_the_resolved_model():
    """Reading a spec's config without materialising it gives the fingerprint stores and artifacts record."""
    from oscar.common import config_fingerprint
    from oscar.pipeline.models import load_config

    for spec in (EMBEDDED_MODEL, embedded_gguf_path(), "tiny-qwen3@seed=2"):
        assert config_fingerprint(load_model_config(spec)) == config_fingerprint(load_config(spec)), spec


def test_model_names_match_case_insensitively(tmp_path, monkeypatch):
    """Presets, the embedded model and shipped configs answer to any spelling; a path on disk is used as given."""
    from oscar.common import config_fingerprint
    from oscar.modelconfig import parse_spec

    shipped = os.path.join(os.path.dirname(__file__), "..", "cluster", "configs")
    assert parse_spec("TINY-LLAMA") == ("tiny-llama", None)
    assert parse_spec("Tiny-Qwen3@seed=2") == ("tiny-qwen3", 2)
    assert parse_spec(EMBEDDED_MODEL.upper()) == (EMBEDDED_MODEL, None)
    for upper, lower in (("TINY-LLAMA", "tiny-llama"), ("Tiny-Qwen3@seed=2", "tiny-qwen3@seed=2")):
        assert config_fingerprint(load_model_config(upper)) == config_fingerprint(load_model_config(lower))
    assert load_model_config("Tiny-Qwen3@seed=2").oscar_origin == {"preset": "tiny-qwen3", "seed": 2}
    assert load_model_config(EMBEDDED_MODEL.upper()).num_hidden_layers == 30
    glm = load_model_config("GLM-4.7", shipped=shipped)
    assert glm.to_dict() == load_model_config("glm-4.7", shipped=shipped).to_dict()
    with pytest.raises(OscarError, match="unknown model 'GLM-4.7'"):
        load_model_config("GLM-4.7")  # shipped configs only where the caller ships them
    # a directory on disk spelled like a preset is that directory, not the preset
    monkeypatch.chdir(tmp_path)
    load_model_config("tiny-qwen3").save_pretrained(tmp_path / "TINY-LLAMA")
    assert parse_spec("TINY-LLAMA") == ("TINY-LLAMA", None)
    assert load_model_config("TINY-LLAMA").model_type == "qwen3"
    assert load_model_config("tiny-llama").model_type == "llama"
