"""Placement: how many stages, GPUs per stage and replicas a cluster of nodes runs, and what it costs in time.

A stage runs its layers one after another, so a stage of g GPUs computes on one GPU at a time: g > 1
only buys memory. The placement therefore takes the fewest GPUs per stage whose stages still fit
(one per GPU whenever one GPU holds a share of the layers), then the stage count and replica count
that fill the GPUs with the shortest estimated wall time. Micro-batches flow through the stages
(cluster/pipeline.py), so with M micro-batches per replica and P stages a stage computes
M of the M + P - 1 steps of the schedule: efficiency M / (M + P - 1).

The wall-time estimate is arithmetic on the config (no weights, no GPU): forward FLOPs per token
(attention projections, causal scores, dense or active-expert MLP), the capture's float64 Grams, the
GPU's datasheet FLOP/s times an assumed utilization, and the hidden states crossing each stage boundary
at an assumed link bandwidth. `Estimate.assumptions` lists every input, and the CLI prints them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from oscar.cluster.balance import balance
from oscar.common import OscarError, attention_shapes, is_latent, latent_shapes, num_layers


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one GPU (dense, i.e. without 2:4 sparsity)."""

    name: str
    mem_gib: float          # memory `oscar plan --gpu-mem` checks against (nominal, as the datasheet names it)
    bf16_flops: float       # dense BF16 tensor-core FLOP/s
    fp64_flops: float       # FP64 tensor-core FLOP/s (the capture accumulates in float64)
    intra_node_bytes_s: float  # stage boundary within a node: host copy over PCIe Gen5 x16 (Ray's object store)
    inter_node_bytes_s: float  # stage boundary between nodes: one 400 Gb/s NIC per GPU
    source: str
    hbm_bytes_s: float = 3.35e12  # memory bandwidth: what a decode token's weight and cache reads run at


# NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 989 TFLOP/s dense (1,979 with sparsity), FP64 tensor
# 67 TFLOP/s, 80 GB HBM3. H200 datasheet (SXM): the same compute, 141 GB HBM3e. PCIe Gen5 x16 64 GB/s per
# direction; DGX H100 / p5 nodes pair each GPU with a 400 Gb/s (50 GB/s) ConnectX-7 NIC. Hidden states go
# through Ray's object store in host memory, not NVLink, so NVLink's 450 GB/s per direction is not used.
# Memory bandwidth: H100 SXM 3.35 TB/s (HBM3), H200 SXM 4.8 TB/s (HBM3e).
H100 = GpuSpec("H100 SXM 80GB", 80.0, 989e12, 67e12, 64e9, 50e9,
               "NVIDIA H100 datasheet (SXM5, dense); PCIe Gen5 x16; 400 Gb/s NIC per GPU", 3.35e12)
H200 = GpuSpec("H200 SXM 141GB", 141.0, 989e12, 67e12, 64e9, 50e9,
               "NVIDIA H200 datasheet (SXM, dense; H100 compute, 141 GB HBM3e); PCIe Gen5 x16; 400 Gb/s NIC per GPU",
               4.8e12)
GPUS = {"h100": H100, "h200": H200}
# Share of the datasheet FLOP/s a calibration forward reaches: batch-1 4k-token prefills with small
# expert matmuls and eager capture; 0.4 is a planning figure, not a measurement on GPUs.
UTILIZATION = 0.4


def gpu_spec(name: str) -> GpuSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise OscarError(f"--gpu {name!r}: one of {', '.join(GPUS)}") from None


# --------------------------------------------------------------------------- FLOPs

def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def num_experts(config) -> int | None:
    """Routed experts of a MoE text config (None for a dense one), under the names transformers' configs use."""
    for k in ("n_routed_experts", "num_local_experts", "num_experts"):
        v = getattr(config, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def is_moe_layer(config, layer: int) -> bool:
    """Whether decoder layer `layer` routes to experts (GLM/DeepSeek `first_k_dense_replace`, Qwen-MoE
    `decoder_sparse_step` / `mlp_only_layers`)."""
    k = getattr(config, "first_k_dense_replace", None)
    if k is not None:
        return layer >= k
    every = getattr(config, "decoder_sparse_step", 1) or 1
    skip = getattr(config, "mlp_only_layers", []) or []
    return layer not in skip and (layer + 1) % every == 0


def layer_flops_per_token(config, layer: int, seq_len: int) -> dict:
    """Forward FLOPs of one decoder layer per token of a `seq_len` window (2 FLOPs per multiply-add).

    attention: q/k/v/o projections + causal scores and weighted sum over (seq_len + 1) / 2 keys on average;
    mlp: the dense MLP, or the router + the top-k routed experts + the shared experts (active only);
    capture: the float64 Grams the capture adds, (2 Hq + 3 Hkv) D x D outer products per token
    (q, o per query head; k, v and the value-weighted Gram per KV head; moments are O(D), left out); an MLA
    layer's are its latent's (below)."""
    c = _text(config)
    ctx = (seq_len + 1) / 2  # keys a query reads on average
    if is_latent(c):
        # MLA: q_a / q_b, kv_a (latent + RoPE key), kv_b (every head's k_nope and v from the latent), o; scores over
        # nope + RoPE dims, the weighted sum over v dims. Capture: the absorbed queries q̃ = q_nope W_UK (H nope r),
        # the attention-weighted latent (a second weighted sum over r dims) and three r x r Grams (c, q̃ and õ per head)
        m = latent_shapes(c)
        h, H, r, dr, dn, dv = c.hidden_size, m["num_heads"], m["kv_lora_rank"], m["rope_dim"], m["nope_dim"], m["v_dim"]
        qr = m["q_lora_rank"]
        qproj = 2 * (h * qr + qr * H * (dn + dr)) if qr else 2 * h * H * (dn + dr)
        proj = qproj + 2 * h * (r + dr) + 2 * r * H * (dn + dv) + 2 * H * dv * h
        scores = 2 * H * (dn + dr + dv) * ctx
        capture = 2 * H * dn * r + 2 * H * r * ctx + 2 * r * r * (1 + 2 * H)
    else:
        sh = attention_shapes(c)
        h, hq, hkv, d = c.hidden_size, sh["num_q_heads"], sh["num_kv_heads"], sh["head_dim"]
        proj = 2 * h * (hq + 2 * hkv) * d + 2 * hq * d * h
        scores = 2 * 2 * hq * d * ctx
        capture = 2 * d * d * (2 * hq + 3 * hkv)
    e = num_experts(c)
    if e and is_moe_layer(c, layer):
        inter = c.moe_intermediate_size
        k = getattr(c, "num_experts_per_tok", 1) or 1
        shared = ((getattr(c, "n_shared_experts", 0) or 0) * inter            # GLM / DeepSeek
                  + (getattr(c, "shared_expert_intermediate_size", 0) or 0))  # Qwen-MoE
        mlp = 2 * h * e + 2 * 3 * h * (k * inter + shared)
    else:
        mlp = 2 * 3 * h * c.intermediate_size
    return {"attention": proj + scores, "mlp": mlp, "capture": capture}


def flops_per_token(config, seq_len: int, layers: tuple[int, int] | None = None) -> dict:
    """Sums of `layer_flops_per_token` over `layers` [a, b) (default: every layer); the LM head is not run."""
    a, b = layers or (0, num_layers(config))
    per = [layer_flops_per_token(config, l, seq_len) for l in range(a, b)]
    out = {k: sum(p[k] for p in per) for k in ("attention", "mlp", "capture")}
    out["matmul"] = out["attention"] + out["mlp"]
    return out


def fmt_seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def pipeline_efficiency(micro_batches: int, stages: int) -> float:
    """Share of the schedule a stage computes: M / (M + P - 1) (fill and drain take P - 1 steps)."""
    if micro_batches < 1 or stages < 1:
        raise OscarError(f"pipeline efficiency needs M >= 1 and P >= 1, got M={micro_batches}, P={stages}")
    return micro_batches / (micro_batches + stages - 1)


def lookahead_blocks(stages: int, micro_batches_per_block: int) -> int:
    """Blocks a replica keeps in flight so that stage 0 never waits for the driver: the next block must be
    submitted before stage 0 finishes the current one, i.e. while the oldest in-flight block still drains
    through P - 1 stages (+1 micro-batch of slack for the commit and the driver's round trip)."""
    return max(2, math.ceil(stages / max(1, micro_batches_per_block)) + 1)


def balance_by_time(times: list[float], peaks: list[float], stages: int, budget: float,
                    first_extra: float = 0.0) -> list[tuple[int, int]] | None:
    """Contiguous layer ranges minimising the slowest stage's time (`times` per layer) among the splits
    whose every stage holds its memory (`peaks` per layer, stage 0 also `first_extra`, each stage <= `budget`);
    None when no split fits."""
    return balance(times, stages, mem=peaks, budget=budget, first_mem=first_extra)


# --------------------------------------------------------------------------- estimate

@dataclass
class Estimate:
    tokens: int                   # calibration tokens, all replicas
    replicas: int
    stages: int
    gpus_per_stage: int
    micro_batches: int            # per replica
    micro_batch_tokens: int
    efficiency: float             # M / (M + P - 1)
    balance: float                # mean / slowest stage step (ranges balanced by bytes are not by FLOPs)
    flops_per_token: dict         # whole model
    stage_seconds: list[float]    # per micro-batch: compute (+ transfer beyond it) of each stage
    transfer_seconds: float       # one boundary crossing of one micro-batch (the slowest link used)
    wall_seconds: float           # (M + P - 1) x slowest stage step
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def estimate(config, ranges: list[tuple[int, int]], *, replicas: int, gpus_per_stage: int, seq_len: int,
             micro_batch: int, seqs_per_block: int, num_blocks: int, boundary_bytes: int, gpu: GpuSpec = H100,
             utilization: float = UTILIZATION, crosses_nodes: bool = False) -> Estimate:
    """Wall time of the pipelined calibration of `num_blocks` blocks (compute only: model loading and the
    Ray start are not in it). Each stage step = its FLOPs per micro-batch at `utilization` of one GPU
    (a stage runs its layers one GPU after another), or the boundary transfer when that is longer (Ray
    pulls the next micro-batch's input while the stage computes the current one)."""
    if not 0 < utilization <= 1:
        raise OscarError(f"utilization must be in (0, 1], got {utilization:g}")
    p = len(ranges)
    mb_per_block = math.ceil(seqs_per_block / micro_batch)
    m = math.ceil(num_blocks / replicas) * mb_per_block
    mb_tokens = micro_batch * seq_len
    link = gpu.inter_node_bytes_s if crosses_nodes else gpu.intra_node_bytes_s
    transfer = boundary_bytes / link if p > 1 else 0.0
    steps = []
    for a, b in ranges:
        f = flops_per_token(config, seq_len, (a, b))
        compute = mb_tokens * (f["matmul"] / gpu.bf16_flops + f["capture"] / gpu.fp64_flops) / utilization
        steps.append(max(compute, transfer))
    slowest = max(steps)
    wall = (m + p - 1) * slowest
    total = flops_per_token(config, seq_len)
    tokens = num_blocks * seqs_per_block * seq_len
    assumptions = [
        f"tokens: {num_blocks} blocks x {seqs_per_block} sequences x {seq_len} = {tokens:,} "
        f"({math.ceil(num_blocks / replicas)} blocks per replica)",
        f"FLOPs per token (forward, 2 per multiply-add): attention {total['attention'] / 1e9:.2f} G (projections "
        f"+ causal scores over {(seq_len + 1) / 2:g} keys on average), MLP {total['mlp'] / 1e9:.2f} G (dense, or "
        f"router + active experts), capture {total['capture'] / 1e9:.2f} G float64 Grams; LM head not run",
        f"GPU {gpu.name}: {gpu.bf16_flops / 1e12:g} TFLOP/s BF16, {gpu.fp64_flops / 1e12:g} TFLOP/s FP64 "
        f"({gpu.source}); utilization {utilization:.0%} assumed",
        f"a stage of {gpus_per_stage} GPU(s) computes on one GPU at a time (its layers run one after another)",
        f"micro-batches: {m} per replica ({mb_per_block} per block of {seqs_per_block} sequences, {micro_batch} "
        f"per micro-batch); efficiency M/(M+P-1) = {m}/({m}+{p}-1) = {pipeline_efficiency(m, p):.1%}",
        f"stage boundary: {boundary_bytes / 2**20:.1f} MiB per micro-batch at {link / 1e9:g} GB/s "
        f"({'between nodes' if crosses_nodes else 'within a node'}, through Ray's object store) = "
        f"{transfer * 1e3:.2f} ms, overlapped with the stage's compute",
        "not included: model loading, Ray start, store writes (overlapped with the next stage's compute)",
    ]
    return Estimate(tokens, replicas, p, gpus_per_stage, m, mb_tokens, pipeline_efficiency(m, p),
                    sum(steps) / p / slowest, total, steps, transfer, wall, assumptions)


# --------------------------------------------------------------------------- placement

@dataclass
class Placement:
    nodes: int
    gpus_per_node: int
    stages: int                   # per replica
    gpus_per_stage: int
    replicas: int
    idle_gpus: int
    crosses_nodes: bool           # some replica's stages span nodes (a replica does not divide a node's GPUs)
    why: list[str] = field(default_factory=list)  # why these numbers (printed)
    layers: str | None = None     # `--stage-layers` balancing compute time (None: balanced by bytes)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def to_dict(self) -> dict:
        return asdict(self)
