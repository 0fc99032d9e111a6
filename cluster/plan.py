"""Planning: memory per stage, activations per micro-batch, store size, stage count.

Everything is computed from the model config: parameter counts come from the
model built on the meta device (exact for any transformers architecture, no
memory), store bytes from the `oscar-calib/1` array list (docs/store-format.md).
The same function plans GLM-4.7 on paper and the tiny presets that the tests run.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace

import numpy as np
from transformers import CONFIG_MAPPING

from oscar.cluster.balance import balance_layers  # noqa: F401  (re-exported: plan's public API)
from oscar.cluster.loading import build_skeleton
from oscar.cluster.placement import (H100, UTILIZATION, GpuSpec, Placement, balance_by_time, estimate, fmt_seconds,
                                     is_moe_layer, layer_flops_per_token, num_experts)
from oscar.cluster.steps import StepSizes, estimate_steps
from oscar.common import OscarError, attention_shapes, canonical_json, is_latent, latent_shapes, num_layers
from oscar.modelconfig import layer_of
from oscar.modelconfig import load_model_config as _load_model_config
from oscar.pipeline.models import checkpoint_quantization
from oscar.pipeline.store import latent_layer_arrays, layer_arrays
from oscar.pipeline.corpus import estimate_size

GiB = 1 << 30
CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float8": 1, "fp8": 1}


# --------------------------------------------------------------------------- config

def load_model_config(spec: str):
    """A transformers config from a config.json path, a model directory, a config shipped in
    cluster/configs (`glm-4.7`), or a model name (oscar.modelconfig: presets, the embedded model...)."""
    return _load_model_config(spec, shipped=CONFIG_DIR)


# --------------------------------------------------------------------------- parameters

@dataclass
class ParamBytes:
    embed: int            # token embeddings (first stage)
    layers: list[int]     # per decoder layer, MoE experts included
    head: int             # final norm + LM head: loaded by nobody
    dtype_bytes: int

    @property
    def total(self) -> int:
        return self.embed + sum(self.layers) + self.head


def param_bytes(config, dtype_bytes: int) -> ParamBytes:
    """Exact parameter bytes per decoder layer, from the model built on the meta device."""
    counts = _param_counts(canonical_json(config.to_dict()))
    return ParamBytes(counts.embed * dtype_bytes, [n * dtype_bytes for n in counts.layers],
                      counts.head * dtype_bytes, dtype_bytes)


@functools.lru_cache(maxsize=8)
def _param_counts(config_json: str) -> ParamBytes:
    """Parameter counts (1 byte per parameter) of a config, cached: GLM-4.7's meta model takes seconds."""
    d = json.loads(config_json)
    config = CONFIG_MAPPING[d["model_type"]].from_dict(d)
    dtype_bytes = 1
    model = build_skeleton(config)
    tied = bool(getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                        "tie_word_embeddings", False))
    nl = num_layers(config)
    layers = [0] * nl
    embed = head = 0
    for name, p in model.named_parameters():
        n = p.numel() * dtype_bytes
        li = layer_of(name)
        if li is not None:
            layers[li] += n
        elif "embed_tokens" in name:
            embed += n
        elif name.startswith("lm_head") and tied:
            continue  # tied to the embeddings: no separate tensor
        else:
            head += n
    del model
    return ParamBytes(embed, layers, head, dtype_bytes)


def parse_ranges(text: str, num_layers: int) -> list[tuple[int, int]]:
    """`0:10,10:30` -> [(0, 10), (10, 30)]; must tile [0, num_layers) contiguously."""
    try:
        ranges = [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
    except ValueError as e:
        raise OscarError(f"--stage-layers {text!r}: expected START:STOP,START:STOP,...") from e
    pos = 0
    for r in ranges:
        if len(r) != 2 or r[0] != pos or r[1] <= r[0]:
            raise OscarError(f"--stage-layers {text!r}: ranges must be contiguous, non-empty and start at 0")
        pos = r[1]
    if pos != num_layers:
        raise OscarError(f"--stage-layers {text!r}: ranges end at {pos}, the model has {num_layers} layers")
    return ranges  # type: ignore[return-value]


# --------------------------------------------------------------------------- store

def store_bytes_per_block(config, *, seq_len: int, seqs_per_block: int, reservoir: int) -> dict:
    """Uncompressed bytes one block adds to a store (docs/store-format.md): per-head arrays, or a latent store's."""
    if is_latent(config):
        L, arrays = num_layers(config), latent_layer_arrays(latent_shapes(config)["kv_lora_rank"], reservoir)
    else:
        sh = attention_shapes(config)
        L, arrays = sh["num_layers"], layer_arrays(sh["num_kv_heads"], sh["head_dim"], reservoir)
    per_layer = sum(np.dtype(dt).itemsize * int(np.prod(tail)) for dt, tail in arrays.values())
    n_exp = _num_experts(config)
    moe_layers = [l for l in range(L) if _is_moe_layer(config, l)] if n_exp else []
    experts = len(moe_layers) * n_exp * 8  # layers/{l}/expert_tokens, int64
    tokens = seqs_per_block * seq_len * (4 + 1)  # tokens int32 + mask uint8
    done = L
    return {"per_layer": per_layer, "layers": per_layer * L, "experts": experts, "tokens": tokens, "done": done,
            "total": per_layer * L + experts + tokens + done}


def _num_experts(config) -> int:
    return num_experts(config.get_text_config() if hasattr(config, "get_text_config") else config) or 0


_is_moe_layer = is_moe_layer  # the name cluster/pipeline.py imports


# --------------------------------------------------------------------------- activations

def activation_bytes(config, *, micro_batch: int, seq_len: int, act_bytes: int) -> dict:
    """Bytes per micro-batch: what crosses a stage boundary, and the working set of one layer."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    tok = micro_batch * seq_len
    hid = c.hidden_size
    boundary = tok * hid * act_bytes + tok * (8 + 8)  # hidden states + position ids + padding mask
    if is_latent(c):
        # MLA: q and the expanded k (nope + RoPE), v and o per head, the latent; the capture's attention-weighted
        # latent (H x r) in the compute dtype, and its float64 latent, absorbed queries and õ rows of a sequence
        m = latent_shapes(c)
        H, r, qk = m["num_heads"], m["kv_lora_rank"], m["nope_dim"] + m["rope_dim"]
        attn = tok * (2 * H * qk + 2 * H * m["v_dim"] + r + m["rope_dim"] + H * r) * act_bytes
        capture = tok * (r + 2 * H * r) * 8
    else:
        sh = attention_shapes(c)
        hq, hkv, d = sh["num_q_heads"], sh["num_kv_heads"], sh["head_dim"]
        attn = tok * (2 * hq + 2 * hkv) * d * act_bytes    # q, o and k, v
        capture = tok * (2 * hq + 2 * hkv) * d * 8          # float64 copies of q/o/k/v for the statistics
        H = hq
    inter = c.intermediate_size
    if _num_experts(c):
        inter = max(inter, c.moe_intermediate_size * (1 + getattr(c, "n_shared_experts", 0) or 0))
    mlp = tok * 3 * inter * act_bytes                  # gate, up, act(gate)*up
    scores = micro_batch * H * seq_len * seq_len * act_bytes  # only if the implementation materialises S
    return {"boundary": boundary, "layer_working_set": 2 * tok * hid * act_bytes + attn + mlp + capture,
            "scores_if_materialised": scores}


# --------------------------------------------------------------------------- plan

@dataclass
class StagePlan:
    stage: int
    layers: tuple[int, int]
    param_bytes: int
    embeddings: bool
    accumulator_bytes: int   # float64 per-block statistics held while a block is in flight
    peak_bytes: int          # params + accumulators + in-flight activations
    per_gpu_bytes: int


@dataclass
class Plan:
    model: str
    num_layers: int
    total_param_bytes: int
    loaded_param_bytes: int   # without the LM head / final norm
    stages: list[StagePlan]
    gpus_per_stage: int
    activation: dict
    store_per_block: dict
    num_blocks: int
    store_total_bytes: int
    suggested_stages: int | None
    gpu_mem_bytes: int | None
    notes: list[str] = field(default_factory=list)
    budget_bytes: int | None = None   # per GPU: gpu_mem x usable (None without a GPU size)
    fits: bool | None = None          # every stage's peak within its GPUs' budget (None without a GPU size)
    weights_mode: str = ""            # how the loaders hold the weights (block FP8: dequantized at load)
    estimate: dict | None = None      # placement.Estimate: efficiency and wall time of the pipelined part
    placement: dict | None = None     # placement.Placement, when planned for --nodes x --gpus-per-node
    steps: dict | None = None         # steps.Steps: memory and time of every step on one replica

    def to_dict(self) -> dict:
        return asdict(self)


# Blocks planned when neither --tokens / --blocks nor a corpus readable here says how many.
DEFAULT_BLOCKS = 64


@dataclass
class PlanConfig:
    """What `make_plan` sizes: the pipeline's shape and the calibration job's block sizes.

    Not CalibConfig: there seqs_per_block / blocks are optional and derived from the corpus,
    here they are given (the plan is made before any corpus is read)."""
    stages: int
    gpus_per_stage: int = 1
    gpu_mem_gib: float | None = None  # per GPU; with it the plan suggests the smallest stage count that fits
    seq_len: int = 4096
    micro_batch: int = 1              # sequences per micro-batch
    seqs_per_block: int = 8
    num_blocks: int = 64
    reservoir: int = 256
    dtype: str | None = None          # weights and activations; default: the config's dtype
    layers: str | None = None         # explicit ranges "0:10,10:30"; default: balanced by parameter bytes
    in_flight: int = 2                # micro-batches in flight per stage
    usable: float = 0.9               # share of GPU memory a stage may plan for
    name: str = ""                    # model name in the plan (default: the config's model_type)
    sizes: StepSizes = field(default_factory=StepSizes)  # the steps after calibration (cluster/steps.py)

    def check(self) -> None:
        """Refuse sizes that cannot describe a job, before any config is read."""
        for flag, v in (("--stages", self.stages), ("--gpus-per-stage", self.gpus_per_stage),
                        ("--seq-len", self.seq_len), ("--batch-size", self.micro_batch),
                        ("--seqs-per-block", self.seqs_per_block), ("--blocks", self.num_blocks),
                        ("in_flight", self.in_flight)):
            if v < 1:
                raise OscarError(f"{flag} must be >= 1, got {v}")
        if self.reservoir < 0:
            raise OscarError(f"--reservoir must be >= 0, got {self.reservoir}")
        if self.gpu_mem_gib is not None and not (math.isfinite(self.gpu_mem_gib) and self.gpu_mem_gib > 0):
            raise OscarError(f"--gpu-mem must be a positive number of GiB, got {self.gpu_mem_gib:g}")
        if not 0 < self.usable <= 1:
            raise OscarError(f"usable share of GPU memory must be in (0, 1], got {self.usable:g}")
        if self.dtype is not None and self.dtype.removeprefix("torch.") not in _DTYPE_BYTES:
            raise OscarError(f"--dtype {self.dtype!r}: one of {sorted(_DTYPE_BYTES)}")
        self.sizes.check()


# Calibration tokens recommended per unit of head_dim. Measured (bench/calib_budget.py, docs/calibrate.md "How many
# calibration tokens"): on SmolLM2-135M and Qwen2.5-0.5B (head_dim 64) the rotations fitted on 16k tokens span the
# same leading subspaces as on the whole pydoc split (median 1 - mean cos² 4e-4), and strict perplexity and needles
# do not tell them apart. The recommendation keeps 4x that margin, 65,536 tokens at head_dim 64, and scales it with
# head_dim (the sampling error of a D-dimensional covariance's eigen-subspace grows as sqrt(D / rows)).
RECOMMENDED_TOKENS_PER_DIM = 1024


def recommended_tokens(head_dim: int) -> int:
    return RECOMMENDED_TOKENS_PER_DIM * int(head_dim)


def corpus_budget(corpus: str, *, seq_len: int, seqs_per_block: int, tokens: int | None = None,
                  blocks: int | None = None, larger: str = "", end: str = "", head_dim: int | None = None
                  ) -> tuple[int, str]:
    """(blocks to plan, a note saying where they come from): `tokens` or `blocks` as asked, else the recommended
    budget for `head_dim` (`recommended_tokens`; the whole corpus when it gives less, or without head_dim),
    checked against the corpus's size estimated without a tokenizer (pipeline/corpus.py `estimate_size`); asking
    beyond the estimate and its uncertainty is refused in one line. A corpus file not readable here is not
    checked: `oscar calibrate` checks it before loading the model."""
    per_block = seqs_per_block * seq_len
    rec = recommended_tokens(head_dim) if head_dim else None
    est = estimate_size(corpus)
    if est is None:
        n = blocks or (math.ceil(tokens / per_block) if tokens else
                       math.ceil(rec / per_block) if rec else DEFAULT_BLOCKS)
        return n, (f"corpus {corpus}: not readable here, so {n} blocks ({n * per_block:,} tokens) "
                   "are not checked against it; `oscar calibrate` checks them before loading the model")
    asked = tokens or (blocks * per_block if blocks else None)
    if asked and asked > est.most_tokens:
        flag = (f"--tokens {tokens:,}" if tokens else
                f"--blocks {blocks} (x {seqs_per_block} sequences x {seq_len} = {asked:,} tokens)")
        fewer = (f"--tokens {est.tokens} or fewer" if tokens else
                 f"--blocks {math.ceil(est.tokens / per_block)} or fewer")
        raise OscarError(f"{flag} asks for more than the corpus gives: {est.describe()}; pass --corpus with a "
                         f"larger file{larger}, or {fewer}{end}")
    whole = not (tokens or blocks) and not (rec and rec < est.tokens)
    n = blocks or max(1, math.ceil((tokens or (est.tokens if whole else rec)) / per_block))
    why = ("" if tokens or blocks else
           f" (the recommended {rec:,} tokens for head_dim {head_dim})" if not whole else
           " (the whole split; --corpus FILE for more)")
    if rec and n * per_block < rec:
        why += f"; below the {rec:,} tokens recommended for head_dim {head_dim} (docs/calibrate.md)"
    return n, f"{est.describe()}: {n} block(s) of {seqs_per_block} x {seq_len} tokens{why}"


def make_plan(config, pc: PlanConfig, *, gpu: GpuSpec = H100, utilization: float = UTILIZATION, replicas: int = 1,
              crosses_nodes: bool = False) -> Plan:
    """Plan a pipeline of `pc.stages` stages with `pc.gpus_per_stage` GPUs each (`replicas` of it, for the
    wall-time estimate on `gpu`)."""
    pc.check()
    dtype = pc.dtype or str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    dtype = dtype.removeprefix("torch.")
    if dtype not in _DTYPE_BYTES:
        raise OscarError(f"--dtype {dtype!r}: one of {sorted(_DTYPE_BYTES)}")
    nb = _DTYPE_BYTES[dtype]
    # The bytes of the mode the loaders use: a block-FP8 checkpoint is dequantized at load (FP8 is not kept,
    # on CUDA either; oscar.pipeline.models), so its weights count at the compute dtype, like a BF16 one.
    # Any other quantization is refused here as the loaders refuse it.
    block = checkpoint_quantization(config, f"model config {pc.name or getattr(config, 'model_type', '')}".strip())
    weights_mode = (f"block FP8 checkpoint ({block[0]}x{block[1]} blocks) dequantized at load to {dtype}"
                    if block else f"unquantized checkpoint loaded in {dtype}")
    pb = param_bytes(config, nb)
    nl = len(pb.layers)
    ranges = parse_ranges(pc.layers, nl) if pc.layers else balance_layers(pb.layers, pc.stages, pb.embed)
    if len(ranges) != pc.stages:
        raise OscarError(f"--stage-layers gives {len(ranges)} ranges but --stages is {pc.stages}")
    act = activation_bytes(config, micro_batch=pc.micro_batch, seq_len=pc.seq_len, act_bytes=nb)
    spb = store_bytes_per_block(config, seq_len=pc.seq_len, seqs_per_block=pc.seqs_per_block, reservoir=pc.reservoir)
    sp = []
    for i, (a, b) in enumerate(ranges):
        params = sum(pb.layers[a:b]) + (pb.embed if a == 0 else 0)
        acc = spb["per_layer"] * (b - a) * pc.in_flight
        peak = params + acc + pc.in_flight * 2 * act["boundary"] + act["layer_working_set"]
        sp.append(StagePlan(i, (a, b), params, a == 0, acc, peak, math.ceil(peak / pc.gpus_per_stage)))
    gpu_mem = int(pc.gpu_mem_gib * GiB) if pc.gpu_mem_gib is not None else None
    suggested = None
    notes = [f"weights in {dtype} ({nb} B/param); activations in the same dtype" + (
                 f"; the checkpoint is block FP8 ({block[0]}x{block[1]}), dequantized at load by every loader "
                 f"(about 1 B/param + scales on disk: {fmt_bytes(pb.total // nb)} of FP8 weights read by the "
                 f"stages and the head, {nb} B/param in GPU memory: {fmt_bytes(pb.total)})" if block else ""),
             f"{pc.in_flight} micro-batches in flight per stage; accumulators are float64 per block",
             "scores_if_materialised applies to eager attention and CPU sdpa; flash/mem-efficient kernels avoid it"]
    if gpu_mem:
        budget = pc.gpus_per_stage * gpu_mem * pc.usable
        fixed = pc.in_flight * 2 * act["boundary"] + act["layer_working_set"]
        for n in range(1, nl + 1):
            r = balance_layers(pb.layers, n, pb.embed)
            worst = max(sum(pb.layers[a:b]) + (pb.embed if a == 0 else 0) + spb["per_layer"] * (b - a) * pc.in_flight
                        for a, b in r)
            if worst + fixed <= budget:
                suggested = n
                break
        notes.append(f"suggested stage count: smallest N whose largest stage fits {pc.usable:.0%} of "
                     f"{pc.gpus_per_stage} x {pc.gpu_mem_gib:g} GiB" if suggested else
                     "no stage count fits: a single layer exceeds the GPU budget")
    budget = int(gpu_mem * pc.usable) if gpu_mem else None
    fits = all(s.peak_bytes <= pc.gpus_per_stage * gpu_mem * pc.usable for s in sp) if gpu_mem else None
    est = estimate(config, ranges, replicas=replicas, gpus_per_stage=pc.gpus_per_stage, seq_len=pc.seq_len,
                   micro_batch=pc.micro_batch, seqs_per_block=pc.seqs_per_block, num_blocks=pc.num_blocks,
                   boundary_bytes=act["boundary"], gpu=gpu, utilization=utilization, crosses_nodes=crosses_nodes)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    # tied embeddings: the head holds only the final norm, and a last stage other than stage 0 loads the matrix too
    tied = pb.head < text.vocab_size * text.hidden_size * nb
    steps = estimate_steps(config, ranges, stage_params=[s.param_bytes for s in sp],
                           head_bytes=pb.head + (pb.embed if tied and len(ranges) > 1 else 0), layer_bytes=pb.layers,
                           dtype_bytes=nb, calibrate=(est.wall_seconds, [s.peak_bytes for s in sp], est.tokens),
                           sizes=pc.sizes, gpu=gpu, utilization=utilization, crosses_nodes=crosses_nodes)
    return Plan(pc.name or getattr(config, "model_type", ""), nl, pb.total, pb.total - pb.head, sp, pc.gpus_per_stage,
                act, spb, pc.num_blocks, spb["total"] * pc.num_blocks, suggested, gpu_mem, notes, budget, fits,
                weights_mode, est.to_dict(), steps=steps.to_dict())


def plan_placed(config, pc: PlanConfig, *, nodes: int, gpus_per_node: int, gpu: GpuSpec = H100,
                stages: int | None = None, gpus_per_stage: int | None = None,
                utilization: float = UTILIZATION) -> Plan:
    """`make_plan` for the placement on `nodes` x `gpus_per_node` GPUs (cluster/placement.py): stage count,
    GPUs per stage and replicas chosen unless pinned; the estimate counts the replicas."""
    if pc.layers and stages is None:
        stages = pc.layers.count(",") + 1  # explicit ranges fix the stage count
    pl = place(config, pc, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu, stages=stages,
               gpus_per_stage=gpus_per_stage, utilization=utilization)
    if pc.layers:
        pl.why = [w for w in pl.why if not w.startswith("layer ranges")] + [f"layer ranges {pc.layers}: as given"]
        pl.layers = pc.layers
    plan = make_plan(config, replace(pc, stages=pl.stages, gpus_per_stage=pl.gpus_per_stage,
                                     layers=pl.layers), gpu=gpu,
                     utilization=utilization, replicas=pl.replicas, crosses_nodes=pl.crosses_nodes)
    plan.placement = pl.to_dict()
    return plan


# --------------------------------------------------------------------------- placement

def stage_layers_by_time(config, pc, stages: int, gpus_per_stage: int, gpu: GpuSpec = H100) -> str | None:
    """`--stage-layers` text of the split that balances compute time (FLOPs per layer at the GPU's rates) within
    the memory `make_plan` checks; None without a GPU size or when no split fits. Balancing bytes instead puts
    GLM-4.7's three dense layers (few bytes, the FLOPs of a MoE layer's active experts) with five MoE layers
    on stage 0: the slowest stage of the pipeline."""
    if pc.gpu_mem_gib is None:
        return None
    base = make_plan(config, replace(pc, stages=1, gpus_per_stage=gpus_per_stage, layers=None, gpu_mem_gib=None))
    nl = base.num_layers
    nb = param_bytes(config, 1)
    scale = base.stages[0].param_bytes / (nb.embed + sum(nb.layers))  # bytes per parameter of the plan's dtype
    acc = base.stages[0].accumulator_bytes / nl
    fixed = base.stages[0].peak_bytes - base.stages[0].param_bytes - base.stages[0].accumulator_bytes
    peaks = [nb.layers[l] * scale + acc for l in range(nl)]
    times = []
    for l in range(nl):
        f = layer_flops_per_token(config, l, pc.seq_len)
        times.append((f["attention"] + f["mlp"]) / gpu.bf16_flops + f["capture"] / gpu.fp64_flops)
    budget = gpus_per_stage * pc.gpu_mem_gib * (1 << 30) * pc.usable - fixed
    r = balance_by_time(times, peaks, stages, budget, nb.embed * scale)
    return ",".join(f"{a}:{b}" for a, b in r) if r else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def place(config, pc, *, nodes: int, gpus_per_node: int, gpu: GpuSpec = H100, stages: int | None = None,
          gpus_per_stage: int | None = None, utilization: float = UTILIZATION) -> Placement:
    """The placement of `config` on `nodes` x `gpus_per_node` GPUs of `pc.gpu_mem_gib` each (a PlanConfig
    carries the sizes; its stages / gpus_per_stage are ignored). Fewest GPUs per stage that fits (a
    divisor of gpus_per_node: a stage's GPUs share a node), then among stage counts that fit and fill
    the GPUs the one with the shortest estimated wall time (ties: fewer stages). `stages` and
    `gpus_per_stage` pin either choice. Refuses in one line when nothing fits."""
    for flag, v in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--stages", stages),
                    ("--gpus-per-stage", gpus_per_stage)):
        if v is not None and v < 1:
            raise OscarError(f"{flag} must be >= 1, got {v}")
    if pc.gpu_mem_gib is None:
        raise OscarError("placing stages needs the GPU memory (--gpu-mem or --gpu)")
    if gpus_per_stage is not None and gpus_per_node % gpus_per_stage:
        raise OscarError(f"--gpus-per-stage {gpus_per_stage} must divide --gpus-per-node {gpus_per_node} (a stage's "
                         "GPUs are in one node)")
    nl = num_layers(config)
    why = []
    for g in [gpus_per_stage] if gpus_per_stage else _divisors(gpus_per_node):
        slots = nodes * gpus_per_node // g
        plan1 = make_plan(config, replace(pc, stages=1, gpus_per_stage=g, layers=None))
        pmin = plan1.suggested_stages
        if pmin is None or pmin > min(slots, nl):
            why.append(f"{g} GPU(s) per stage: " + ("a single layer does not fit" if pmin is None else
                       f"needs {pmin} stages, {slots} stage slots"))
            continue
        if stages is not None and not pmin <= stages <= min(slots, nl):
            why.append(f"{g} GPU(s) per stage: --stages {stages} " + (f"does not fit (from {pmin} stages)"
                       if stages < pmin else f"exceeds the {min(slots, nl)} stage slots"))
            continue
        best = None
        for p in [stages] if stages else range(pmin, min(slots, nl) + 1):
            r = slots // p
            layers = stage_layers_by_time(config, pc, p, g, gpu)
            plan = make_plan(config, replace(pc, stages=p, gpus_per_stage=g, layers=layers, gpu_mem_gib=None))
            ranges = [s.layers for s in plan.stages]
            crosses = p > 1 and gpus_per_node % (p * g) != 0  # replicas that do not tile the nodes span them
            est = estimate(config, ranges, replicas=r, gpus_per_stage=g, seq_len=pc.seq_len,
                           micro_batch=pc.micro_batch, seqs_per_block=pc.seqs_per_block, num_blocks=pc.num_blocks,
                           boundary_bytes=plan.activation["boundary"], gpu=gpu, utilization=utilization,
                           crosses_nodes=crosses)
            key = (est.wall_seconds, p)
            if best is None or key < best[0]:
                best = (key, p, r, crosses, layers)
        _, p, r, crosses, layers = best
        why.append(f"{g} GPU(s) per stage: the fewest whose stages fit ({pmin} stages at least)")
        if not stages:
            why.append(f"{p} stages x {r} replica(s): the shortest estimated wall time among {pmin}..{min(slots, nl)} "
                       f"stages on {slots} stage slots")
        idle = nodes * gpus_per_node - p * r * g
        if layers:
            why.append(f"layer ranges {layers}: balanced by estimated compute time within the memory budget")
        return Placement(nodes, gpus_per_node, p, g, r, idle, crosses, why, layers)
    raise OscarError(f"no placement fits on {nodes} x {gpus_per_node} GPUs of {pc.gpu_mem_gib:g} GiB: "
                     + "; ".join(why))


def misfit(p: Plan, explicit_layers: bool = False) -> str | None:
    """Why plan `p` does not fit its GPUs, in one line with what to try instead; None when it fits
    (or when no GPU size was given)."""
    if p.fits is not False:
        return None
    worst = max(p.stages, key=lambda s: s.per_gpu_bytes)
    if p.suggested_stages:
        hint = f"try --stages {p.suggested_stages}" + (" without --stage-layers" if explicit_layers else "")
    else:
        hint = "no stage count fits (a single layer exceeds the budget): try more --gpus-per-stage or larger GPUs"
    return (f"does not fit: stage {worst.stage} (layers {worst.layers[0]}-{worst.layers[1] - 1}) needs "
            f"{fmt_bytes(worst.per_gpu_bytes)} per GPU, budget {fmt_bytes(p.budget_bytes)} "
            f"(--gpu-mem {p.gpu_mem_bytes / GiB:g} x {p.budget_bytes / p.gpu_mem_bytes:.0%} usable); {hint}")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def format_plan(p: Plan) -> str:
    lines = [f"model {p.model}: {p.num_layers} layers, parameters {fmt_bytes(p.total_param_bytes)} "
             f"({fmt_bytes(p.loaded_param_bytes)} loaded by stages; LM head and final norm by nobody)",
             *([f"weights: {p.weights_mode}"] if p.weights_mode else []),
             f"{len(p.stages)} stages x {p.gpus_per_stage} GPU(s)", "",
             f"{'stage':>5} {'layers':>10} {'params':>11} {'accum':>11} {'peak':>11} {'per GPU':>11}"]
    for s in p.stages:
        lr = f"{s.layers[0]}-{s.layers[1] - 1}" + ("+emb" if s.embeddings else "")
        lines.append(f"{s.stage:>5} {lr:>10} {fmt_bytes(s.param_bytes):>11} {fmt_bytes(s.accumulator_bytes):>11} "
                     f"{fmt_bytes(s.peak_bytes):>11} {fmt_bytes(s.per_gpu_bytes):>11}")
    a = p.activation
    lines += ["", f"activations per micro-batch: boundary {fmt_bytes(a['boundary'])}, "
                  f"layer working set {fmt_bytes(a['layer_working_set'])}, "
                  f"scores if materialised {fmt_bytes(a['scores_if_materialised'])}",
              f"store per block: {fmt_bytes(p.store_per_block['total'])} "
              f"(per layer {fmt_bytes(p.store_per_block['per_layer'])}, tokens {fmt_bytes(p.store_per_block['tokens'])}, "
              f"expert counts {fmt_bytes(p.store_per_block['experts'])}); "
              f"{p.num_blocks} blocks: {fmt_bytes(p.store_total_bytes)}"]
    if p.gpu_mem_bytes:
        lines.append(f"budget per GPU: {fmt_bytes(p.budget_bytes)}; this plan "
                     + ("fits" if p.fits else "does NOT fit"))
        lines.append(f"suggested stages for {fmt_bytes(p.gpu_mem_bytes)} GPUs x {p.gpus_per_stage} per stage: "
                     f"{p.suggested_stages if p.suggested_stages else 'none fits'}")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines + format_placement(p) + format_steps(p))


def format_placement(p: Plan) -> list[str]:
    """The placement (with --nodes), the pipeline efficiency and the wall-time estimate with its assumptions."""
    out = []
    if p.placement:
        pl = p.placement
        out += ["", f"placement: {pl['replicas']} replica(s) x {pl['stages']} stage(s) x {pl['gpus_per_stage']} GPU(s) "
                    f"on {pl['nodes']} node(s) x {pl['gpus_per_node']} GPUs ({pl['idle_gpus']} idle; a replica "
                    f"{'spans nodes' if pl['crosses_nodes'] else 'stays in one node'})"]
        out += [f"  {w}" for w in pl["why"]]
    e = p.estimate
    if e:
        out += ["", f"pipeline efficiency {e['efficiency']:.1%} (M/(M+P-1), M = {e['micro_batches']} micro-batches "
                    f"per replica, P = {e['stages']}); stage balance {e['balance']:.1%} (mean / slowest stage step)",
                f"wall-time estimate: {fmt_seconds(e['wall_seconds'])} for {e['tokens']:,} tokens on "
                f"{e['replicas']} replica(s) ({e['tokens'] / e['wall_seconds']:,.0f} tokens/s); assumptions:"]
        out += [f"  {a}" for a in e["assumptions"]]
    return out


def format_steps(p: Plan) -> list[str]:
    """Memory and time of each step on one replica (cluster/steps.py), with the KV cache per stage and the
    assumptions."""
    st = p.steps
    if not st:
        return []
    out = ["", f"steps on one replica of {len(p.stages)} stage(s) (calibrate: as estimated above; perplexity and "
               "needles: per method):",
           f"{'step':<11} {'tokens':>12} {'time':>9} {'largest stage':>14} {'per GPU':>11}"]
    for r in st["rows"]:
        big = max(r["stage_bytes"])
        per_gpu = math.ceil(big / p.gpus_per_stage)
        over = "  over the budget per GPU" if p.budget_bytes and per_gpu > p.budget_bytes else ""
        out.append(f"{r['step']:<11} {r['tokens']:>12,} {fmt_seconds(r['seconds']):>9} {fmt_bytes(big):>14} "
                   f"{fmt_bytes(per_gpu):>11}{over}")
    out += [f"  {r['step']}: {r['what']}" for r in st["rows"]]
    kv = st["kv_cache"]
    out.append(f"KV cache of one {kv['context']:,}-token sequence ({kv['format']}): "
               f"{fmt_bytes(max(kv['stage_bytes']))} on the largest stage, {fmt_bytes(kv['total_bytes'])} in all "
               f"(BF16: {fmt_bytes(max(kv['bf16_stage_bytes']))}, {fmt_bytes(kv['bf16_total_bytes'])})")
    out.append("assumptions:")
    out += [f"  {a}" for a in st["assumptions"]]
    return out
