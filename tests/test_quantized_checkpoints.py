"""Quantized checkpoints, one rule for every loader: a block-FP8 checkpoint (float8_e4m3fn weights, one
`weight_scale_inv` per 128x128 block, as DeepSeek-V3 / GLM-4.7-FP8 ship) loads dequantized in the single
process and in a layer-range stage, bit-identical to its dequantized float32 twin; any other quantization is
refused by name before a weight is read; a float8 weight without its scale, or a key no rule accounts for, is
an error naming it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from oscar.cluster import loading
from oscar.cluster.loading import load_layer_range
from oscar.common import OscarError
from oscar.modelconfig import cache_root, layer_of, preset_config
from oscar.pipeline import models
from oscar.pipeline.models import dequantize_block_fp8, load_model
from helpers import fp8 as fp8_ckpt
from helpers.fp8 import BLOCK, FP8_CONFIG


def brute_dequantize(w: torch.Tensor, s: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """weight * scale, one Python iteration per block (the oracle for `dequantize_block_fp8`)."""
    br, bc = block
    out = torch.empty(w.shape, dtype=torch.float32)
    for i in range(s.shape[-2]):
        for j in range(s.shape[-1]):
            blk = (..., slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
            out[blk] = w[blk].to(torch.float32) * s[..., i, j].to(torch.float32).unsqueeze(-1).unsqueeze(-1)
    return out


# ------------------------------------------------------------------ the dequantization itself


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((192, 200), (128, 128)), ((5, 64, 300), (128, 128)),
                                         ((70, 33), (16, 32)), ((1, 1), (128, 128))])
def test_dequantize_equals_the_per_block_loop(shape, block):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(shape, generator=g) * 3).to(torch.float8_e4m3fn)
    s = torch.rand((*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1])), generator=g) + 0.01
    got = dequantize_block_fp8(w, s, block)
    assert got.dtype == torch.float32 and torch.equal(got, brute_dequantize(w, s, block))
    # computed in float32, then cast: the cast of the float32 result, bit for bit
    assert torch.equal(dequantize_block_fp8(w, s.to(torch.bfloat16), block, torch.bfloat16),
                       brute_dequantize(w, s.to(torch.bfloat16), block).to(torch.bfloat16))


def test_dequantize_refuses_a_scale_grid_of_another_shape():
    w = torch.zeros(200, 130, dtype=torch.float8_e4m3fn)
    with pytest.raises(OscarError, match=r"x\.weight_scale_inv: shape \(1, 1\) does not match .*expected \(2, 2\)"):
        dequantize_block_fp8(w, torch.ones(1, 1), BLOCK, name="x.weight")


# ------------------------------------------------------------------ tiny block-FP8 GLM-4-MoE and its twin

HIDDEN = 192  # not a multiple of 128: q/k/v/o, dense MLP and expert matrices all have a partial block


def _tiny_glm(tmp) -> str:
    """tiny-glm4-moe at hidden 192 (seeded random init, routers too), sharded safetensors (fused experts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = preset_config("tiny-glm4-moe")
    cfg.hidden_size = HIDDEN
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("TopkRouter"):
                m.weight.normal_(0.0, 0.5, generator=g)
                m.e_score_correction_bias.normal_(0.0, 0.01, generator=g)
    tok = AutoTokenizer.from_pretrained(models._smollm2_tokenizer_dir(cache_root()))
    d = os.path.join(tmp, "plain")
    os.makedirs(d)
    models._save_sharded(model, tok, d, layers_per_shard=1)
    return d


def write_pair(tmp) -> tuple[str, str]:
    """(block-FP8 checkpoint, its dequantized float32 twin) of the tiny GLM (helpers.fp8.write_pair)."""
    fp8_dir, twin_dir = os.path.join(tmp, "fp8"), os.path.join(tmp, "twin")
    fp8_ckpt.write_pair(_tiny_glm(tmp), fp8_dir, twin_dir)
    return fp8_dir, twin_dir


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(str(tmp_path_factory.mktemp("fp8pair")))


def test_the_fixture_is_what_it_claims(pair):
    fp8, twin = pair
    wm = json.load(open(os.path.join(fp8, loading.INDEX_NAME)))["weight_map"]
    scales = [k for k in wm if k.endswith(".weight_scale_inv")]
    partial = 0
    for k in scales:
        with safe_open(os.path.join(fp8, wm[k]), "pt") as fh:
            w = fh.get_tensor(k[: -len("_scale_inv")])
        assert w.dtype == torch.float8_e4m3fn
        with safe_open(os.path.join(fp8, wm[k]), "pt") as fh, safe_open(os.path.join(twin, wm[k]), "pt") as th:
            # the twin is the codes times their block's scale: the per-block loop is the oracle
            assert torch.equal(th.get_tensor(k[: -len("_scale_inv")]), brute_dequantize(w, fh.get_tensor(k)))
        partial += any(n % 128 for n in w.shape)
    assert scales and partial >= 1, "the fixture must have a weight that is not a multiple of the block"
    assert any(".experts.3.gate_proj.weight_scale_inv" in k for k in scales)
    # the FP8 checkpoint is not its twin read without scales: the codes differ from the values
    q_name = next(k for k in wm if k.endswith("layers.0.self_attn.q_proj.weight"))
    with safe_open(os.path.join(fp8, wm[q_name]), "pt") as a, \
            safe_open(os.path.join(twin, "layer-0.safetensors"), "pt") as b:
        assert not torch.equal(a.get_tensor(q_name).float(), b.get_tensor(q_name))


def test_single_process_loads_fp8_as_its_twin(pair):
    fp8, twin = pair
    a, _, _ = load_model(fp8)
    b, _, _ = load_model(twin)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert "quantization_config" not in a.config.to_dict() or not a.config.to_dict()["quantization_config"]


@pytest.mark.parametrize("a,b", [(0, 3), (0, 1), (1, 3), (2, 3)])
def test_stage_loads_fp8_as_its_twin(pair, a, b):
    fp8, twin = pair
    s8, r8 = load_layer_range(fp8, a, b)
    st, rt = load_layer_range(twin, a, b)
    p8, pt = dict(s8.named_parameters()), dict(st.named_parameters())
    assert p8.keys() == pt.keys()
    for k in p8:
        assert p8[k].dtype == pt[k].dtype == torch.float32 and torch.equal(p8[k], pt[k]), k
    # every key of the stage's layers was read: each scale with its weight
    wm = json.load(open(os.path.join(fp8, loading.INDEX_NAME)))["weight_map"]
    want = {k for k in wm if (layer_of(k) is not None and a <= layer_of(k) < b) or (a == 0 and "embed_tokens" in k)}
    assert set(r8.keys) == want and not r8.ignored
    assert sorted(r8.dequantized) == sorted(k[: -len("_scale_inv")] for k in want if k.endswith("_scale_inv"))
    # and a bf16 stage: the float32 dequantization cast to bfloat16 equals the twin cast to bfloat16
    sb, _ = load_layer_range(fp8, a, b, dtype=torch.bfloat16)
    tb, _ = load_layer_range(twin, a, b, dtype=torch.bfloat16)
    for (n, x), (_, y) in zip(sb.named_parameters(), tb.named_parameters()):
        assert torch.equal(x, y), n


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _edit_shard(d: str, shard: str, fn) -> None:
    p = os.path.join(d, shard)
    with safe_open(p, "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    fn(tensors)
    save_file(tensors, p, metadata={"format": "pt"})
    idx = json.load(open(os.path.join(d, loading.INDEX_NAME)))
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != shard} | {k: shard for k in tensors}
    json.dump(idx, open(os.path.join(d, loading.INDEX_NAME), "w"))


def test_a_float8_weight_without_its_scale_is_an_error_naming_it(pair, tmp_path):
    fp8, _ = pair
    d = _copy(fp8, tmp_path / "noscale")
    key = "model.layers.1.mlp.experts.5.down_proj.weight"
    _edit_shard(d, "layer-1.safetensors", lambda t: t.pop(key + "_scale_inv"))
    for call in (lambda: load_layer_range(d, 1, 2), lambda: load_model(d)):
        with pytest.raises(OscarError) as e:
            call()
        msg = str(e.value)
        assert key in msg and "without its scale" in msg and "\n" not in msg, msg
    load_layer_range(d, 2, 3)  # other layers are whole

    # a float8 weight in a checkpoint whose config says nothing of quantization: the same error
    d2 = _copy(fp8, tmp_path / "noconfig")
    cfg = json.load(open(os.path.join(d2, "config.json")))
    del cfg["quantization_config"]
    json.dump(cfg, open(os.path.join(d2, "config.json"), "w"))
    for l in range(3):
        _edit_shard(d2, f"layer-{l}.safetensors", lambda t: [t.pop(k) for k in list(t) if k.endswith("_scale_inv")])
    for call in (lambda: load_layer_range(d2, 2, 3), lambda: load_model(d2)):
        with pytest.raises(OscarError, match=r"model\.layers\.\d\..* is (torch\.float8_e4m3fn|F8_E4M3) but the "
                                             r"checkpoint has no .*without its scale"):
            call()


def test_an_unaccounted_key_is_an_error_naming_it(pair, tmp_path):
    fp8, twin = pair
    # a scale tensor in a checkpoint whose config says it is not quantized: never dropped silently
    d = _copy(fp8, tmp_path / "noqc")
    cfg = json.load(open(os.path.join(d, "config.json")))
    del cfg["quantization_config"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(OscarError, match=r"weight_scale_inv .*no quantization_config"):
        load_layer_range(d, 1, 2)
    with pytest.raises(OscarError, match=r"weight_scale_inv .*no quantization_config"):
        load_model(d)
    # a key that is no tensor of the model and no rule ignores (a static activation scale, say)
    d = _copy(twin, tmp_path / "extra")
    key = "model.layers.1.self_attn.q_proj.input_scale"
    _edit_shard(d, "layer-1.safetensors", lambda t: t.__setitem__(key, torch.ones(())))
    with pytest.raises(OscarError) as e:
        load_layer_range(d, 1, 2)
    assert key in str(e.value) and "not placed into any parameter" in str(e.value) and "\n" not in str(e.value)
    load_layer_range(d, 2, 3)  # the other layers do not own it
    # a named rule: the rotary inv_freq buffers older checkpoints carry are ignored, and reported as such
    d = _copy(twin, tmp_path / "invfreq")
    key = "model.layers.2.self_attn.rotary_emb.inv_freq"
    _edit_shard(d, "layer-2.safetensors", lambda t: t.__setitem__(key, torch.ones(16)))
    _, rep = load_layer_range(d, 2, 3)
    assert key not in rep.keys and rep.ignored == {key: loading.ignored_by(key)} and "rotary" in rep.ignored[key]


@pytest.mark.parametrize("qc,named", [
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "'compressed-tensors'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
    ({**FP8_CONFIG, "activation_scheme": "static"}, "'static'"),
])
def test_other_quantizations_are_refused_by_name_before_any_weight(pair, tmp_path, monkeypatch, qc, named):
    import safetensors

    fp8, _ = pair
    d = _copy(fp8, tmp_path / "q")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["quantization_config"] = qc
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))

    def no_reads(*a, **k):
        raise AssertionError("a weight was read before the refusal")

    monkeypatch.setattr(safetensors, "safe_open", no_reads)
    monkeypatch.setattr(loading, "Checkpoint", no_reads)
    from oscar.pipeline.calibrate import check_servable
    from oscar.pipeline.models import model_info

    info = model_info(models.read_config(d), "q", d)
    monkeypatch.setattr(models, "read_state_dict", no_reads)
    for call in (lambda: load_layer_range(d, 1, 2), lambda: load_model(d), lambda: check_servable(info)):
        with pytest.raises(OscarError) as e:
            call()
        msg = str(e.value)
        assert named in msg and os.path.join(d, "config.json") in msg and "\n" not in msg, msg


# ------------------------------------------------------------------ calibration: one process and 2 Ray stages


def _calib_opts(model, store):
    # threads=1: float32 summation order in the MoE layers depends on the torch thread count; each Ray stage
    # actor runs one thread (threads_per_stage defaults to cpus_per_stage = 1), so the single process does too
    return dict(model=model, store=str(store), seq_len=48, sink=4, seqs_per_block=2, tokens=48 * 2 * 2,
                reservoir=8, batch_size=1, threads=1)


def _same_statistics(a_path, b_path):
    """Every array of two stores equal bit for bit (their attributes differ: the model fingerprints do, since the
    checkpoints' configs and bytes differ)."""
    import numpy as np

    from oscar.pipeline.store import CalibStore

    a, b = CalibStore(str(a_path)), CalibStore(str(b_path))
    assert a.done().all() and b.done().all()
    for name in ("tokens", "mask", "done"):
        assert np.array_equal(a.group[name][:], b.group[name][:]), name
    n = 0
    for l in range(a.num_layers):
        for s in a.spec:
            x, y = a.group[f"layers/{l}/{s}"][:], b.group[f"layers/{l}/{s}"][:]
            assert np.array_equal(x, y), f"layers/{l}/{s} differs (max {np.abs(x - y).max()})"
            n += 1
    assert n


@pytest.fixture(scope="module")
def twin_store(pair, tmp_path_factory):
    from oscar.kernels import cpu_attention
    from oscar.pipeline.calibrate import CalibConfig, calibrate

    cpu_attention.register()  # the attention the Ray stage actors' capture runs (they register it too)
    path = tmp_path_factory.mktemp("twin") / "twin.zarr"
    calibrate(CalibConfig(**_calib_opts(pair[1], path)), progress=False)
    return path


@pytest.mark.slow
def test_fp8_calibrates_as_its_twin_in_one_process(pair, twin_store, tmp_path):
    """Bit-identical: both load the same float32 weights (the twin holds the exact float32 products
    code x scale that the loader computes), so every statistic is the same float64 sum."""
    from oscar.pipeline.calibrate import CalibConfig, calibrate

    calibrate(CalibConfig(**_calib_opts(pair[0], tmp_path / "fp8.zarr")), progress=False)
    _same_statistics(twin_store, tmp_path / "fp8.zarr")


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_fp8_calibrates_as_its_twin_on_two_ray_stages(pair, twin_store, tmp_path):
    """The block-FP8 checkpoint on 2 layer-range stages of a real local Ray cluster: each stage dequantizes its
    own layers' weights; the store equals the single-process twin's bit for bit."""
    from oscar.cluster.localray import LocalHead
    from oscar.cluster.pipeline import ClusterConfig, calibrate_on_ray
    from oscar.pipeline.calibrate import CalibConfig

    o = _calib_opts(pair[0], tmp_path / "ray.zarr")
    o.pop("threads")
    with LocalHead(num_cpus=4, object_store_mb=256).session() as h:  # loopback-only, private token
        import ray

        ray.init(address=h.address, log_to_driver=False)
        try:
            rep = calibrate_on_ray(CalibConfig(**o), ClusterConfig(stages=2), address=h.address, progress=False)
        finally:
            ray.shutdown()
    assert len(rep.stages) == 2 and rep.block_retries == 0
    _same_statistics(twin_store, tmp_path / "ray.zarr")
