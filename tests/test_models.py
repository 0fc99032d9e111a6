"""Model specs: presets (deterministic, sharded, loadable), the embedded GGUF, HF dirs, errors."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
import torch
from safetensors import safe_open

from oscar.common import OscarError, config_fingerprint
from oscar.pipeline import models as M
from oscar.modelconfig import mtp_layers

PRESET_NAMES = list(M.PRESETS)


@pytest.fixture(scope="module", autouse=True)
def oscar_cache(tmp_path_factory):
    """One hermetic cache per pytest session (shared by the test files), restored afterwards."""
    d = tmp_path_factory.getbasetemp() / "oscar-cache"
    old = os.environ.get("OSCAR_CACHE")
    os.environ["OSCAR_CACHE"] = str(d)
    yield str(d)
    if old is None:
        os.environ.pop("OSCAR_CACHE", None)
    else:
        os.environ["OSCAR_CACHE"] = old


def _tensors(d: str) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(set(json.load(open(os.path.join(d, M.INDEX)))["weight_map"].values())):
        with safe_open(os.path.join(d, shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


# ---------------------------------------------------------------- presets


@pytest.fixture(scope="module")
def other_cache(tmp_path_factory, oscar_cache):
    """A second cache; the tokenizer (parsed from the GGUF, slow) is copied, the weights are not."""
    M.resolve_model("tiny-llama")
    d = tmp_path_factory.mktemp("other-cache")
    shutil.copytree(os.path.join(oscar_cache, "tokenizers"), d / "tokenizers")
    return str(d)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_deterministic_across_caches_and_seeds(name, other_cache):
    d1 = M.resolve_model(f"{name}@seed=3")
    d2 = M.resolve_model(name, cache_dir=other_cache, seed=3)  # weights built again from scratch
    d3 = M.resolve_model(f"{name}@seed=4")
    assert d1 != d2 and d1 != d3
    t1, t2, t3 = _tensors(d1), _tensors(d2), _tensors(d3)
    assert t1.keys() == t2.keys() == t3.keys()
    assert all(torch.equal(t1[k], t2[k]) for k in t1)
    big = [k for k in t1 if t1[k].numel() > 1000]  # norms init to ones under any seed
    assert all(not torch.equal(t1[k], t3[k]) for k in big)
    f1, f2, f3 = (config_fingerprint(M.load_config(d)) for d in (d1, d2, d3))
    assert f1 == f2 and f1 != f3  # the seed is part of the config (oscar_origin)
    assert M.resolve_model(f"{name}@seed=3") == d1  # cached


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_sharded_with_valid_index(name):
    d = M.resolve_model(name)
    index = json.load(open(os.path.join(d, M.INDEX)))
    wm = index["weight_map"]
    shards = sorted(set(wm.values()))
    assert len(shards) >= 2
    assert sorted(f for f in os.listdir(d) if f.endswith(".safetensors")) == shards
    for shard in shards:
        with safe_open(os.path.join(d, shard), "pt") as f:
            assert set(f.keys()) == {k for k, v in wm.items() if v == shard}
    info = M.load_info(name)
    layer_shards = index["metadata"]["layer_shards"]
    # decoder layers, then the MTP layers the latent presets' checkpoints carry (as DeepSeek-V3 / GLM-5 publish them)
    assert sorted(map(int, layer_shards)) == list(range(info.num_layers + len(mtp_layers(M.load_config(d)))))
    assert len(set(layer_shards.values())) >= 2  # layer ranges can be loaded from separate files
    for k, v in wm.items():  # each layer's tensors live in its one shard
        if (l := M.layer_of(k)) is not None:
            assert v == layer_shards[str(l)]
    assert set(M.weight_map(d)) == set(wm)
    assert os.path.isfile(os.path.join(d, "tokenizer.json")) and os.path.isfile(os.path.join(d, M.MARKER))
    assert not [f for f in os.listdir(os.path.dirname(d)) if f.startswith(".tmp-")]


EXPECTED = {  # name: (layers, q heads, kv heads, head_dim); latent models: K/V as transformers expands them per head
    "tiny-llama": (4, 4, 2, 32),
    "tiny-qwen3": (4, 8, 2, 64),
    "tiny-glm4-moe": (3, 12, 2, 64),
    "tiny-glm5": (3, 4, 4, 64),
    "tiny-deepseek-v3": (3, 4, 4, 64),
}
GQA_PRESETS = [n for n in PRESET_NAMES if not M.PRESETS[n].get("kv_lora_rank")]


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_preset_loads_and_runs_forward(name, attn):
    model, tok, info = M.load_model(name, attn_implementation=attn, latent=name not in GQA_PRESETS)
    assert not model.training and info.attn_implementation == attn
    assert (info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim) == EXPECTED[name]
    assert info.head_dim & (info.head_dim - 1) == 0 and info.vocab_size == len(tok) == 49152
    assert info.config_fingerprint == config_fingerprint(model.config)
    assert info.fingerprint == M.load_info(name).fingerprint and info.weights_fingerprint  # config + weights
    assert info.name == f"{name}@seed=0" and info.origin == {"preset": name, "seed": 0}
    json.dumps(info.to_dict())  # store attributes must be JSON
    ids = tok(["def f(x): return x", "The quick brown fox"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**ids).logits  # (B, T, V)
    assert logits.shape == (*ids["input_ids"].shape, 49152) and torch.isfinite(logits).all()


def test_presets_differ_in_gqa_ratio():
    ratios = {M.load_info(n).gqa_ratio for n in GQA_PRESETS}
    assert len(ratios) == len(GQA_PRESETS)


def test_sdpa_matches_eager():
    ids = torch.arange(100, 140)[None]  # (1, T)
    outs = []
    for attn in ("sdpa", "eager"):
        model, _, _ = M.load_model("tiny-qwen3", attn_implementation=attn)
        with torch.no_grad():
            outs.append(model(ids).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_glm4_moe_has_partial_rope_dense_first_layer_and_experts():
    model, _, info = M.load_model("tiny-glm4-moe")
    cfg = model.config
    assert info.partial_rotary_factor == 0.5 and info.rotary_dim == 32
    assert model.model.rotary_emb.inv_freq.numel() == info.rotary_dim // 2  # RoPE on half the channels
    assert info.qk_norm and info.attention_bias
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and hasattr(attn, "q_norm")
    assert info.dense_layers == [0] and info.moe_layers == [1, 2] and cfg.first_k_dense_replace == 1
    assert type(model.model.layers[0].mlp).__name__ == "Glm4MoeMLP"
    moe = model.model.layers[1].mlp
    assert type(moe).__name__ == "Glm4MoeMoE" and moe.experts.num_experts == 8 == info.num_experts
    assert info.num_shared_experts == 1 and hasattr(moe, "shared_experts")
    assert info.experts_implementation == "eager" == cfg._experts_implementation

    # Routing is token dependent and the eager experts path really runs per expert.
    hits: dict[int, torch.Tensor] = {}
    handles = [
        model.model.layers[l].mlp.gate.register_forward_hook(
            lambda m, i, o, l=l: hits.__setitem__(l, torch.bincount(o[2].reshape(-1), minlength=8)))
        for l in info.moe_layers
    ]
    try:
        with torch.no_grad():
            model(torch.arange(1000, 1064)[None])
    finally:
        for h in handles:
            h.remove()
    for l in info.moe_layers:
        assert hits[l].sum() == 64 * 2 and (hits[l] > 0).sum() >= 3, hits[l]


# ---------------------------------------------------------------- embedded GGUF


@pytest.mark.slow
@pytest.mark.full
def test_smollm2_from_gguf_generates_paris(tmp_path):
    model, tok, info = M.load_model("smollm2-135m")
    assert (info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.max_position_embeddings == 8192 and info.model_type == "llama"
    assert info.origin["gguf"] == M.SMOLLM2_GGUF
    d = info.source
    assert len(set(json.load(open(os.path.join(d, M.INDEX)))["weight_map"].values())) >= 2
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:])
    assert "Paris" in answer, answer

    # Cached: resolving again (or a symlinked copy of the file) reuses the conversion untouched.
    stamp = os.stat(os.path.join(d, M.MARKER)).st_mtime_ns
    assert M.resolve_model("smollm2-135m") == d
    link = tmp_path / "copy.gguf"
    link.symlink_to(M.smollm2_gguf_path())
    assert M.resolve_model(str(link)) == d
    assert os.stat(os.path.join(d, M.MARKER)).st_mtime_ns == stamp


# ---------------------------------------------------------------- HF directories


def test_hf_dir_single_file_round_trip(tmp_path):
    model, tok, info = M.load_model("tiny-llama")
    out = tmp_path / "hf"
    model.save_pretrained(out, max_shard_size="10GB")  # transformers' own single-file layout
    tok.save_pretrained(out)
    assert (out / "model.safetensors").is_file() and not (out / M.INDEX).exists()
    assert M.resolve_model(str(out)) == str(out)  # returned as is
    m2, _, info2 = M.load_model(str(out))
    assert info2.fingerprint == info.fingerprint and info2.source == str(out)
    ids = torch.arange(5, 30)[None]
    with torch.no_grad():
        torch.testing.assert_close(m2(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert set(M.weight_map(str(out))) == {k for k in model.state_dict() if k != "lm_head.weight"}


def test_hf_dir_sharded_passed_as_path():
    d = M.resolve_model("tiny-glm4-moe")
    assert M.resolve_model(d) == d
    _, _, info = M.load_model(d)
    assert info.name == d and info.experts_implementation == "eager"


# ---------------------------------------------------------------- errors


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(OscarError, match="tiny-llama.*tiny-qwen3.*tiny-glm4-moe"):
        M.resolve_model("tiny-mistral")


@pytest.mark.parametrize("spec,msg", [
    ("tiny-llama@seed=x", "NAME@seed=INT"),
    ("smollm2-135m@seed=1", "only presets"),
    ("", "empty model spec"),
])
def test_bad_spec(spec, msg):
    with pytest.raises(OscarError, match=msg):
        M.resolve_model(spec)


def test_seed_conflicts():
    with pytest.raises(OscarError, match="seed=3 but seed=4"):
        M.resolve_model("tiny-llama@seed=3", seed=4)
    with pytest.raises(OscarError, match="seed only applies"):
        M.resolve_model("smollm2-135m", seed=1)


def test_nonexistent_and_non_model_paths(tmp_path):
    with pytest.raises(OscarError, match="no such file or directory"):
        M.resolve_model(str(tmp_path / "nope"))
    with pytest.raises(OscarError, match="GGUF file not found"):
        M.resolve_model(str(tmp_path / "nope.gguf"))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"xx")
    with pytest.raises(OscarError, match="neither a Hugging Face directory nor a .gguf"):
        M.resolve_model(str(f))
    with pytest.raises(OscarError, match="no config.json"):
        M.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(OscarError, match="no safetensors weights"):
        M.load_model(str(tmp_path))


def test_unwritable_cache(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OscarError, match="cannot write the model cache"):
        M.resolve_model("tiny-llama@seed=9", cache_dir=str(blocker / "cache"))


def test_path_with_at_sign_is_a_path(tmp_path):
    d = tmp_path / "ckpt@v2"
    shutil.copytree(M.resolve_model("tiny-llama"), d)
    assert M.resolve_model(str(d)) == str(d)


def test_names_match_case_insensitively_but_paths_are_used_as_given(tmp_path, monkeypatch):
    d = M.resolve_model("tiny-llama")
    assert M.resolve_model("TINY-LLAMA") == M.resolve_model("Tiny-Llama@seed=0") == d
    assert M.load_info("TINY-LLAMA").name == "tiny-llama@seed=0"
    monkeypatch.chdir(tmp_path)
    shutil.copytree(M.resolve_model("tiny-qwen3"), tmp_path / "TINY-LLAMA")
    assert M.resolve_model("TINY-LLAMA") == str(tmp_path / "TINY-LLAMA")  # a directory of that name wins
    assert M.resolve_model("tiny-llama") == d


def test_unreadable_directory(tmp_path):
    d = tmp_path / "locked"
    d.mkdir()
    (d / "config.json").write_text("{}")
    d.chmod(0)
    try:
        if os.access(d, os.R_OK):  # root ignores permissions
            pytest.skip("running as root: permission bits are not enforced")
        with pytest.raises(OscarError, match="not readable"):
            M.resolve_model(str(d))
    finally:
        d.chmod(0o755)


def test_corrupt_config_is_an_oscar_error(tmp_path):
    src = M.resolve_model("tiny-llama")
    d = tmp_path / "broken"
    shutil.copytree(src, d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(OscarError, match="cannot read model config"):
        M.load_model(str(d))


def test_bad_gguf_files(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(OscarError, match="not a GGUF file"):
        M.resolve_model(str(bad))
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(OscarError, match="failed to parse GGUF"):
        M.resolve_model(str(trunc))
    models = os.path.join(M.cache_root(), "models")
    assert not [f for f in os.listdir(models) if f.startswith(".tmp-")]  # nothing half-written left


# ---------------------------------------------------------------- atomic cache writes


def test_atomic_build_concurrent_and_failed(tmp_path):
    final = str(tmp_path / "models" / "x")
    started = threading.Barrier(2)
    results = []

    def build(tmp):
        started.wait()
        time.sleep(0.1)
        with open(os.path.join(tmp, "payload"), "w") as f:
            f.write(str(threading.get_ident()))
        M._write_marker(tmp, {"kind": "test"})

    ts = [threading.Thread(target=lambda: results.append(M._atomic_build(final, build))) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert results == [final, final]
    assert sorted(os.listdir(tmp_path / "models")) == ["x"]  # the loser's temp dir is gone
    assert sorted(os.listdir(final)) == [M.MARKER, "payload"]

    def failing(tmp):
        open(os.path.join(tmp, "half"), "w").close()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        M._atomic_build(str(tmp_path / "models" / "y"), failing)
    assert sorted(os.listdir(tmp_path / "models")) == ["x"]

    # A temp dir left by a kill -9'd builder is removed once stale, a fresh one is left alone.
    stale, fresh = tmp_path / "models" / ".tmp-z-old", tmp_path / "models" / ".tmp-z-new"
    stale.mkdir()
    fresh.mkdir()
    os.utime(stale, (time.time() - 7 * 3600,) * 2)
    M._atomic_build(str(tmp_path / "models" / "z"), lambda tmp: M._write_marker(tmp, {"kind": "test"}))
    assert sorted(os.listdir(tmp_path / "models")) == [".tmp-z-new", "x", "z"]


def test_load_model_dtype_by_name(monkeypatch):
    """`dtype="auto"` is the host's compute dtype (oscar.host.compute_dtype); an unknown name is one line, refused
    before the model is resolved or any weight read."""
    from oscar.host import compute_dtype

    model, _, _ = M.load_model("tiny-llama", dtype="auto")
    assert next(model.parameters()).dtype == getattr(torch, compute_dtype("auto"))
    monkeypatch.setattr(M, "resolve_model", lambda *a, **k: pytest.fail("resolved the model before checking dtype"))
    with pytest.raises(OscarError, match=r"load_model: unknown dtype 'fp7'; known: auto, float32, bfloat16"):
        M.load_model("tiny-llama", dtype="fp7")
