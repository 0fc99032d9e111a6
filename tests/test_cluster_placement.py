"""Placement of stages on nodes x GPUs, pipeline efficiency and the wall-time estimate (cluster/placement.py),
on constructed configs whose bytes and FLOPs are computed by hand below; GLM-4.7 on 2 x 8 H100 uses 16 stages."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from oscar.__main__ import main
from oscar.cluster.placement import (H100, GpuSpec, balance_by_time, estimate, flops_per_token, layer_flops_per_token,
                                     lookahead_blocks, pipeline_efficiency)
from oscar.cluster.plan import PlanConfig, load_model_config, place, plan_placed
from oscar.common import OscarError

GiB = 1 << 30
# A GPU whose links are so fast that a stage step is its compute alone (the hand arithmetic below counts layers).
FAST_LINKS = GpuSpec("test", 80.0, 989e12, 67e12, 1e30, 1e30, "test")


def llama(layers: int = 8) -> LlamaConfig:
    return LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                       torch_dtype="bfloat16")


# Bytes of one stage of that config at seq_len 64, bf16, 1-sequence micro-batches, 2 in flight:
LAYER = (128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 256 + 2 * 128) * 2  # q, k, v, o, gate/up/down, 2 norms
EMBED = 1000 * 128 * 2
BOUNDARY = 64 * 128 * 2 + 64 * (8 + 8)  # hidden states + position ids + mask
WORKING = 2 * 64 * 128 * 2 + 64 * (2 * 4 + 2 * 2) * 32 * 2 + 64 * 3 * 256 * 2 + 64 * (2 * 4 + 2 * 2) * 32 * 8
FIXED = 2 * 2 * BOUNDARY + WORKING       # 2 micro-batches in flight x (input + output) + one layer's working set


def acc_per_layer() -> int:
    """float64 accumulators of one layer for the 2 blocks in flight (the store's per-layer bytes, which
    tests/test_cluster_plan.py checks against a real store)."""
    from oscar.cluster.plan import store_bytes_per_block

    return 2 * store_bytes_per_block(llama(), seq_len=64, seqs_per_block=8, reservoir=256)["per_layer"]


def pc_for(stage_bytes: int, **kw) -> PlanConfig:
    """Sizes with a GPU of exactly `stage_bytes` usable (90 %) memory, plus one byte."""
    return PlanConfig(stages=1, gpu_mem_gib=(stage_bytes + 1) / 0.9 / GiB, seq_len=64, seqs_per_block=8,
                      num_blocks=8, **kw)


def test_hand_counted_bytes_match_the_plan():
    from oscar.cluster.plan import make_plan

    p = make_plan(llama(), PlanConfig(stages=1, seq_len=64, seqs_per_block=8, num_blocks=8))
    assert LAYER == 295424 and p.stages[0].param_bytes == 8 * LAYER + EMBED
    assert p.activation["boundary"] == BOUNDARY and p.activation["layer_working_set"] == WORKING
    assert p.stages[0].peak_bytes == 8 * LAYER + EMBED + 8 * acc_per_layer() + FIXED


def test_one_gpu_per_stage_when_a_gpu_holds_two_layers():
    unit = LAYER + acc_per_layer()
    pc = pc_for(FIXED + 2 * unit + EMBED)  # 2 layers (+ embeddings) fit one GPU, 3 do not: 3 unit > 2 unit + EMBED
    pl = place(llama(), pc, nodes=1, gpus_per_node=4, gpu=FAST_LINKS)
    # 8 layers / 2 per GPU = 4 stages at least; 4 GPUs = 4 stage slots
    assert (pl.stages, pl.gpus_per_stage, pl.replicas, pl.idle_gpus, pl.crosses_nodes) == (4, 1, 1, 0, False)
    assert pl.layers == "0:2,2:4,4:6,6:8"


def test_two_gpus_per_stage_when_one_layer_does_not_fit_one_gpu():
    unit = LAYER + acc_per_layer()
    # per GPU half of one layer's stage: one GPU holds no layer (FIXED + unit > budget), two hold one
    pc = pc_for((FIXED + unit + EMBED) // 2 + 1)
    assert (FIXED + unit + EMBED) // 2 + 1 < FIXED + unit and 2 * ((FIXED + unit + EMBED) // 2 + 1) < FIXED + 2 * unit
    pl = place(llama(), pc, nodes=2, gpus_per_node=8, gpu=FAST_LINKS)
    # 8 stages of 1 layer x 2 GPUs = 16 GPUs: the 8 stages of the one replica span both nodes
    assert (pl.stages, pl.gpus_per_stage, pl.replicas, pl.idle_gpus, pl.crosses_nodes) == (8, 2, 1, 0, True)
    assert any("1 GPU(s) per stage: a single layer does not fit" in w for w in pl.why)
    with pytest.raises(OscarError, match=r"no placement fits on 1 x 8 GPUs .* 2 GPU\(s\) per stage: needs 8 stages, "
                                         r"4 stage slots"):
        place(llama(), pc, nodes=1, gpus_per_node=8, gpu=FAST_LINKS)


def test_several_nodes_choose_replicas_by_wall_time():
    unit = LAYER + acc_per_layer()
    pc = pc_for(FIXED + 4 * unit + EMBED)  # 4 layers per GPU: 2 stages at least
    pl = place(llama(), pc, nodes=2, gpus_per_node=4, gpu=FAST_LINKS)
    # 8 blocks x 8 one-sequence micro-batches = 64; every layer costs the same time u; wall = (M/R + P - 1) x slowest:
    # P=2 R=4: (16 + 1) x 4u = 68u   P=3 R=2: (32 + 2) x 3u = 102u   P=4 R=2: (32 + 3) x 2u = 70u
    # P=5..7 R=1: (64 + P - 1) x 2u >= 136u   P=8 R=1: (64 + 7) x 1u = 71u
    assert (pl.stages, pl.gpus_per_stage, pl.replicas, pl.idle_gpus, pl.crosses_nodes) == (2, 1, 4, 0, False)
    pinned = place(llama(), pc, nodes=2, gpus_per_node=4, gpu=FAST_LINKS, stages=8)
    assert (pinned.stages, pinned.replicas, pinned.crosses_nodes) == (8, 1, True)
    with pytest.raises(OscarError, match=r"--stages 1 does not fit \(from 2 stages\)"):
        place(llama(), pc, nodes=2, gpus_per_node=4, gpu=FAST_LINKS, stages=1, gpus_per_stage=1)


def test_efficiency_formula_and_lookahead():
    assert pipeline_efficiency(8, 4) == 8 / 11  # M / (M + P - 1)
    assert pipeline_efficiency(1, 1) == 1.0 and pipeline_efficiency(512, 16) == 512 / 527
    with pytest.raises(OscarError, match="M >= 1 and P >= 1"):
        pipeline_efficiency(0, 4)
    # blocks in flight: ceil(P / micro-batches per block) + 1, at least 2
    assert lookahead_blocks(2, 8) == 2 and lookahead_blocks(16, 8) == 3 and lookahead_blocks(4, 1) == 5


def test_wall_time_estimate_of_a_tiny_config():
    c = llama(2)
    # per token and layer at seq_len 8: projections 2*128*(4+2*2)*32 + 2*4*32*128 = 98304; causal scores
    # 2*2*4*32*(8+1)/2 = 2304; MLP 2*3*128*256 = 196608; capture 2*32*32*(2*4 + 3*2) = 28672 (float64)
    f = layer_flops_per_token(c, 0, 8)
    assert (f["attention"], f["mlp"], f["capture"]) == (98304 + 2304, 196608, 28672)
    assert flops_per_token(c, 8)["matmul"] == 2 * (98304 + 2304 + 196608)
    gpu = GpuSpec("toy", 1.0, 1e12, 1e11, 1e9, 1e8, "made up")
    e = estimate(c, [(0, 1), (1, 2)], replicas=1, gpus_per_stage=1, seq_len=8, micro_batch=1, seqs_per_block=2,
                 num_blocks=3, boundary_bytes=4096, gpu=gpu, utilization=0.5)
    # a stage step: 8 tokens x (297216 / (0.5 x 1e12) + 28672 / (0.5 x 1e11)) = 9.342976e-6 s;
    # transfer 4096 B / 1e9 B/s = 4.096e-6 s < step (hidden); M = 3 blocks x 2 = 6; wall = (6 + 2 - 1) x step
    step = 8 * (297216 / 0.5e12 + 28672 / 0.5e11)
    assert e.stage_seconds == pytest.approx([step, step], rel=1e-12)
    assert e.transfer_seconds == pytest.approx(4.096e-6) and e.micro_batches == 6 and e.tokens == 3 * 2 * 8
    assert e.efficiency == 6 / 7 and e.wall_seconds == pytest.approx(7 * step, rel=1e-12)
    # between nodes at 1e8 B/s the transfer (40.96 us) is the step
    far = estimate(c, [(0, 1), (1, 2)], replicas=1, gpus_per_stage=1, seq_len=8, micro_batch=1, seqs_per_block=2,
                   num_blocks=3, boundary_bytes=4096, gpu=gpu, utilization=0.5, crosses_nodes=True)
    assert far.wall_seconds == pytest.approx(7 * 4096 / 1e8)
    assert any("utilization 50% assumed" in a for a in e.assumptions)


def test_balance_by_time_respects_memory():
    # times 1,1,1,3: with room for 3 layers per stage the best split is (0:3, 3:4), slowest 3; with room for 2
    # that split does not fit and (0:2, 2:4) is the best that does, slowest 1 + 3 = 4; with room for 1, none fits
    assert balance_by_time([1, 1, 1, 3], [1, 1, 1, 1], 2, budget=3) == [(0, 3), (3, 4)]
    assert balance_by_time([1, 1, 1, 3], [1, 1, 1, 1], 2, budget=2) == [(0, 2), (2, 4)]
    assert balance_by_time([1, 1, 1, 3], [1, 1, 1, 1], 2, budget=1) is None


def test_glm47_on_two_nodes_of_eight_h100_uses_sixteen_stages(capsys, tmp_path):
    c = load_model_config("glm-4.7")
    p = plan_placed(c, PlanConfig(stages=1, gpu_mem_gib=H100.mem_gib), nodes=2, gpus_per_node=8)
    pl = p.placement
    # ~656 GiB of bf16 weights need 10 stages of 72 GiB (90 % of 80); 16 GPUs give 16 one-GPU stages, one replica
    assert (pl["stages"], pl["gpus_per_stage"], pl["replicas"], pl["idle_gpus"]) == (16, 1, 1, 0)
    assert p.fits and len(p.stages) == 16 and p.stages[-1].layers[1] == 92
    e = p.estimate
    assert e["micro_batches"] == 64 * 8 and e["efficiency"] == 512 / (512 + 15)
    # the layout of one stage per node (2 x 8 GPUs, one computing at a time) is ~7x slower by the same arithmetic
    from oscar.cluster.plan import make_plan

    old = make_plan(c, PlanConfig(stages=2, gpus_per_stage=8, gpu_mem_gib=80)).estimate
    assert old["wall_seconds"] > 6 * e["wall_seconds"]
    big_corpus = tmp_path / "big.txt"  # about 2 M tokens: the 64 blocks the figures below are for
    big_corpus.write_text("\n\n".join(f"Paragraph {i}. " + "Some calibration prose here. " * 40 for i in range(9000)))
    assert main(["plan", "--model", "glm-4.7", "--nodes", "2", "--gpus-per-node", "8", "--gpu", "h100",
                 "--blocks", "64", "--corpus", str(big_corpus)]) == 0
    out = capsys.readouterr().out
    assert "placement: 1 replica(s) x 16 stage(s) x 1 GPU(s) on 2 node(s) x 8 GPUs (0 idle" in out
    assert "pipeline efficiency 97.2% (M/(M+P-1), M = 512 micro-batches per replica, P = 16)" in out
    for what in ("FLOPs per token", "989 TFLOP/s BF16", "utilization 40% assumed", "stage boundary: 40.1 MiB",
                 "micro-batches: 512 per replica", "tokens: 64 blocks x 8 sequences x 4096"):
        assert what in out, what
    assert main(["plan", "--model", "glm-4.7", "--nodes", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["placement"]["stages"] == 16
    # refusals stay one line
    assert main(["plan", "--model", "glm-4.7", "--nodes", "1", "--gpus-per-node", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("oscar plan: error: no placement fits on 1 x 8 GPUs of 80 GiB")
    assert main(["plan", "--model", "glm-4.7"]) == 2
    assert "give --stages N, or --nodes N" in capsys.readouterr().err
    # explicit ranges fix the stage count; the placement still picks GPUs per stage and replicas
    two = plan_placed(c, PlanConfig(stages=1, gpu_mem_gib=141, layers="0:46,46:92"), nodes=1, gpus_per_node=8)
    assert (two.placement["stages"], two.placement["gpus_per_stage"], two.placement["replicas"]) == (2, 4, 1)
    assert two.placement["why"][-1] == "layer ranges 0:46,46:92: as given"
