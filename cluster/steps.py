"""Memory and time of every step that runs the model on the stage actors, not only calibration.

Calibration has its own estimate (cluster/placement.py `estimate`). The steps after it run through the same
layer-range stages (hidden states flow stage to stage; for them the last stage also holds the final norm and the
LM head): the recipe's clip tune and per-layer widths, then perplexity and needles per method. The same
arithmetic on the config as calibration's:

- a window of T tokens costs each stage T x its layers' forward FLOPs per token at length T (+ the LM head on
  the last stage where the step scores tokens), at the GPU's BF16 rate x the assumed utilization;
- M windows flow through P stages like micro-batches: (M + P - 1) x the slowest stage's step, plus P - 1 hops;
- a hop is the transfer of the window's hidden states at the link bandwidth plus STAGE_HOP_S, the latency one
  more stage adds on a local Ray cluster (bench/stage_hop.py);
- decode is memory-bound: a token reads each stage's active weights and its KV cache once, at the HBM bandwidth
  x the same utilization, and passes P hops (one per stage, the last back to the driver);
- the INT2 KV cache a stage holds at a context is kernels/memory.py's accounting of the stage's layers.

`StepSizes` holds the sizes; their defaults are the product's (oscar/recipe/tune.py TuneConfig, oscar/run.py
RunConfig; tests/test_cluster_steps.py checks they agree).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from oscar.cluster.placement import H100, UTILIZATION, GpuSpec, flops_per_token, is_moe_layer, num_experts
from oscar.common import OscarError, attention_shapes, is_latent, latent_shapes
from oscar.defaults import RECENT, SINK

# Latency one more stage adds to a round trip through the stages (driver -> A -> B, A's ObjectRef passed to B, as
# cluster/pipeline.py chains micro-batches) for one token's hidden state: 2.41 ms, the median over H in
# {576, 896, 5120} x {float32, bfloat16} of the measured hop of a (1, 1, H) tensor (2.12 to 3.24 ms; 2.28 ms at
# H 5120 bf16), on a local Ray cluster of a 2-CPU host (loopback, no compute in the actors).
# `python bench/stage_hop.py` -> bench/results/stage_hop.json "decode_hop_s_median". Between nodes the network
# adds to it; the bytes of a longer window are counted apart, at the GPU's link bandwidth.
STAGE_HOP_S = 2.41e-3


@dataclass
class StepSizes:
    """What the steps after calibration run (perplexity and needles: per method)."""

    tune_factors: int = 6          # clip factors the tune scores (TuneConfig.factors)
    tune_tokens: int = 2048        # one calibration window per factor (TuneConfig.tokens)
    widths_windows: int = 4        # the widths' gradient: forward + backward per window (RunConfig.widths_windows)
    widths_length: int = 2048      # tokens per window (RunConfig.widths_length: min(2048, longest context))
    ppl_tokens: int = 12288        # held-out tokens scored per context (RunConfig.ppl_tokens under `full`)
    ppl_context: int = 4096        # perplexity window length
    context: int = 131072          # the KV cache per stage, and the longest needle length
    needle_samples: int = 20       # samples per needle length (the evidence standard's cells: RunConfig under `full`)
    needle_new_tokens: int = 16    # greedy decode per sample (the answer)
    prefill_chunk: int = 4096      # a needle prompt is prefilled in chunks that flow through the stages
    sink: int = SINK               # tokens of the cache kept in BF16
    recent: int = RECENT

    def check(self) -> None:
        for name, v in asdict(self).items():
            if v < (0 if name in ("sink", "recent") else 1):
                flag = "--context" if name == "context" else f"step size {name}"
                raise OscarError(f"{flag} must be >= {0 if name in ('sink', 'recent') else 1}, got {v}")

    @property
    def needle_lengths(self) -> list[int]:
        """4k, 8k, ... doubling up to `context` (and `context` itself)."""
        out, n = [], 4096
        while n < self.context:
            out.append(n)
            n *= 2
        return out + [self.context]


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head_flops_per_token(config) -> float:
    """LM head FLOPs per scored token: 2 x hidden x vocab."""
    c = _text(config)
    return 2 * c.hidden_size * c.vocab_size


def cache_format(sizes: StepSizes, bits: int = 2):
    """The kernels/memory.py `Format` the estimate counts: INT2 history with fp16 scale + zero per token group of
    head_dim (the artifact's default QuantConfig), sink and recent tokens in BF16; bits=16: the BF16 cache."""
    # late: keeps torch (2.1 s) out of `oscar --help` (the plan's CLI imports this module)
    from oscar.kernels.memory import Format

    return Format("int2-token" if bits < 16 else "bf16", bits=bits, sink=sizes.sink, recent=sizes.recent)


def kv_cache_bytes(config, ranges: list[tuple[int, int]], context: int, fmt) -> list[int]:
    """Bytes of one sequence's KV cache of `context` tokens held by each stage (kernels/memory.py `total`)."""
    # late: keeps torch (2.1 s) out of `oscar --help` (the plan's CLI imports this module)
    from oscar.kernels.memory import LatentFormat, latent_total, total

    c = _text(config)
    if is_latent(c):  # the INT2 latent cache (c_kv in groups of 128, the RoPE key 16-bit)
        lf = LatentFormat(fmt.name, bits=fmt.bits, sink=fmt.sink, recent=fmt.recent)
        sh = latent_shapes(c)
        return [int(sum(latent_total(dict(sh, num_layers=b - a), lf, context).values())) for a, b in ranges]
    sh = attention_shapes(c)
    return [int(sum(total(dict(sh, num_layers=b - a), fmt, context).values())) for a, b in ranges]


def active_weight_bytes(config, layer_bytes: list[int], dtype_bytes: int, layer: int) -> int:
    """Weight bytes one decode token reads in `layer`: all of a dense layer, a MoE layer less its unrouted experts."""
    c = _text(config)
    e = num_experts(c)
    if not e or not is_moe_layer(c, layer):
        return layer_bytes[layer]
    k = getattr(c, "num_experts_per_tok", 1) or 1
    return layer_bytes[layer] - (e - k) * 3 * c.hidden_size * c.moe_intermediate_size * dtype_bytes


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def _pipelined(steps: list[float], windows: int, hop: float) -> float:
    """M windows through P stages: (M + P - 1) x the slowest step, plus the P - 1 hops of the fill."""
    return (windows + len(steps) - 1) * max(steps) + (len(steps) - 1) * hop


@dataclass
class StepEstimate:
    step: str
    tokens: int                 # tokens the step runs through the model (per method for perplexity and needles)
    seconds: float
    stage_bytes: list[int]      # peak memory of each stage (its GPUs together)
    what: str                   # how the figure is made (printed)


@dataclass
class Steps:
    rows: list[StepEstimate]
    kv_cache: dict              # per stage at sizes.context: the INT2 format and BF16
    sizes: dict
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_steps(config, ranges: list[tuple[int, int]], *, stage_params: list[int], head_bytes: int,
                   layer_bytes: list[int], dtype_bytes: int, calibrate: tuple[float, list[int], int],
                   sizes: StepSizes | None = None, gpu: GpuSpec = H100, utilization: float = UTILIZATION,
                   crosses_nodes: bool = False) -> Steps:
    """Every step's wall time and peak memory per stage, on one replica of `ranges`.

    stage_params: weight bytes each stage loads (embeddings on stage 0); head_bytes: the final norm + LM head the
    last stage adds for the validation steps; layer_bytes: per decoder layer; calibrate: (seconds, peak bytes per
    stage, tokens) of the calibration estimate."""
    s = sizes or StepSizes()
    s.check()
    c = _text(config)
    sh = None if is_latent(c) else attention_shapes(c)
    hid, vocab, p = c.hidden_size, c.vocab_size, len(ranges)
    rate = gpu.bf16_flops * utilization
    link = gpu.inter_node_bytes_s if crosses_nodes else gpu.intra_node_bytes_s
    params = [b + (head_bytes if i == p - 1 else 0) for i, b in enumerate(stage_params)]

    def hop(tokens: int) -> float:
        return STAGE_HOP_S + tokens * hid * dtype_bytes / link if p > 1 else 0.0

    def steps(seq_len: int, tokens: int, scored: bool) -> list[float]:
        """Seconds each stage computes a window of `tokens` tokens at length `seq_len`."""
        out = []
        for i, r in enumerate(ranges):
            f = flops_per_token(config, seq_len, r)["matmul"]
            f += head_flops_per_token(config) if scored and i == p - 1 else 0
            out.append(tokens * f / rate)
        return out

    def working(seq_len: int, logits: int, backward: bool = False) -> list[int]:
        """Peak activations of a window: input and output hidden states, one layer's working set (every layer's
        of the stage for a backward), float32 logits of `logits` tokens on the last stage."""
        h = seq_len * hid * dtype_bytes
        attn = seq_len * (2 * sh["num_q_heads"] + 2 * sh["num_kv_heads"]) * sh["head_dim"] * dtype_bytes
        inter = max(c.intermediate_size, getattr(c, "moe_intermediate_size", 0) or 0)
        layer = 2 * h + attn + 3 * seq_len * inter * dtype_bytes
        return [2 * h + layer * (b - a if backward else 1) + (logits * vocab * 4 if i == p - 1 else 0)
                for i, (a, b) in enumerate(ranges)]

    fmt = cache_format(s)
    kv = kv_cache_bytes(config, ranges, s.context, fmt)
    kv16 = kv_cache_bytes(config, ranges, s.context, cache_format(s, bits=16))
    rows = [StepEstimate("calibrate", calibrate[2], calibrate[0], list(calibrate[1]),
                         "the calibration estimate above (capture, float64 accumulators, no LM head)")]
    if sh is None:  # an MLA model: its latent fit reads the store alone; what scores the model is not built for it
        kv_cache = {"context": s.context, "format": "int2-latent", "stage_bytes": kv, "bf16_stage_bytes": kv16,
                    "total_bytes": sum(kv), "bf16_total_bytes": sum(kv16)}
        return Steps(rows, kv_cache, asdict(s), [
            "MLA model: calibration and the latent fit (rotations and clips, no model read) only; the tune, the "
            "widths, perplexity and needles score through an INT2 latent cache, which is not built yet",
            f"KV cache: the latent c_kv at {fmt.bits} bits in groups of 128 with fp32 scale + zero, the RoPE key and "
            f"sink {fmt.sink} + recent {fmt.recent} tokens 16-bit, one sequence (kernels/memory.py latent_total)"])

    t = steps(s.tune_tokens, s.tune_tokens, True)
    rows.append(StepEstimate(
        "tune", s.tune_factors * s.tune_tokens, _pipelined(t, s.tune_factors, hop(s.tune_tokens)),
        [a + b for a, b in zip(params, working(s.tune_tokens, s.tune_tokens))],
        f"{s.tune_factors} clip factors x one {s.tune_tokens}-token window, forward + LM head, pipelined"))

    t = steps(s.widths_length, s.widths_length, True)
    w = s.widths_windows
    rows.append(StepEstimate(
        "widths", w * s.widths_length, 3 * (w + p - 1) * max(t) + 2 * (p - 1) * hop(s.widths_length),
        [a + b for a, b in zip(params, working(s.widths_length, s.widths_length, backward=True))],
        f"{w} windows x {s.widths_length} tokens, forward + backward (3x the forward's FLOPs, hops both ways), "
        "every layer's activations kept for the backward"))

    m = math.ceil(s.ppl_tokens / s.ppl_context)
    t = steps(s.ppl_context, s.ppl_context, True)
    rows.append(StepEstimate(
        "perplexity", m * s.ppl_context, _pipelined(t, m, hop(s.ppl_context)),
        [a + b for a, b in zip(params, working(s.ppl_context, s.ppl_context))],
        f"{m} held-out windows of {s.ppl_context} tokens ({s.ppl_tokens} tokens), forward + LM head, pipelined"))

    needle_s, needle_tokens = 0.0, 0
    decode_at = {}
    for n in s.needle_lengths:
        chunk = min(s.prefill_chunk, n)
        prefill = _pipelined(steps(n, chunk, False), math.ceil(n / chunk), hop(chunk))
        kv_n = kv_cache_bytes(config, ranges, n, fmt)
        read = []
        for i, (a, b) in enumerate(ranges):
            weights = sum(active_weight_bytes(config, layer_bytes, dtype_bytes, l) for l in range(a, b))
            read.append(weights + (head_bytes if i == p - 1 else 0) + kv_n[i])
        token = sum(read) / (gpu.hbm_bytes_s * utilization) + p * (STAGE_HOP_S + hid * dtype_bytes / link)
        decode_at[n] = token
        needle_s += s.needle_samples * (prefill + s.needle_new_tokens * token)
        needle_tokens += s.needle_samples * (n + s.needle_new_tokens)
    chunk = min(s.prefill_chunk, s.context)
    rows.append(StepEstimate(
        "needles", needle_tokens, needle_s,
        [a + b + k for a, b, k in zip(params, working(chunk, 1), kv)],
        f"{s.needle_samples} samples at each of {', '.join(_k(n) for n in s.needle_lengths)} tokens, one "
        f"sample at a time: prefill in {s.prefill_chunk}-token chunks pipelined, then {s.needle_new_tokens} greedy "
        f"tokens ({decode_at[s.context] * 1e3:.1f} ms each at {_k(s.context)}: weights and cache read once per "
        f"token, {p} hops); memory with the INT2 cache at {s.context:,} tokens"))

    assumptions = [
        f"after calibration the last stage also holds the final norm and LM head ({head_bytes / 2**30:.2f} GiB); "
        "perplexity and needles are per method (each method compared runs them again)",
        f"compute at {gpu.bf16_flops / 1e12:g} TFLOP/s BF16 x {utilization:.0%} (the tune and widths run float64 / "
        f"float32 on CPU hosts; at the FP64 rate, {gpu.fp64_flops / 1e12:g} TFLOP/s, they take "
        f"{gpu.bf16_flops / gpu.fp64_flops:.1f}x longer)",
        f"decode memory-bound: {gpu.hbm_bytes_s / 1e12:g} TB/s HBM x {utilization:.0%}; a MoE layer reads its "
        f"{getattr(c, 'num_experts_per_tok', 0) or 0} routed experts of {num_experts(c) or 0} (and the shared ones)",
        f"stage hop: {STAGE_HOP_S * 1e3:.2f} ms measured on a local Ray cluster (bench/results/stage_hop.json) + "
        f"the hidden states at {link / 1e9:g} GB/s ({'between nodes' if crosses_nodes else 'within a node'})",
        f"KV cache: {fmt.name}, {fmt.bits}-bit history with fp16 scale + zero per token and head_dim group, "
        f"sink {fmt.sink} + recent {fmt.recent} tokens BF16, one sequence (kernels/memory.py)",
        "not included: model loading, Ray start, tokenization, writing results",
    ]
    kv_cache = {"context": s.context, "format": fmt.name, "stage_bytes": kv, "bf16_stage_bytes": kv16,
                "total_bytes": sum(kv), "bf16_total_bytes": sum(kv16)}
    return Steps(rows, kv_cache, asdict(s), assumptions)
