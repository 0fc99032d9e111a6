"""Planning: balanced ranges are optimal, GLM-4.7 figures match an independent count, store
bytes per block match a real store on disk."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

from oscar.cluster.plan import (PlanConfig, balance_layers, load_model_config, make_plan, param_bytes, parse_ranges,
                                store_bytes_per_block)
from oscar.common import OscarError, attention_shapes


def brute_force(costs, stages, extra):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        b = (0, *cuts, n)
        worst = max(sum(costs[b[i]:b[i + 1]]) + (extra if i == 0 else 0) for i in range(stages))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_balance_is_optimal(seed):
    rng = np.random.default_rng(seed)
    costs = [int(x) for x in rng.integers(1, 100, size=int(rng.integers(3, 9)))]
    extra = int(rng.integers(0, 150))
    for stages in range(1, len(costs) + 1):
        r = balance_layers(costs, stages, extra)
        assert r[0][0] == 0 and r[-1][1] == len(costs) and all(a < b for a, b in r)
        assert all(r[i][1] == r[i + 1][0] for i in range(len(r) - 1))
        worst = max(sum(costs[a:b]) + (extra if a == 0 else 0) for a, b in r)
        assert worst == brute_force(costs, stages, extra)


def test_parse_ranges_errors():
    assert parse_ranges("0:2,2:5", 5) == [(0, 2), (2, 5)]
    for bad in ("0:2,3:5", "1:5", "0:2,2:4", "0:2,2:2,2:5", "a:b"):
        with pytest.raises(OscarError):
            parse_ranges(bad, 5)
    with pytest.raises(OscarError, match="between 1 and"):
        balance_layers([1, 2], 3)


def test_glm47_config_is_the_published_one():
    c = load_model_config("glm-4.7")
    assert c.model_type == "glm4_moe"
    sh = attention_shapes(c)
    assert (sh["num_layers"], sh["num_q_heads"], sh["num_kv_heads"], sh["head_dim"]) == (92, 96, 8, 128)
    assert (c.hidden_size, c.intermediate_size, c.moe_intermediate_size) == (5120, 12288, 1536)
    assert (c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok, c.first_k_dense_replace) == (160, 1, 8, 3)
    assert c.vocab_size == 151552 and c.use_qk_norm and c.attention_bias
    assert c.rope_parameters["partial_rotary_factor"] == 0.5 and c.rope_parameters["rope_theta"] == 1e6


def test_glm47_parameters_match_an_independent_count():
    c = load_model_config("glm-4.7")
    pb = param_bytes(c, 2)
    H, Hq, Hkv, D, I, Im, E, V = 5120, 96, 8, 128, 12288, 1536, 160, 151552
    attn = H * Hq * D + Hq * D + 2 * (H * Hkv * D + Hkv * D) + Hq * D * H + 2 * D + 2 * H  # q/k/v(+bias), o, qk-norm, 2 norms
    dense = attn + 3 * H * I
    moe = attn + E * 3 * H * Im + 3 * H * Im + E * H  # routed + shared experts + router weight
    assert pb.layers[:3] == [2 * dense] * 3
    assert pb.layers[3:] == [2 * moe] * 89
    assert pb.embed == 2 * V * H and pb.head == 2 * (V * H + H)
    total = pb.total / 2
    assert 352e9 < total < 354e9  # 355B-A32B family; the checkpoint's extra MTP layer is not part of the model


def test_glm47_plan_and_cli(capsys):
    c = load_model_config("glm-4.7")
    p = make_plan(c, PlanConfig(stages=4, gpus_per_stage=8, gpu_mem_gib=80, seq_len=4096))
    assert [s.layers for s in p.stages][0][0] == 0 and p.stages[-1].layers[1] == 92
    assert sum(s.param_bytes for s in p.stages) == p.loaded_param_bytes
    assert max(s.param_bytes for s in p.stages) < 1.1 * p.loaded_param_bytes / 4  # balanced
    assert p.suggested_stages == 2  # ~656 GiB of bf16 weights: 2 x (8 x 80 GiB x 0.9)
    assert make_plan(c, PlanConfig(stages=1, gpus_per_stage=8, gpu_mem_gib=141)).suggested_stages == 1
    from oscar.__main__ import main

    assert main(["plan", "--model", "glm-4.7", "--stages", "4", "--gpus-per-stage", "8", "--gpu-mem", "80",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["num_layers"] == 92 and len(d["stages"]) == 4 and d["suggested_stages"] == 2
    assert main(["plan", "--model", "glm-4.7", "--stages", "93"]) == 2
    assert "between 1 and the number of layers (92)" in capsys.readouterr().err
    assert main(["plan", "--model", "no-such-model", "--stages", "2"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_store_bytes_match_a_real_store(tmp_path):
    """Per-block bytes of the plan = chunk files of one block written by the pipeline's store."""
    from oscar.pipeline.store import CalibStore, StoreMeta, layer_arrays

    c = load_model_config("tiny-llama")
    sh = attention_shapes(c)
    S, T, R, B = 2, 16, 5, 3
    meta = StoreMeta(model={"name": "tiny-llama", "fingerprint": "x", **sh}, corpus={"name": "c", "fingerprint": "y",
                     "split": {}}, seq_len=T, sink=1, num_blocks=B, seqs_per_block=S, reservoir=R, config={})
    st = CalibStore.create(tmp_path / "s.zarr", meta, np.ones((B, S, T), np.int32), np.ones((B, S, T), np.uint8))
    H, D = sh["num_kv_heads"], sh["head_dim"]
    for l in range(sh["num_layers"]):
        st.write_layer(1, l, {n: np.ones(tail, dtype) for n, (dtype, tail) in layer_arrays(H, D, R).items()})
    on_disk = 0
    for root, _, files in os.walk(tmp_path / "s.zarr"):
        for f in files:
            parts = os.path.relpath(os.path.join(root, f), tmp_path / "s.zarr").split(os.sep)
            if parts[0] in ("layers", "done") and "c" in parts and parts[parts.index("c") + 1] == "1":
                on_disk += os.path.getsize(os.path.join(root, f))  # chunk c/1/... = block 1, uncompressed
    est = store_bytes_per_block(c, seq_len=T, seqs_per_block=S, reservoir=R)
    assert on_disk == est["layers"] + est["done"], (on_disk, est)
    assert est["tokens"] == st.group["tokens"][1].nbytes + st.group["mask"][1].nbytes


def test_plan_that_does_not_fit_is_printed_then_refused(capsys):
    """GLM-4.7 in one stage of 8 x 80 GiB: the table is printed (which stage, by how much), then one error line."""
    from oscar.__main__ import main

    argv = ["plan", "--model", "glm-4.7", "--stages", "1", "--gpus-per-stage", "8", "--gpu-mem", "80"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "82.4 GiB" in out and "does NOT fit" in out
    assert err.count("\n") == 1 and "Traceback" not in err
    assert ("oscar plan: error: does not fit: stage 0 (layers 0-91) needs 82.4 GiB per GPU, budget 72.0 GiB "
            "(--gpu-mem 80 x 90% usable); try --stages 2") in err
    # --json: the plan still parses (scripts read "fits"), and the exit status still says it does not fit
    assert main(argv + ["--json"]) == 2
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert d["fits"] is False and d["suggested_stages"] == 2 and d["budget_bytes"] == int(80 * 0.9 * 2**30)
    assert "does not fit" in err
    assert main(["plan", "--model", "glm-4.7", "--stages", "2", "--gpus-per-stage", "8", "--gpu-mem", "80", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True
    assert main(["plan", "--model", "glm-4.7", "--stages", "1", "--json"]) == 0  # no --gpu-mem: nothing to check
    assert json.loads(capsys.readouterr().out)["fits"] is None
    # explicit ranges that do not fit where the balanced ones would: the hint drops them (--layers: the old spelling)
    for flag in ("--stage-layers", "--layers"):
        assert main(["plan", "--model", "glm-4.7", "--stages", "2", flag, "0:90,90:92", "--gpus-per-stage", "8",
                     "--gpu-mem", "80"]) == 2
        assert "stage 0 (layers 0-89)" in (err := capsys.readouterr().err)
        assert "try --stages 2 without --stage-layers" in err
    # no stage count fits: the hint says so instead of naming one
    assert main(["plan", "--model", "glm-4.7", "--stages", "92", "--gpu-mem", "1"]) == 2
    assert "no stage count fits" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--stages", "0"), ("--stages", "-2"), ("--gpus-per-stage", "0"),
                                        ("--gpu-mem", "0"), ("--gpu-mem", "-80"), ("--gpu-mem", "nan"),
                                        ("--seq-len", "0"), ("--seqs-per-block", "0"), ("--blocks", "0"),
                                        ("--batch-size", "0"), ("--reservoir", "-1"), ("--nodes", "0"),
                                        ("--gpus-per-node", "-8"), ("--utilization", "0")])
def test_plan_refuses_non_positive_sizes_before_reading_the_config(flag, value, capsys, monkeypatch):
    from oscar.__main__ import main
    from oscar.cluster import plan

    def no_config(spec):
        raise AssertionError("the config was read before the sizes were checked")

    monkeypatch.setattr(plan, "load_model_config", no_config)
    argv = ["plan", "--model", "glm-4.7", "--stages", "2", "--gpu-mem", "80"]
    i = argv.index(flag) if flag in argv else None
    argv = argv[:i] + argv[i + 2:] if i is not None else argv
    assert main(argv + [flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"oscar plan: error: {flag} must be") and err.count("\n") == 1, err


def test_plan_model_names_are_case_insensitive(capsys):
    from oscar.__main__ import main

    assert main(["plan", "--model", "GLM-4.7", "--stages", "2", "--gpus-per-stage", "8", "--gpu-mem", "80",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["num_layers"] == 92 and d["fits"] is True
    assert main(["plan", "--model", "TINY-LLAMA", "--stages", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_layers"] == 4


def _llama_config(quantization_config=None):
    """A constructed 2-layer Llama: per layer q 128x128 + k, v 128x64 + o 128x128 + gate/up/down 3 x 128x256 +
    2 norms of 128 = 16384 + 2 * 8192 + 16384 + 98304 + 256 = 147712 parameters; embeddings 1000 x 128."""
    from transformers import LlamaConfig

    kw = dict(quantization_config=quantization_config) if quantization_config else {}
    return LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                       torch_dtype="bfloat16", **kw)


def test_block_fp8_checkpoint_counts_the_dequantized_bytes():
    """The loaders dequantize block FP8 at load: weights count at the compute dtype (bf16, 2 B/param), the same
    as the BF16 checkpoint, and the plan says which mode it counted."""
    from oscar.cluster.plan import format_plan

    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    p = make_plan(_llama_config(fp8), PlanConfig(stages=2))
    layer, embed, head = 147712 * 2, 1000 * 128 * 2, (1000 * 128 + 128) * 2
    assert [s.layers for s in p.stages] == [(0, 1), (1, 2)]
    assert [s.param_bytes for s in p.stages] == [layer + embed, layer]
    assert p.total_param_bytes == 2 * layer + embed + head and p.loaded_param_bytes == 2 * layer + embed
    assert p.weights_mode == "block FP8 checkpoint (128x128 blocks) dequantized at load to bfloat16"
    text = format_plan(p)
    assert "weights: block FP8 checkpoint (128x128 blocks) dequantized at load to bfloat16" in text
    assert "dequantized at load by every loader" in text
    # its own disk figure: 1 B/param, (2 layers + embeddings + head) / 2 B = 551552 B = 538.6 KiB
    assert (2 * layer + embed + head) // 2 == 551552 and "538.6 KiB of FP8 weights read" in text
    plain = make_plan(_llama_config(), PlanConfig(stages=2))
    assert [s.param_bytes for s in plain.stages] == [s.param_bytes for s in p.stages]
    assert plain.weights_mode == "unquantized checkpoint loaded in bfloat16"
    with pytest.raises(OscarError, match="quant_method 'gptq' is not supported"):
        make_plan(_llama_config({"quant_method": "gptq", "bits": 4}), PlanConfig(stages=2))
