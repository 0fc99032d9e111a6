"""MLA (latent-cache) models: GLM-5 (`GlmMoeDsaForCausalLM`) and DeepSeek-V3 (`DeepseekV3ForCausalLM`) presets load in
one process and on layer-range stages, equal to each other, every checkpoint key accounted for (the MTP layer by its
rule), block-FP8 as its dequantized twin; every per-head step refuses them in one line; the latent cache's bytes."""

from __future__ import annotations

import json
import numpy as np
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from oscar.cluster import loading
from oscar.cluster.loading import load_layer_range
from oscar.common import OscarError, attention_shapes, latent_shapes
from oscar.constraints import check_model
from oscar.kernels.memory import LatentFormat, latent_per_history_token, latent_total
from oscar.modelconfig import MTP_RULE, layer_of, preset_config
from oscar.pipeline.models import load_model, resolve_model
from helpers import fp8 as fp8_ckpt

LATENT = ["tiny-glm5", "tiny-deepseek-v3"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", params=LATENT)
def preset(request):
    return request.param, resolve_model(request.param)


def _ids(tok, n: int = 150) -> torch.Tensor:
    ids = tok("The latent cache keeps one compressed vector per token and layer. " * 30, return_tensors="pt").input_ids
    return ids[:, :n]  # (1, n): past the GLM-5 preset's DSA top-k of 64, so the indexer selects


def test_per_head_steps_refuse_a_latent_model_by_name(preset):
    name, _ = preset
    arch = {"tiny-glm5": "GlmMoeDsaForCausalLM", "tiny-deepseek-v3": "DeepseekV3ForCausalLM"}[name]
    with pytest.raises(OscarError, match=f"is {arch}, a Multi-head Latent Attention model: its cache is the 256-value"):
        load_model(name)
    with pytest.raises(OscarError, match="Multi-head Latent Attention"):
        attention_shapes(preset_config(name))  # its `head_dim` is the RoPE key's: never read as a per-head width


@pytest.mark.parametrize("argv,says", [
    (["run", "--no-ray", "--samples", "1", "--out", "D"], "GlmMoeDsaForCausalLM, a Multi-head Latent Attention model"),
    (["validate", "ppl", "--methods", "bf16", "--engine", "cache", "--contexts", "1k", "--out", "D"],
     "--engine cache is built for needles in one process (the paged latent cache); use --engine simulate"),
    (["validate", "ppl", "--methods", "bf16,kivi2", "--contexts", "1k", "--out", "D"],
     "kivi2: quantizes per-head K/V; an MLA model caches a latent")])
def test_per_head_commands_refuse_a_latent_model_before_any_work(tmp_path, argv, says):
    p = subprocess.run([sys.executable, "-m", "oscar", *argv, "--model", "tiny-glm5", "--no-progress"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.strip().splitlines() if not x.startswith("Loading weights")]
    assert len(lines) == 1 and says in lines[0], p.stderr
    assert list(tmp_path.iterdir()) == []


def test_latent_format_refusals_name_the_cause():
    bad_rank = preset_config("tiny-glm5")
    bad_rank.kv_lora_rank = 192  # 1.5 groups of 128
    with pytest.raises(OscarError, match="kv_lora_rank 192 is not a whole number of 128-value groups"):
        check_model(bad_rank, latent=True)
    other = AutoConfig.for_model("deepseek_v2", kv_lora_rank=256)
    with pytest.raises(OscarError, match="model_type 'deepseek_v2' is a latent-attention architecture oscar-kv does "
                                         "not know"):
        check_model(other, latent=True)
    check_model(preset_config("tiny-glm5"), latent=True)  # the presets pass


def test_one_process_loads_every_key_and_ignores_the_mtp_layer(preset):
    name, d = preset
    model, tok, info = load_model(name, latent=True)
    wm = json.load(open(os.path.join(d, loading.INDEX_NAME)))["weight_map"]
    mtp = {k for k in wm if layer_of(k) == 3}
    assert mtp and info.ignored_keys == {MTP_RULE: len(mtp)}
    assert info.latent == latent_shapes(model.config) and info.latent["kv_lora_rank"] == 256
    held = set(model.state_dict())
    assert {k for k in wm if k not in mtp} <= held  # every other key is a tensor of the model


@pytest.mark.parametrize("name,cuts", [(n, c) for n in LATENT for c in ([(0, 3)], [(0, 2), (2, 3)])]
                         + [("tiny-deepseek-v3", [(0, 1), (1, 3)])])  # GLM-5's layer 1 reuses layer 0's top-k
def test_stages_equal_one_process(name, cuts):
    d = resolve_model(name)
    model, tok, _ = load_model(name, latent=True)
    ids = _ids(tok)
    wm = json.load(open(os.path.join(d, loading.INDEX_NAME)))["weight_map"]
    read, ignored = set(), {}
    with torch.no_grad():
        ref = model(ids).logits  # (1, T, V)
        h = None
        for a, b in cuts:
            stage, rep = load_layer_range(d, a, b, head=b == 3)
            h = stage(stage.embed(ids) if a == 0 else h)
            read |= set(rep.keys)
            ignored |= rep.ignored
        logits = stage.lm_head(stage.norm(h))
    torch.testing.assert_close(logits, ref, rtol=0, atol=0)
    # every key of the checkpoint read by the stage that owns it, or (the MTP layer) ignored by its rule
    assert read | set(ignored) == set(wm) and not read & set(ignored)
    assert set(ignored) == {k for k in wm if layer_of(k) == 3} and set(ignored.values()) == {MTP_RULE}


def test_a_stage_never_starts_on_a_shared_indexer_layer():
    with pytest.raises(OscarError, match=r"stage \[1, 3\) starts at layer 1, whose DSA indexer reuses layer 0's "
                                         r"top-k"):
        load_layer_range(resolve_model("tiny-glm5"), 1, 3)


def test_a_key_past_the_mtp_layers_is_an_error_naming_it(tmp_path):
    d = str(tmp_path / "m")
    shutil.copytree(resolve_model("tiny-deepseek-v3"), d)
    save_file({"model.layers.4.eh_proj.weight": torch.zeros(2, 2)}, os.path.join(d, "stray.safetensors"))
    idx = os.path.join(d, loading.INDEX_NAME)
    j = json.load(open(idx))
    j["weight_map"]["model.layers.4.eh_proj.weight"] = "stray.safetensors"
    json.dump(j, open(idx, "w"))
    msg = "checkpoint key model.layers.4.eh_proj.weight is in layer 4, past the 3 decoder layers and not an MTP layer"
    with pytest.raises(OscarError, match=msg):
        load_layer_range(d, 2, 3)
    with pytest.raises(OscarError, match=msg):
        load_model(d, latent=True)


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    t = str(tmp_path_factory.mktemp("latent-fp8"))
    fp8_dir, twin_dir = os.path.join(t, "fp8"), os.path.join(t, "twin")
    fp8_ckpt.write_pair(resolve_model("tiny-glm5"), fp8_dir, twin_dir)
    return fp8_dir, twin_dir


def test_block_fp8_loads_as_its_twin_in_one_process_and_on_stages(fp8_pair):
    fp8, twin = fp8_pair
    wm = json.load(open(os.path.join(fp8, loading.INDEX_NAME)))["weight_map"]
    assert any(k.endswith("kv_b_proj.weight_scale_inv") for k in wm)  # the latent's up-projection is FP8 too
    a, _, _ = load_model(fp8, latent=True)
    b, _, _ = load_model(twin, latent=True)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    for lo, hi in [(0, 1), (2, 3)]:
        s8, r8 = load_layer_range(fp8, lo, hi)
        st, _ = load_layer_range(twin, lo, hi)
        p8, pt = dict(s8.named_parameters()), dict(st.named_parameters())
        assert p8.keys() == pt.keys() and all(torch.equal(p8[k], pt[k]) for k in p8)
        mine = {k for k in wm if layer_of(k) is not None and lo <= layer_of(k) < hi} | \
            ({k for k in wm if "embed_tokens" in k and layer_of(k) is None} if lo == 0 else set())
        assert set(r8.keys) == mine  # each scale read with its weight
        assert set(r8.ignored) == ({k for k in wm if layer_of(k) == 3} if hi == 3 else set())


def test_latent_bytes_by_hand():
    # GLM-5 shapes: kv_lora_rank 512, a 64-value RoPE key; groups of 128 with an fp32 scale and zero
    one = {"num_layers": 1, "kv_lora_rank": 512, "rope_dim": 64}
    h = latent_per_history_token(one, LatentFormat("int2-latent"))
    assert (h["codes"], h["scales"], h["rope_key"]) == (512 * 2 / 8, 4 * 2 * 4, 64 * 2)  # 128 + 32 + 128
    assert h["codes"] + h["scales"] + h["rope_key"] == 288
    b = latent_per_history_token(one, LatentFormat("bf16", bits=16))
    assert b["codes"] + b["rope_key"] == 1152 == (512 + 64) * 2
    # a 1,000-token context: 64 sinks, then pages of 16 leave the 256-token recent window; 16-bit tokens are 1,152 B
    t = latent_total(dict(one, num_layers=78), LatentFormat("int2-latent"), 1000)
    hist = 16 * ((1000 - 64 - 256) // 16)  # 672 history tokens
    assert t["codes"] + t["scales"] + t["rope_key"] == 78 * 288 * hist
    assert t["sinks"] + t["recent"] == 78 * 1152 * (1000 - hist)


def test_bench_memory_prints_the_latent_table(tmp_path):
    out = tmp_path / "m.json"
    p = subprocess.run([sys.executable, "-m", "oscar", "bench", "memory", "--model", "tiny-glm5", "--context", "4096",
                        "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    rep = json.load(open(out))
    rows = {r["format"]: r for r in rep["rows"]}
    # tiny-glm5: kv_lora_rank 256 (2 groups), k_pe 32: 64 + 16 + 64 = 144 B; BF16 (256 + 32) x 2 = 576 B
    assert rows["int2-latent"]["bytes_per_token_layer"] == 144 and rows["bf16"]["bytes_per_token_layer"] == 576
    assert rows["int2-latent"]["bits_per_element"] == 2.5
    assert "144.0 B per token and layer" in p.stdout


# ------------------------------------------------------------------ planning GLM-5.2

def test_glm52_config_is_transformers_glm5_shape():
    from oscar.cluster.plan import load_model_config

    c = load_model_config("glm-5.2")
    m = latent_shapes(c)
    assert (m["num_layers"], m["num_heads"], m["kv_lora_rank"], m["rope_dim"], m["nope_dim"], m["v_dim"]) == \
        (78, 64, 512, 64, 192, 256)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.first_k_dense_replace, c.index_topk) == (256, 8, 3, 2048)
    assert m["mtp_layers"] == 1 and set(c.indexer_types) == {"full"}


def test_latent_store_bytes_by_hand_and_against_a_real_store(tmp_path):
    from oscar.cluster.plan import load_model_config, store_bytes_per_block

    c = load_model_config("glm-5.2")
    est = store_bytes_per_block(c, seq_len=4096, seqs_per_block=8, reservoir=256)
    r, R = 512, 256
    # four r x r float64 Grams, four r-vectors (sum, x^3, x^4, absmax), two float32 (R, r) reservoirs, five int64
    assert est["per_layer"] == 4 * r * r * 8 + 4 * r * 8 + 2 * R * r * 4 + 5 * 8
    # and the chunks the store itself writes for one block of a tiny latent model
    from oscar.pipeline.store import CalibStore, FORMAT_LATENT, StoreMeta, latent_layer_arrays

    t = load_model_config("tiny-glm5")
    lat = latent_shapes(t)
    S, T, Rr, B = 2, 16, 5, 3
    meta = StoreMeta(model={"name": "tiny-glm5", "fingerprint": "x", "num_layers": 3, "num_q_heads": 4,
                            "num_kv_heads": 4, "head_dim": 64, "latent": lat},
                     corpus={"name": "c", "fingerprint": "y", "split": {}}, seq_len=T, sink=1, num_blocks=B,
                     seqs_per_block=S, reservoir=Rr, config={}, format=FORMAT_LATENT)
    st = CalibStore.create(tmp_path / "s.zarr", meta, np.ones((B, S, T), np.int32), np.ones((B, S, T), np.uint8))
    for l in range(3):
        st.write_layer(1, l, {n: np.ones(tail, dtype) for n, (dtype, tail) in latent_layer_arrays(256, Rr).items()})
    on_disk = 0
    for root, _, files in os.walk(tmp_path / "s.zarr"):
        for f in files:
            parts = os.path.relpath(os.path.join(root, f), tmp_path / "s.zarr").split(os.sep)
            if parts[0] in ("layers", "done") and "c" in parts and parts[parts.index("c") + 1] == "1":
                on_disk += os.path.getsize(os.path.join(root, f))
    est = store_bytes_per_block(t, seq_len=T, seqs_per_block=S, reservoir=Rr)
    assert on_disk == est["layers"] + est["done"]


def test_plan_places_glm52(capsys):
    from oscar.__main__ import main

    assert main(["plan", "--model", "glm-5.2", "--nodes", "4", "--gpus-per-node", "8", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["num_layers"] == 78 and p["fits"]
    kv = p["steps"]["kv_cache"]
    ctx = kv["context"]
    hist = 16 * ((ctx - 64 - 256) // 16)
    # 288 B per history token and layer (+ the int32 page table: 4 B per 16 tokens), 1,152 B per 16-bit token
    want = 78 * (288 * hist + 4 / 16 * hist + 1152 * (ctx - hist))
    assert abs(kv["total_bytes"] - want) <= len(kv["stage_bytes"])  # each stage's bytes rounded down
    assert kv["bf16_total_bytes"] == 78 * 1152 * ctx
    assert [r["step"] for r in p["steps"]["rows"]] == ["calibrate"]  # nothing scores through a latent cache yet


def test_render_glm52_calibration_and_refuse_its_run(tmp_path, capsys):
    from oscar.__main__ import main

    kw = ["--target", "kuberay", "--image", "oscar:1", "--nodes", "4", "--gpus-per-node", "8", "--gpu-mem", "80",
          "--cpus-per-node", "96", "--memory-per-node", "1024", "--model", "/data/models/GLM-5.2",
          "--model-config", "glm-5.2", "--pvc", "data"]
    assert main(["cluster", "render", "--out", str(tmp_path / "c"), *kw, "--store", "/data/glm52.zarr"]) == 0
    text = (tmp_path / "c" / "rayjob.yaml").read_text()
    assert "oscar calibrate --ray auto --model /data/models/GLM-5.2" in text and "--stage-layers 0:" in text
    capsys.readouterr()
    assert main(["cluster", "render", "--out", str(tmp_path / "r"), *kw, "--job", "run", "--run-dir", "/data/run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--job run: glm-5.2 is GlmMoeDsaForCausalLM, a Multi-head Latent" in err[0]
    assert not (tmp_path / "r").exists()
