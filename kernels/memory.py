"""Memory accounting for the KV cache: bytes per token by component, analytic and live.

Components (all layers, K and V together):
    codes        packed INT2 history codes                       bits/8 bytes per element (+ 1/8 per wide
                                                                 key channel of split keys)
    scales       scale + zero of the history (fp16, or 8-bit e4m3 in the *-fp8 formats)
                                                                 per token group / per channel-page
    sinks        the first `sink` tokens, 16-bit
    recent       the recent window (R..R+P-1 tokens), 16-bit
    page_table   int32 block-table entry per page per layer (device side)
    constants    static-mode per-(head, channel) scale/zero: per layer, independent of length

`per_history_token` is the steady-state cost of one token that has left the
recent window; `total(context)` adds the 16-bit sink/recent segments and
constants for a sequence of `context` tokens. BF16 stores every token at
2 bytes per element. The targets: INT2 with per-token scales <= 1/7
of BF16 per history token, static mode exactly 1/8. At head_dim 64 the per-token
target needs 8-bit scale + zero (`int2-token-fp8`: 2.25 bits per element, 1/7.11);
fp16 ones give 2.5 bits (1/6.4).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from oscar.common import OscarError, attention_shapes, is_latent, latent_shapes
from oscar.defaults import LATENT_GROUP, PAGE_SIZE, RECENT, SINK
from oscar.kernels.dispatch import quantize_pages
from oscar.kernels.paged import PagedConfig, PagedKVCache, layout
from oscar.kernels.rotation import LayerRotation
from oscar.modelconfig import load_model_config as load
from oscar.stats.artifact import QuantConfig, split_width

PAGE_TABLE_BYTES = 4  # int32 page id per page per layer in the device block table


@dataclass
class Format:
    """A cache format for accounting (mirrors QuantConfig; `name` labels the row)."""

    name: str
    bits: int = 2  # 16 = no quantization (BF16 baseline)
    mode: str = "minmax"  # minmax | static
    key_axis: str = "token"  # token | channel (KIVI)
    group_size: int | None = None  # channels per group (token axis); None = head_dim
    page_size: int = PAGE_SIZE
    sink: int = SINK
    recent: int = RECENT
    param_bytes: int = 2  # bytes of each stored scale and zero: 2 fp16, 1 e4m3 (QuantConfig.param_dtype)
    dtype_bytes: int = 2  # sink / recent / BF16 storage
    key_split: int = 0  # split keys (QuantConfig.key_split): wide key channels, key_top more bits and a second param pair
    key_top: int = 1  # split keys: the wide channels' bits above `bits` (QuantConfig.key_top)
    key_drop: int = 0  # split keys: key channels not stored (QuantConfig.key_drop)
    key_param_bytes: int | None = None  # keys' scale/zero bytes where they differ (QuantConfig.key_param_dtype)

    @classmethod
    def from_quant(cls, name: str, q) -> "Format":
        """The row of a QuantConfig (one layer's format: `Artifact.quant_for`)."""
        nbytes = {"float8_e4m3fn": 1, "float16": 2, "float32": 4}
        return cls(name, bits=q.bits, mode=q.mode, key_axis=q.key_axis, group_size=q.group_size, page_size=q.page_size,
                   sink=q.sink, recent=q.recent, param_bytes=nbytes[q.param_dtype], key_split=q.key_split,
                   key_top=q.key_top, key_drop=q.key_drop,
                   key_param_bytes=nbytes[q.key_param_dtype] if q.key_param_dtype else None)

    @property
    def param_dtype(self) -> str:
        """The QuantConfig.param_dtype this row stands for."""
        return {1: "float8_e4m3fn", 2: "float16", 4: "float32"}[self.param_bytes]


def default_formats(sink: int = SINK, recent: int = RECENT, page_size: int = PAGE_SIZE) -> list[Format]:
    kw = dict(sink=sink, recent=recent, page_size=page_size)
    return [
        Format("bf16", bits=16, **kw),
        Format("int2-token", **kw),  # per-token fp16 scale+zero, group = head_dim
        Format("int2-token-fp8", param_bytes=1, **kw),  # per-token 8-bit (e4m3) scale+zero: the 1/7 mode at D=64
        Format("int2-static", mode="static", **kw),  # artifact clips: no per-token metadata
        Format("int2-kivi", key_axis="channel", **kw),  # keys per channel over a page, values per token
        Format("int2-kivi-fp8", key_axis="channel", param_bytes=1, **kw),
        # split keys (oscar fit --variant split): D/4 key channels at 3 bits, every part and the values
        # with 8-bit scale/zero; key_split -1 = the model's own D/4 (2.5 bits per element at D = 64)
        Format("int2-split-fp8", param_bytes=1, key_split=-1, **kw),
    ]


def per_history_token(shapes: dict, f: Format) -> dict[str, float]:
    """Bytes one history token costs across all layers, by component."""
    L, H, D = shapes["num_layers"], shapes["num_kv_heads"], shapes["head_dim"]
    elems = 2 * L * H * D  # K and V
    if f.bits >= 16:
        return {"codes": elems * f.dtype_bytes, "scales": 0.0, "page_table": 0.0}
    W = _split(f, D)
    codes = elems * f.bits / 8 + L * H * (f.key_top * W - f.bits * _drop(f, D)) / 8  # + top bits, - not-stored keys
    pair = 2 * f.param_bytes  # scale + zero
    pair_k = 2 * (f.key_param_bytes or f.param_bytes)
    if f.mode == "static":
        scales = 0.0
    else:
        G = f.group_size or D
        v = L * H * (D // G) * pair  # per token and channel group
        k = L * H * D * pair_k / f.page_size if f.key_axis == "channel" else L * H * (D // G) * pair_k  # KIVI: per channel per page
        two_parts = W and W < D - _drop(f, D)  # W = every stored channel: one wide part, one pair
        scales = k + v + (L * H * pair_k if two_parts else 0)  # split keys: a pair per key part
    return {"codes": codes, "scales": scales, "page_table": L * PAGE_TABLE_BYTES / f.page_size}


def _split(f: Format, D: int) -> int:
    """Wide key channels of a split format at head_dim D (key_split -1: the split variant's own D/4)."""
    if f.key_split >= 0:
        return f.key_split

    return split_width(D)


def _drop(f: Format, D: int) -> int:
    """Key channels a split format does not store at head_dim D."""
    return f.key_drop if f.key_split else 0


def per_history_token_layers(shapes: dict, formats: list[Format]) -> dict[str, float]:
    """`per_history_token` of a model whose layer l stores its K/V as formats[l] (per-layer widths)."""
    if len(formats) != shapes["num_layers"]:
        raise ValueError(f"{len(formats)} layer formats for {shapes['num_layers']} layers")
    one = dict(shapes, num_layers=1)
    rows = [per_history_token(one, f) for f in formats]
    return {k: sum(r[k] for r in rows) for k in rows[0]}


def artifact_formats(art) -> list[Format]:
    """One accounting row per layer of an artifact (`Artifact.quant_for`: per-layer widths where it has them)."""
    return [Format.from_quant(f"layer{l}", art.quant_for(l)) for l in range(art.num_layers)]


def artifact_bits_per_element(art) -> float:
    """Stored bits per K/V element of the artifact's INT2 history (codes and every scale/zero, K and V averaged,
    all layers): what the 2.5-bit budget reads, from the same accounting as `oscar bench memory`."""
    shapes = {"num_layers": art.num_layers, "num_kv_heads": art.num_kv_heads, "head_dim": art.head_dim}
    h = per_history_token_layers(shapes, artifact_formats(art))
    return 8 * (h["codes"] + h["scales"]) / (2 * art.num_layers * art.num_kv_heads * art.head_dim)


def total(shapes: dict, f: Format, context: int, batch: int = 1) -> dict[str, float]:
    """Bytes held for `batch` sequences of `context` tokens, by component (the kern layout)."""
    L, H, D = shapes["num_layers"], shapes["num_kv_heads"], shapes["head_dim"]
    tok16 = 2 * L * H * D * f.dtype_bytes  # one 16-bit token, K and V, all layers
    if f.bits >= 16:
        return {"codes": float(batch * context * tok16), "scales": 0.0, "sinks": 0.0, "recent": 0.0,
                "page_table": 0.0, "constants": 0.0}
    S, R, P = f.sink, f.recent, f.page_size
    m = max(context - S, 0)
    hist = P * ((m - R) // P) if m >= R else 0
    h = per_history_token(shapes, f)
    return {
        "codes": batch * hist * h["codes"],
        "scales": batch * hist * h["scales"],
        "sinks": float(batch * min(context, S) * tok16),
        "recent": float(batch * (m - hist) * tok16),
        "page_table": batch * hist * h["page_table"],
        "constants": float(2 * L * H * D * 2 * f.param_bytes) if f.mode == "static" else 0.0,
    }


def artifact_row(art, config: Any | None = None) -> dict:
    """The accounting of an artifact's own format, layer by layer (`oscar bench memory --artifact`)."""
    shapes = {"num_layers": art.num_layers, "num_kv_heads": art.num_kv_heads, "head_dim": art.head_dim}
    if art.meta.get("codec"):
        kind = art.meta["codec"].get("kind")
        raise OscarError(f"the artifact stores validation codec {kind!r} (validate/codebooks.py), not a cache format the "
                         "accounting knows" + ("; validate.codebooks.native_layer_artifact converts per-layer widths"
                                               if kind == "layers" else ""))
    ms = attention_shapes(config) if config is not None else shapes
    if any(ms[k] != v for k, v in shapes.items()):
        raise OscarError(f"the artifact's shapes {shapes} differ from the model's {ms}")
    h = per_history_token_layers(shapes, artifact_formats(art))
    base = per_history_token(shapes, Format("bf16", bits=16))["codes"]
    return {"layers": [asdict(f) for f in artifact_formats(art)], "history_bytes_per_token": h,
            "bits_per_element": artifact_bits_per_element(art), "history_ratio_vs_bf16": sum(h.values()) / base}


def report(config: Any, context: int = 32768, formats: list[Format] | None = None) -> dict:
    """The memory table for a model config: per history token and whole-context bytes, ratios vs BF16 (an MLA
    model's is its latent cache's: `latent_report`)."""
    if is_latent(config):
        f = formats[0] if formats else Format("bf16")
        return latent_report(config, context, latent_formats(f.sink, f.recent, f.page_size))
    shapes = attention_shapes(config)
    formats = formats or default_formats()
    base = per_history_token(shapes, Format("bf16", bits=16))["codes"]
    base_total = sum(total(shapes, Format("bf16", bits=16), context).values())
    rows = []
    for f in formats:
        h = per_history_token(shapes, f)
        t = total(shapes, f, context)
        hb = sum(h.values())
        tb = sum(t.values())
        rows.append({
            "format": f.name, **{k: v for k, v in asdict(f).items() if k != "name"}, "key_split": _split(f, shapes["head_dim"]),
            "key_drop": _drop(f, shapes["head_dim"]),
            "bits_per_element": 16.0 * (h["codes"] + h["scales"]) / base if f.bits < 16 else 16.0,
            "history_bytes_per_token": h, "history_bytes_per_token_total": hb,
            "history_ratio_vs_bf16": hb / base, "history_ratio_codes_scales_vs_bf16": (h["codes"] + h["scales"]) / base,
            "context_bytes": t, "context_bytes_total": tb, "context_ratio_vs_bf16": tb / base_total,
        })
    return {"shapes": shapes, "context": context, "bf16_bytes_per_token": base, "rows": rows,
            "targets": _targets(shapes, rows)}


def _targets(shapes: dict, rows: list[dict]) -> dict:
    """Check the issue's targets and, when a head_dim makes one unreachable, say which choice meets it."""
    D = shapes["head_dim"]
    out = {}
    by = {r["format"]: r for r in rows}
    token_rows = [r for r in rows if r["bits"] < 16 and r["mode"] == "minmax" and r["key_axis"] == "token"]
    if token_rows:
        # the target holds for INT2 with per-token scales if one per-token mode meets it (the one named)
        per = {r["format"]: {"ratio": r["history_ratio_vs_bf16"], "bits_per_element": r["bits_per_element"],
                             "param_bytes": r["param_bytes"], "met": r["history_ratio_vs_bf16"] <= 1 / 7}
               for r in token_rows}
        best = min(token_rows, key=lambda r: r["history_ratio_vs_bf16"])
        out["int2_token_le_1_7"] = {"met": per[best["format"]]["met"], "met_by": best["format"] if per[best["format"]]["met"] else None,
                                    "ratio": best["history_ratio_vs_bf16"], "rows": per}
        for name, p in per.items():
            if not p["met"] and p["param_bytes"] >= 2:
                # group needed with fp16 scale+zero per token: 2 + 32/G <= 16/7  <=>  G >= 112
                need = 32 / (16 / 7 - 2)
                p["why"] = (
                    f"head_dim {D}: per-token fp16 scale+zero cost 32/{D} = {32 / D:.3f} extra bits per element "
                    f"({2 + 32 / D:.3f} bits, ratio 1/{16 / (2 + 32 / D):.2f}); 1/7 needs a token group of >= {need:.0f} "
                    f"channels (head_dim 128 models such as GLM-4.x: 2.25 bits = 1/7.11), or 8-bit scale+zero "
                    f"(2 + 16/{D} bits: int2-token-fp8), or static mode (no per-token metadata)")
    if "int2-static" in by:
        r = by["int2-static"]
        out["int2_static_eq_1_8"] = {"ratio_codes": r["history_ratio_codes_scales_vs_bf16"],
                                     "ratio_with_page_table": r["history_ratio_vs_bf16"],
                                     "met": abs(r["history_ratio_codes_scales_vs_bf16"] - 1 / 8) < 1e-12}
    return out


# --------------------------------------------------------------------------- MLA latent caches
# An MLA engine caches per token and layer the latent c_kv (kv_lora_rank values) and one shared RoPE key k_pe
# (qk_rope_head_dim values), not per-head K/V. The INT2 latent format quantizes c_kv only, per token in groups of
# `group` values with a scale and a zero each (fp32 in the public MLA pool); k_pe, the sinks and the recent window
# stay 16-bit. At kv_lora_rank 512, group 128, fp32 scale + zero and a 64-value k_pe: 128 B of codes + 32 B of
# scales + 128 B of k_pe = 288 B per token and layer, against (512 + 64) x 2 = 1,152 B in BF16.


@dataclass
class LatentFormat:
    """A latent cache format for accounting."""

    name: str
    bits: int = 2  # 16: the BF16 latent
    group: int = LATENT_GROUP  # latent values per scale/zero pair
    param_bytes: int = 4  # bytes of each scale and zero (fp32)
    dtype_bytes: int = 2  # k_pe, sinks, recent window
    page_size: int = PAGE_SIZE
    sink: int = SINK
    recent: int = RECENT


def latent_formats(sink: int = SINK, recent: int = RECENT, page_size: int = PAGE_SIZE) -> list[LatentFormat]:
    kw = dict(sink=sink, recent=recent, page_size=page_size)
    return [LatentFormat("bf16", bits=16, **kw), LatentFormat("int2-latent", **kw)]


def latent_per_history_token(shapes: dict, f: LatentFormat) -> dict[str, float]:
    """Bytes one history token costs across all layers, by component (codes and scales: c_kv; rope_key: k_pe)."""
    L, r, p = shapes["num_layers"], shapes["kv_lora_rank"], shapes["rope_dim"]
    rope = float(L * p * f.dtype_bytes)
    if f.bits >= 16:
        return {"codes": float(L * r * f.dtype_bytes), "scales": 0.0, "rope_key": rope, "page_table": 0.0}
    if r % f.group:
        raise OscarError(f"kv_lora_rank {r} is not a whole number of {f.group}-value groups")
    return {"codes": L * r * f.bits / 8, "scales": float(L * (r // f.group) * 2 * f.param_bytes), "rope_key": rope,
            "page_table": L * PAGE_TABLE_BYTES / f.page_size}


def latent_total(shapes: dict, f: LatentFormat, context: int, batch: int = 1) -> dict[str, float]:
    """Bytes held for `batch` sequences of `context` tokens, by component (sinks and recent window 16-bit)."""
    L, r, p = shapes["num_layers"], shapes["kv_lora_rank"], shapes["rope_dim"]
    tok16 = L * (r + p) * f.dtype_bytes
    if f.bits >= 16:
        return {"codes": float(batch * context * L * r * f.dtype_bytes), "scales": 0.0,
                "rope_key": float(batch * context * L * p * f.dtype_bytes), "sinks": 0.0, "recent": 0.0,
                "page_table": 0.0}
    S, R, P = f.sink, f.recent, f.page_size
    m = max(context - S, 0)
    hist = P * ((m - R) // P) if m >= R else 0
    h = latent_per_history_token(shapes, f)
    return {"codes": batch * hist * h["codes"], "scales": batch * hist * h["scales"],
            "rope_key": batch * hist * h["rope_key"], "sinks": float(batch * min(context, S) * tok16),
            "recent": float(batch * (m - hist) * tok16), "page_table": batch * hist * h["page_table"]}


def latent_report(config: Any, context: int = 32768, formats: list[LatentFormat] | None = None) -> dict:
    """The memory table of an MLA model's latent cache: per history token and whole-context bytes, ratios vs BF16;
    bits per element count c_kv's codes and scales per latent value (k_pe is reported apart)."""
    shapes = latent_shapes(config)
    formats = formats or latent_formats()
    bf16 = LatentFormat("bf16", bits=16)
    base = sum(latent_per_history_token(shapes, bf16).values())
    base_total = sum(latent_total(shapes, bf16, context).values())
    L, r = shapes["num_layers"], shapes["kv_lora_rank"]
    rows = []
    for f in formats:
        h, t = latent_per_history_token(shapes, f), latent_total(shapes, f, context)
        rows.append({"format": f.name, **{k: v for k, v in asdict(f).items() if k != "name"},
                     "bits_per_element": 8 * (h["codes"] + h["scales"]) / (L * r),
                     "bytes_per_token_layer": (h["codes"] + h["scales"] + h["rope_key"]) / L,
                     "history_bytes_per_token": h, "history_bytes_per_token_total": sum(h.values()),
                     "history_ratio_vs_bf16": sum(h.values()) / base,
                     "context_bytes": t, "context_bytes_total": sum(t.values()),
                     "context_ratio_vs_bf16": sum(t.values()) / base_total})
    return {"kind": "latent", "shapes": shapes, "context": context, "bf16_bytes_per_token": base, "rows": rows,
            "targets": {}}


def cache_bytes(cache) -> dict:
    """Bytes a live OscarCache holds for its tokens, by component (see `pool_bytes`)."""
    return pool_bytes(cache.pool, cache.seqs)


def pool_bytes(pool, seqs: list[int]) -> dict:
    """Bytes the sequences `seqs` of a PagedKVCache hold, by component (shared pages counted once).

    Uses the pool's own tensors: bytes per page of codes / scales, 16-bit bytes per
    sink and ring token, an int32 block-table entry per page per sequence.
    """
    out = {"codes": 0, "scales": 0, "sinks": 0, "recent": 0, "page_table": 0, "constants": 0, "tokens": 0}
    if pool is None:
        return out
    cfg = pool.cfg
    per = lambda t: t.element_size() * (t.numel() // t.shape[0])  # noqa: E731  bytes per leading index
    for pc in pool.layers:
        pages = {p for s in seqs for p in pc.pages[s]}
        out["codes"] += len(pages) * (per(pc.k_codes) + per(pc.v_codes))
        if cfg.quant.mode == "static":
            out["constants"] += sum(t.numel() * t.element_size() for t in (pc.k_scale, pc.k_zero, pc.v_scale, pc.v_zero))
        else:
            out["scales"] += len(pages) * sum(per(t) for t in (pc.k_scale, pc.k_zero, pc.v_scale, pc.v_zero))
        tok = 2 * cfg.num_kv_heads * cfg.head_dim * pc.sink_k.element_size()
        for s in seqs:
            lay = layout(pc.lengths[s], cfg)
            out["sinks"] += lay.sink_len * tok
            out["recent"] += lay.ring_len * tok
            out["page_table"] += len(pc.pages[s]) * PAGE_TABLE_BYTES
    out["tokens"] = sum(pool.layers[0].lengths[s] for s in seqs)
    return out


def live_bytes(config: Any, f: Format, context: int, chunk: int = 4096, seed: int = 0) -> dict:
    """Fill a real paged pool (this config's shapes, identity rotations, bf16 segments) with `context`
    random tokens per layer and measure what it holds; the check on `total`."""
    s = attention_shapes(config)
    H, D, P = s["num_kv_heads"], s["head_dim"], f.page_size
    W = _split(f, D)
    kpd = {1: "float8_e4m3fn", 2: "float16", 4: "float32"}[f.key_param_bytes] if f.key_param_bytes else None
    quant = QuantConfig(bits=f.bits, group_size=f.group_size, key_axis=f.key_axis, mode=f.mode, sink=f.sink,
                        recent=f.recent, page_size=P, param_dtype=f.param_dtype, key_split=W, key_param_dtype=kpd,
                        **({"key_top": f.key_top, "key_drop": _drop(f, D)} if W else {}))
    cfg = PagedConfig(quant, H, D, num_pages=-(-context // P), max_seqs=1, dtype=torch.bfloat16)
    rots = [LayerRotation.identity_for(H, D) for _ in range(s["num_layers"])]
    for r in rots if W else ():
        r.clip_k = torch.ones(H, len(quant.key_parts(D)))  # a ratio per key part
    pool = PagedKVCache(cfg, rots, quantizer=quantize_pages)
    seq = pool.new_sequence()
    g = torch.Generator().manual_seed(seed)
    for pc in pool.layers:
        for a in range(0, context, chunk):
            t = min(chunk, context - a)
            pc.append(seq, torch.randn(H, t, D, generator=g), torch.randn(H, t, D, generator=g))
    return pool_bytes(pool, [seq])


def load_model_config(spec: str):
    """A transformers config from a config.json path / directory, or a model spec (oscar.modelconfig)."""
    try:
        return load(spec)
    except OscarError as e:
        raise OscarError(f"--model {spec}: {e}") from None
