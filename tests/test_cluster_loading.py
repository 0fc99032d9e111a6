"""Layer-range loading (no Ray): a stage reads only its layers' keys and shards, and chained
stages reproduce the full model's hidden states bit for bit."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import safetensors
import torch

from oscar.cluster import loading
from oscar.cluster.loading import load_layer_range
from oscar.modelconfig import layer_of
from oscar.common import OscarError
from oscar.pipeline.models import load_model, resolve_model
from helpers import cluster as ch

PRESETS = ["tiny-llama", "tiny-qwen3", "tiny-glm4-moe"]


def weight_map(d):
    with open(os.path.join(d, loading.INDEX_NAME)) as f:
        return json.load(f)["weight_map"]


def splits(L):
    """Every 2-way split and one 3-way split of L layers."""
    out = [[(0, a), (a, L)] for a in range(1, L)]
    if L >= 3:
        out.append([(0, 1), (1, L - 1), (L - 1, L)])
    return out


@pytest.fixture
def opened(monkeypatch):
    """Record every file safetensors.safe_open opens (the real function still runs)."""
    paths = []
    real = safetensors.safe_open

    def spy(path, *a, **k):
        paths.append(os.path.basename(str(path)))
        return real(path, *a, **k)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    return paths


@pytest.mark.parametrize("name", PRESETS)
def test_stage_holds_only_its_range(name, opened):
    d = resolve_model(name)
    wm = weight_map(d)
    L = json.load(open(os.path.join(d, "config.json")))["num_hidden_layers"]
    assert len(set(wm.values())) > 2, "presets must be sharded for this test to mean anything"
    for ranges in splits(L):
        for a, b in ranges:
            opened.clear()
            stage, rep = load_layer_range(d, a, b)
            want = {k for k in wm if (layer_of(k) is not None and a <= layer_of(k) < b)
                    or (a == 0 and "embed_tokens" in k)}
            assert set(rep.keys) == want, (a, b)
            assert not any("lm_head" in k or k.endswith("model.norm.weight") for k in rep.keys)
            # Files actually opened = exactly the shards that hold the wanted keys.
            assert sorted(set(opened)) == sorted({wm[k] for k in want}) == sorted(rep.shards)
            # The module holds nothing else (parameter names carry the global layer index).
            for n, p in stage.named_parameters():
                assert p.device.type == "cpu"
                if n.startswith("layers."):
                    assert a <= int(n.split(".")[1]) < b, n
                else:
                    assert a == 0 and n.startswith("embed_tokens."), n
            assert rep.bytes == sum(p.numel() * p.element_size() for p in stage.parameters()) + sum(
                buf.numel() * buf.element_size() for n, buf in stage.named_buffers()
                if n.endswith("e_score_correction_bias"))


@pytest.mark.parametrize("name", PRESETS)
def test_chained_stages_equal_full_model(name):
    model, _, _ = load_model(name)
    d = resolve_model(name)
    cfg = loading.load_config(d, attn_implementation=model.config._attn_implementation)
    L = cfg.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 17:] = 0  # right padding, as the corpus blocks have
    seen = {}
    model.model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("pre_norm", i[0]))
    with torch.no_grad():
        model.model(input_ids=ids, attention_mask=mask, use_cache=False)
        for ranges in splits(L)[:1] + splits(L)[-1:]:
            stages = [load_layer_range(d, a, b, config=cfg)[0] for a, b in ranges]
            h = stages[0].embed(ids)
            for s in stages:
                h = s(h, attention_mask=mask)
            assert torch.equal(h, seen["pre_norm"]), ranges


def test_layers_spread_over_devices():
    """A multi-GPU stage spreads its layers over its devices (balanced by bytes); on CPU the
    device list is ["cpu", "cpu"]: same numbers, and the assignment is checked."""
    from oscar.cluster.loading import assign_devices

    assert assign_devices([1, 1, 1, 1], ["a", "b"]) == ["a", "a", "b", "b"]
    assert assign_devices([5, 1, 1, 1, 1, 1], ["a", "b"]) == ["a", "b", "b", "b", "b", "b"]
    assert assign_devices([1, 1], ["a", "b", "c"]) == ["a", "b"]
    d = resolve_model("tiny-llama")
    one, _ = load_layer_range(d, 0, 4)
    two, _ = load_layer_range(d, 0, 4, devices=["cpu", "cpu"])
    ids = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():
        assert torch.equal(one(one.embed(ids)), two(two.embed(ids)))


def hf_expert_layout(src: str, dst) -> str:
    """Rewrite a fused-expert checkpoint in the Hugging Face per-expert layout that published MoE
    checkpoints (GLM-4.7 included) use: experts.{e}.gate_proj/up_proj/down_proj.weight, one shard per layer."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    os.makedirs(dst)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != loading.INDEX_NAME:
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    shards: dict[str, dict] = {}
    for k, shard in weight_map(src).items():
        with safe_open(os.path.join(src, shard), "pt") as fh:
            t = fh.get_tensor(k)
        shards.setdefault(f"layer-{layer_of(k)}.safetensors", {}).update(ch.per_expert(k, t))
    wm = {}
    for name, tensors in shards.items():
        save_file(tensors, os.path.join(dst, name))
        wm.update({k: name for k in tensors})
    json.dump({"metadata": {}, "weight_map": wm}, open(os.path.join(dst, loading.INDEX_NAME), "w"))
    return str(dst)


def test_moe_experts_load_with_their_layer(tmp_path, opened):
    """Per-expert checkpoint keys are stacked into transformers' fused expert tensors, layer by layer."""
    src = resolve_model("tiny-glm4-moe")
    hf = hf_expert_layout(src, tmp_path / "hf")
    fused, _ = load_layer_range(src, 1, 3)
    opened.clear()
    stage, rep = load_layer_range(hf, 2, 3)
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in rep.keys)
    assert sorted(set(opened)) == ["layer-2.safetensors"] and all(layer_of(k) == 2 for k in rep.keys)
    e = stage.layers["2"].mlp.experts
    assert e.gate_up_proj.shape[0] == e.num_experts
    assert torch.equal(e.gate_up_proj, fused.layers["2"].mlp.experts.gate_up_proj)
    assert torch.equal(e.down_proj, fused.layers["2"].mlp.experts.down_proj)


def test_bad_inputs(tmp_path):
    d = resolve_model("tiny-llama")
    with pytest.raises(OscarError, match="bad layer range"):
        load_layer_range(d, 2, 9)
    with pytest.raises(OscarError, match="bad layer range"):
        load_layer_range(d, 2, 2)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(os.path.join(d, "config.json"), empty / "config.json")
    with pytest.raises(OscarError, match="no model.safetensors.index.json"):
        load_layer_range(str(empty), 0, 1)
    # An index that lost a key: refused by name, nothing silently left on the meta device.
    broken = tmp_path / "broken"
    shutil.copytree(d, broken)
    wm = weight_map(d)
    key = next(k for k in wm if k.endswith("layers.1.self_attn.k_proj.weight"))
    idx = json.load(open(broken / loading.INDEX_NAME))
    del idx["weight_map"][key]
    json.dump(idx, open(broken / loading.INDEX_NAME, "w"))
    with pytest.raises(OscarError, match="no tensor for model.layers.1.self_attn.k_proj.weight"):
        load_layer_range(str(broken), 1, 2)
    load_layer_range(str(broken), 2, 4)  # other ranges never touch the missing key


def _corrupt(src: str, dst, key_suffix: str, shard: str | None = None) -> tuple[str, str]:
    """A copy of checkpoint `src` whose index puts the key ending in `key_suffix` in `shard` (default: another
    shard file, which does not hold it). Returns (key, shard)."""
    shutil.copytree(src, dst)
    idx = json.load(open(os.path.join(dst, loading.INDEX_NAME)))
    wm = idx["weight_map"]
    key = next(k for k in wm if k.endswith(key_suffix))
    wm[key] = shard or next(s for s in sorted(set(wm.values())) if s != wm[key])
    json.dump(idx, open(os.path.join(dst, loading.INDEX_NAME), "w"))
    return key, wm[key]


def test_malformed_index_is_one_line_naming_the_key_and_the_file(tmp_path):
    """An index naming a shard that lacks the key, or a shard file that does not exist: an OscarError naming both,
    from the layer-range loader and from the model's weights fingerprint (what every command reads first)."""
    from oscar.pipeline.models import load_info

    d = resolve_model("tiny-llama")
    key, shard = _corrupt(d, tmp_path / "moved", "layers.1.self_attn.k_proj.weight")
    for call in (lambda: load_layer_range(str(tmp_path / "moved"), 1, 2), lambda: load_info(str(tmp_path / "moved"))):
        with pytest.raises(OscarError) as e:
            call()
        msg = str(e.value)
        assert key in msg and shard in msg and "holds no such tensor" in msg and "\n" not in msg, msg
    load_layer_range(str(tmp_path / "moved"), 2, 4)  # other ranges never read the misplaced key

    key, shard = _corrupt(d, tmp_path / "gone", "layers.2.mlp.up_proj.weight", "model-00009-of-00009.safetensors")
    for call in (lambda: load_layer_range(str(tmp_path / "gone"), 2, 3), lambda: load_info(str(tmp_path / "gone")),
                 lambda: loading.Checkpoint(str(tmp_path / "gone")).shard_sizes()):
        with pytest.raises(OscarError) as e:
            call()
        msg = str(e.value)
        assert key in msg and shard in msg and "no file" in msg and "\n" not in msg, msg

    (tmp_path / "gone" / loading.INDEX_NAME).write_text('{"metadata": {}}')
    with pytest.raises(OscarError, match="not a readable safetensors index with a weight_map"):
        load_layer_range(str(tmp_path / "gone"), 0, 1)
    with pytest.raises(OscarError, match="not a safetensors index"):
        load_info(str(tmp_path / "gone"))
