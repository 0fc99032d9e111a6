"""Block-FP8 checkpoints as GLM-4.7-FP8 and DeepSeek-V3 ship them (float8_e4m3fn decoder weights, one float32
`weight_scale_inv` per 128x128 block, per-expert layout), written from a plain checkpoint together with their
dequantized twin. Used by tests/test_quantized_checkpoints.py and by bench/gpu_e2e.py's FP8 calibration check
(which puts tests/ on sys.path)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from oscar.modelconfig import layer_of
from helpers.cluster import per_expert

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = (128, 128)
FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic", "fmt": "e4m3"}
INDEX = "model.safetensors.index.json"


def _grid(x: torch.Tensor, block) -> torch.Tensor:
    """(R, C) -> (ceil(R/br), ceil(C/bc), br, bc) blocks, the partial ones zero-padded."""
    br, bc = block
    R, C = x.shape
    pad = torch.zeros(-(-R // br) * br, -(-C // bc) * bc, dtype=x.dtype, device=x.device)
    pad[:R, :C] = x
    return pad.view(pad.shape[0] // br, br, pad.shape[1] // bc, bc).transpose(1, 2)


def quantize_block_fp8(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn codes, float32 scale_inv = block amax / 448), one scale per block, partial blocks too."""
    br, bc = block
    R, C = w.shape
    g = _grid(w.float(), block)                                          # (nr, nc, br, bc)
    s = g.abs().amax(dim=(-2, -1)).clamp_min(1e-12) / FP8_MAX            # (nr, nc)
    s_full = s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:R, :C]  # (R, C)
    return (w.float() / s_full).to(torch.float8_e4m3fn), s


def dequantize(q: torch.Tensor, s: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """codes * their block's scale, in float32 (exact: float32 holds every e4m3 x float32-scale product)."""
    br, bc = block
    R, C = q.shape[-2:]
    return q.float() * s.float().repeat_interleave(br, -2).repeat_interleave(bc, -1)[..., :R, :C]


def is_quantized(name: str, t: torch.Tensor) -> bool:
    """What GLM-4.7-FP8 quantizes: the linear weights of the decoder layers (not norms, not the router, not the
    embeddings, not biases)."""
    return layer_of(name) is not None and t.dim() >= 2 and not name.endswith("mlp.gate.weight")


def write_pair(src: str, fp8_dir: str, twin_dir: str, twin_dtype: torch.dtype = torch.float32) -> None:
    """From the sharded checkpoint `src`: its block-FP8 version and the FP8 version's dequantized twin (in
    `twin_dtype`), both in the per-expert layout, one shard per layer (embeddings, final norm, LM head apart)."""
    wm = json.load(open(os.path.join(src, INDEX)))["weight_map"]
    fp8: dict[str, dict] = {}
    twin: dict[str, dict] = {}
    for k, shard in sorted(wm.items()):
        with safe_open(os.path.join(src, shard), "pt") as fh:
            t = fh.get_tensor(k)
        l = layer_of(k)
        fname = "other.safetensors" if l is None else f"layer-{l}.safetensors"
        for name, w in per_expert(k, t).items():
            if is_quantized(name, w):
                q, s = quantize_block_fp8(w)
                fp8.setdefault(fname, {})[name] = q
                fp8[fname][name + "_scale_inv"] = s
                twin.setdefault(fname, {})[name] = dequantize(q, s).to(twin_dtype)
            else:
                fp8.setdefault(fname, {})[name] = w
                twin.setdefault(fname, {})[name] = w
    cfg = json.load(open(os.path.join(src, "config.json")))
    for d, shards, qc in ((fp8_dir, fp8, FP8_CONFIG), (twin_dir, twin, None)):
        os.makedirs(d)
        for f in os.listdir(src):
            if not f.endswith(".safetensors") and f not in (INDEX, "config.json"):
                shutil.copy(os.path.join(src, f), os.path.join(d, f))
        for f, tensors in shards.items():
            save_file(tensors, os.path.join(d, f), metadata={"format": "pt"})
        json.dump({"metadata": {}, "weight_map": {k: f for f, ts in shards.items() for k in ts}},
                  open(os.path.join(d, INDEX), "w"), indent=1)
        json.dump({**cfg, **({"quantization_config": qc} if qc else {})}, open(os.path.join(d, "config.json"), "w"),
                  indent=1)
