"""Per-step estimates of `oscar plan` (cluster/steps.py): memory and time of the tune, widths, perplexity and
needles on the stages, and the INT2 KV cache per stage, on a constructed config whose FLOPs and bytes are
computed by hand below; GLM-4.7's cache and a MoE layer's decode reads by hand too."""

from __future__ import annotations

import json
import math

from transformers import LlamaConfig

from oscar.__main__ import main
from oscar.cluster.placement import GpuSpec
from oscar.cluster.plan import PlanConfig, format_plan, load_model_config, make_plan, param_bytes
from oscar.cluster.steps import STAGE_HOP_S, StepSizes, active_weight_bytes
from oscar.defaults import RECENT, SINK
from oscar.run import RunConfig
from oscar.recipe.tune import TuneConfig

# Round figures, so that every time below is arithmetic on the config.
GPU = GpuSpec("test", 80.0, 1e12, 1e11, 1e9, 1e9, "test", hbm_bytes_s=1e11)
UTIL = 0.5
RATE, BW = 1e12 * UTIL, 1e11 * UTIL

# A 2-layer Llama: hidden 128, 4 query / 2 KV heads of 32, MLP 256, vocab 1000, untied, bf16.
H, V = 128, 1000
LAYER = 147712 * 2                # bytes of one decoder layer (tests/test_cluster_plan.py counts it)
EMBED = V * H * 2
HEAD = (V * H + H) * 2            # LM head + final norm: the last stage holds them for the validation steps


def llama() -> LlamaConfig:
    return LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                       torch_dtype="bfloat16")


def layer_flops(t: int) -> float:
    """Forward FLOPs per token of one layer at length t: q/k/v/o 2*128*(4+2*2)*32 + 2*4*32*128, causal scores
    2*2*4*32*(t+1)/2, MLP 2*3*128*256."""
    return 65536 + 32768 + 256 * (t + 1) + 196608


HEAD_FLOPS = 2 * H * V


def hop(tokens: int) -> float:
    return STAGE_HOP_S + tokens * H * 2 / 1e9


def working(t: int, logits: int = 0) -> int:
    """Input + output hidden states of a t-token window, one layer's working set (q, o, k, v, the MLP's three
    intermediates), float32 logits of `logits` tokens (the last stage)."""
    h = t * H * 2
    layer = 2 * h + t * (2 * 4 + 2 * 2) * 32 * 2 + 3 * t * 256 * 2
    return 2 * h + layer + logits * V * 4


def kv_stage(context: int) -> float:
    """One layer's INT2 cache (2 KV heads of 32) for one sequence: 16-token pages of history at 2 bits + fp16
    scale and zero per token and head for K and V + an int32 page entry per page; sink and recent in BF16."""
    m = context - SINK
    hist = 16 * ((m - RECENT) // 16)
    per_token = 2 * 2 * 32 * 2 / 8 + 2 * 2 * 2 * 2 + 4 / 16
    return hist * per_token + (SINK + m - hist) * 2 * 2 * 32 * 2


def plan(**sizes):
    return make_plan(llama(), PlanConfig(stages=2, seq_len=64, seqs_per_block=8, num_blocks=8,
                                         sizes=StepSizes(**sizes)), gpu=GPU, utilization=UTIL)


def rows(p) -> dict:
    return {r["step"]: r for r in p.steps["rows"]}


def test_step_sizes_are_the_products(tmp_path):
    # the plan prices the run a rendered cluster job runs: the evidence sizes (`full`)
    s, tc, rc = StepSizes(), TuneConfig(), RunConfig(out=str(tmp_path), full=True)
    assert s.tune_factors == len(tc.factors) and s.tune_tokens == tc.tokens
    assert s.widths_windows == rc.widths_windows and s.widths_length == rc.widths_length == 2048
    assert s.ppl_tokens == rc.ppl_tokens and s.needle_samples == rc.samples and (s.sink, s.recent) == (SINK, RECENT)
    assert StepSizes(context=131072).needle_lengths == [4096, 8192, 16384, 32768, 65536, 131072]
    assert StepSizes(context=6000).needle_lengths == [4096, 6000]


def test_tune_widths_and_perplexity_by_hand():
    p = plan()
    r = rows(p)
    assert [s.layers for s in p.stages] == [(0, 1), (1, 2)]
    params = [LAYER + EMBED, LAYER + HEAD]
    # tune: 6 windows of 2048 tokens through 2 stages, the last one scoring with the LM head
    t = 2048 * (layer_flops(2048) + HEAD_FLOPS) / RATE
    assert math.isclose(r["tune"]["seconds"], (6 + 1) * t + hop(2048), rel_tol=1e-12)
    assert r["tune"]["tokens"] == 6 * 2048
    assert r["tune"]["stage_bytes"] == [params[0] + working(2048), params[1] + working(2048, 2048)]
    # widths: 4 windows, forward + backward = 3 x the forward, hops both ways; every layer's activations kept
    assert math.isclose(r["widths"]["seconds"], 3 * (4 + 1) * t + 2 * hop(2048), rel_tol=1e-12)
    assert r["widths"]["stage_bytes"] == [params[0] + working(2048), params[1] + working(2048, 2048)]
    # perplexity: 12288 tokens = 3 windows of 4096
    t = 4096 * (layer_flops(4096) + HEAD_FLOPS) / RATE
    assert math.isclose(r["perplexity"]["seconds"], (3 + 1) * t + hop(4096), rel_tol=1e-12)
    assert r["perplexity"]["stage_bytes"] == [params[0] + working(4096), params[1] + working(4096, 4096)]
    # one stage of both layers: the widths keep both layers' working sets for the backward, the tune one
    one = rows(make_plan(llama(), PlanConfig(stages=1, seq_len=64, seqs_per_block=8, num_blocks=8), gpu=GPU,
                         utilization=UTIL))
    layer = working(2048) - 2 * 2048 * H * 2
    assert one["widths"]["stage_bytes"][0] - one["tune"]["stage_bytes"][0] == layer
    # calibrate: the calibration estimate and peaks, unchanged
    assert r["calibrate"]["seconds"] == p.estimate["wall_seconds"]
    assert r["calibrate"]["stage_bytes"] == [s.peak_bytes for s in p.stages]


def test_tied_embeddings_put_the_matrix_on_the_last_stage():
    """Tied: the checkpoint's head is the final norm alone; a last stage other than stage 0 loads the embedding
    matrix as its LM head for the steps after calibration."""
    c = llama()
    c.tie_word_embeddings = True
    p = make_plan(c, PlanConfig(stages=2, seq_len=64, seqs_per_block=8, num_blocks=8), gpu=GPU, utilization=UTIL)
    assert rows(p)["tune"]["stage_bytes"][1] == LAYER + H * 2 + EMBED + working(2048, 2048)
    one = make_plan(c, PlanConfig(stages=1, seq_len=64, seqs_per_block=8, num_blocks=8), gpu=GPU, utilization=UTIL)
    assert rows(one)["tune"]["stage_bytes"][0] == 2 * LAYER + EMBED + H * 2 + working(2048, 2048)


def test_needles_and_kv_cache_by_hand():
    p = plan(context=8192)
    r = rows(p)["needles"]
    total = 0.0
    for n in (4096, 8192):
        prefill = (n // 4096 + 1) * 4096 * layer_flops(n) / RATE + hop(4096)  # 4096-token chunks, no LM head
        token = (2 * LAYER + HEAD + 2 * kv_stage(n)) / BW + 2 * hop(1)         # weights + cache read once, 2 hops
        total += 20 * (prefill + 16 * token)
    assert math.isclose(r["seconds"], total, rel_tol=1e-12)
    assert r["tokens"] == 20 * (4096 + 16 + 8192 + 16)
    kv = p.steps["kv_cache"]
    assert kv["context"] == 8192 and kv["stage_bytes"] == [int(kv_stage(8192))] * 2
    assert kv["bf16_stage_bytes"] == [8192 * 2 * 2 * 32 * 2] * 2
    # a 4096-token prefill chunk's activations, the last token's logits, the cache at the longest length
    assert r["stage_bytes"] == [LAYER + EMBED + working(4096) + kv["stage_bytes"][0],
                                LAYER + HEAD + working(4096, 1) + kv["stage_bytes"][1]]
    text = format_plan(p)
    assert "KV cache of one 8,192-token sequence (int2-token)" in text and "needles: 20 samples" in text
    assert "over the budget" not in text  # no GPU size: nothing to check
    # a GPU that holds the calibration's stages but not the needles' cache: the needles row says so
    mem = max(s.peak_bytes for s in p.stages) / 0.9 / 2**30 * 1.0001
    big = make_plan(llama(), PlanConfig(stages=2, seq_len=64, seqs_per_block=8, num_blocks=8, gpu_mem_gib=mem,
                                        sizes=StepSizes(context=8192)), gpu=GPU, utilization=UTIL)
    lines = format_plan(big).splitlines()
    assert big.fits and [l.split()[0] for l in lines if l.endswith("over the budget per GPU")] == [
        "tune", "widths", "perplexity", "needles"]


def test_kv_cache_at_128k_by_hand():
    """kv_stage at 131072: 130,752 history tokens x 48.25 B + 320 BF16 tokens x 256 B = 6,390,704 B per layer."""
    assert kv_stage(131072) == 6390704
    assert plan().steps["kv_cache"]["stage_bytes"] == [6390704, 6390704]


def test_glm47_cache_and_decode_reads():
    """GLM-4.7 (92 layers, 8 KV heads of 128) at 128k: per layer 130,752 history tokens x (512 B of codes + 64 B of
    scale/zero + 0.25 B of page table) + 320 BF16 tokens x 4096 B; a MoE layer's decode reads 8 + 1 shared experts
    of its 160 + 1."""
    c = load_model_config("glm-4.7")
    p = make_plan(c, PlanConfig(stages=2, gpus_per_stage=8, gpu_mem_gib=80))
    per_layer = 130752 * (512 + 64 + 0.25) + 320 * 4096
    assert p.steps["kv_cache"]["total_bytes"] == 92 * per_layer == 7052403520
    assert p.steps["kv_cache"]["bf16_total_bytes"] == 92 * 131072 * 4096
    pb = param_bytes(c, 2)
    assert active_weight_bytes(c, pb.layers, 2, 3) == pb.layers[3] - 152 * 3 * 5120 * 1536 * 2
    assert active_weight_bytes(c, pb.layers, 2, 0) == pb.layers[0]  # dense


def test_cli_prints_and_returns_the_steps(capsys):
    assert main(["plan", "--model", "tiny-llama", "--stages", "2", "--context", "8192", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in d["steps"]["rows"]] == ["calibrate", "tune", "widths", "perplexity", "needles"]
    assert d["steps"]["kv_cache"]["context"] == 8192 and d["steps"]["sizes"]["context"] == 8192
    assert main(["plan", "--model", "tiny-llama", "--stages", "2"]) == 0
    out = capsys.readouterr().out
    assert "steps on one replica of 2 stage(s)" in out and "stage hop:" in out
    assert main(["plan", "--model", "tiny-llama", "--stages", "2", "--context", "0"]) == 2
    assert capsys.readouterr().err.startswith("oscar plan: error: --context must be >= 1")
