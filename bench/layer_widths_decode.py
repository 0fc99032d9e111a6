"""Decode cost of the per-layer widths on the CPU serving path: each layer format the copy widths use,
timed in one run against the one-group INT2 layer it replaces.

One layer of SmolLM2's attention shape (3 KV heads, 9 query heads, head_dim 64) at `--context` tokens, the reference
decode on the codes (`kernels.reference.decode_attention`: what `dispatch` runs on CPU), timings interleaved rep by
rep (bench/decode.py). Formats: 2-bit keys and values with e4m3 params (the copy widths' 2-bit layers), keys of one
wide part at 3 and 4 bits with fp16 params, and the shipped split keys (16 channels at 3 bits). The model-level
figure weights them by SmolLM2's copy widths (bench/results/layer_copy_smollm2.json: 22 / 3 / 5 layers at
2 / 3 / 4 bits) against 30 layers of split keys and 30 of 2-bit keys.

    python bench/layer_widths_decode.py    # -> bench/results/layer_widths_decode_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections import Counter
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from decode import commit, interleaved, random_rotation  # noqa: E402  (bench/decode.py's helpers)

from oscar.kernels import reference as ref  # noqa: E402
from oscar.kernels.dispatch import quantize_pages  # noqa: E402
from oscar.kernels.paged import PagedConfig, PagedLayerCache  # noqa: E402
from oscar.stats.artifact import QuantConfig  # noqa: E402

H, G, D = 3, 3, 64
FP8 = "float8_e4m3fn"
FORMATS = {  # name -> the layer's QuantConfig
    "int2-fp8": QuantConfig(param_dtype=FP8),
    "keys3-fp16": QuantConfig(param_dtype=FP8, key_split=D, key_top=1, key_param_dtype="float16"),
    "keys4-fp16": QuantConfig(param_dtype=FP8, key_split=D, key_top=2, key_param_dtype="float16"),
    "split-fp8": QuantConfig(param_dtype=FP8, key_split=16),
}


def layer(q: QuantConfig, context: int) -> tuple[PagedLayerCache, int]:
    rot = random_rotation(H, D, "cpu")
    if q.key_split and q.key_split < D:
        rot.clip_k = torch.full((H, 2), 0.9)  # a ratio per head and key part
    c = PagedLayerCache(PagedConfig(q, H, D, num_pages=context // 16 + 1, max_seqs=1), rot, quantizer=quantize_pages)
    g = torch.Generator().manual_seed(0)
    s = c.new_sequence()
    c.append(s, torch.randn(H, context, D, generator=g) * 2, torch.randn(H, context, D, generator=g))
    return c, s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "results/layer_widths_decode_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    q = torch.randn(1, H * G, D, generator=torch.Generator().manual_seed(1))
    caches = {n: layer(f, args.context) for n, f in FORMATS.items()}
    fns = {n: (lambda c=c, s=s: ref.decode_attention(q, c, [s])) for n, (c, s) in caches.items()}
    cpu, wall = interleaved(fns, args.reps)
    widths = json.loads((HERE / "results/layer_copy_smollm2.json").read_text())["copy"]["widths"]
    n = Counter(kb for kb, _ in widths)  # key bits -> layers
    per = {2: cpu["int2-fp8"], 3: cpu["keys3-fp16"], 4: cpu["keys4-fp16"]}
    model = {"copy_widths": sum(per[b] * k for b, k in n.items()), "split_keys": len(widths) * cpu["split-fp8"],
             "int2_fp8": len(widths) * cpu["int2-fp8"]}
    res = {"commit": commit(), "host": f"{platform.node()} ({platform.processor() or platform.machine()})",
           "threads": args.threads, "context": args.context, "reps": args.reps, "shape": {"kv_heads": H, "q_heads": H * G, "head_dim": D},
           "layer_cpu_ms": {k: round(v * 1e3, 3) for k, v in cpu.items()},
           "layer_wall_ms": {k: round(v * 1e3, 3) for k, v in wall.items()},
           "layer_ratio_vs_int2_fp8": {k: round(v / cpu["int2-fp8"], 3) for k, v in cpu.items()},
           "copy_widths_layers_by_key_bits": {str(b): k for b, k in sorted(n.items())},
           "model_cpu_ms_per_token": {k: round(v * 1e3, 3) for k, v in model.items()},
           "model_ratio_copy_vs_split": round(model["copy_widths"] / model["split_keys"], 3),
           "model_ratio_copy_vs_int2_fp8": round(model["copy_widths"] / model["int2_fp8"], 3)}
    for k, v in res["layer_cpu_ms"].items():
        print(f"{k:12s} {v:8.3f} ms CPU per decode step (one layer)  x{res['layer_ratio_vs_int2_fp8'][k]:.3f} of int2-fp8")
    print(f"SmolLM2 copy widths, all 30 layers: x{res['model_ratio_copy_vs_split']:.3f} of split keys, "
          f"x{res['model_ratio_copy_vs_int2_fp8']:.3f} of int2-fp8")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
