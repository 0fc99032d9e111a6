"""KV-cache memory per token by component, BF16 vs each INT2 mode (fp16 and 8-bit scale/zero), at a 32k context.

    python bench/memory.py [--context 32768] [--live]

Writes bench/results/memory.json: the analytic report (oscar.kernels.memory.report)
for the embedded SmolLM2 (head_dim 64) and a GLM-4.x-shaped config (head_dim 128),
and with --live (default) the bytes a real paged pool holds after appending
`context` tokens per layer, which must equal the analytic totals.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from transformers import Glm4MoeConfig

from oscar.kernels.memory import default_formats, live_bytes, load_model_config, report, total
from oscar.common import attention_shapes


def glm4_shapes_config():
    """Attention shapes of GLM-4.5/4.6/4.7 355B-A32B (docs/scale.md): 92 layers, 96 q heads, 8 KV heads, head_dim 128."""
    return Glm4MoeConfig(num_hidden_layers=92, hidden_size=5120, num_attention_heads=96, num_key_value_heads=8,
                         head_dim=128, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--no-live", action="store_true", help="skip filling a real pool with SmolLM2 shapes")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "memory.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # appends of small page tensors: threads only add sync overhead
    smol = load_model_config("smollm2-135m")
    res = {"context": args.context, "models": {}}
    for name, cfg in (("smollm2-135m", smol), ("glm-4.x-355b-shapes", glm4_shapes_config())):
        res["models"][name] = report(cfg, args.context)
    if not args.no_live:
        live = {}
        shapes = attention_shapes(smol)
        for f in default_formats():
            if f.bits >= 16:
                continue
            t = time.time()
            got = live_bytes(smol, f, args.context)
            want = total(shapes, f, args.context)
            live[f.name] = {"live": got, "analytic": want, "equal": all(got[k] == want[k] for k in want),
                            "seconds": round(time.time() - t, 2)}
            print(f"live {f.name}: {'equal' if live[f.name]['equal'] else 'DIFFERENT'} ({live[f.name]['seconds']} s)")
        res["live_smollm2"] = live
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=2)
    for name, rep in res["models"].items():
        print(f"{name} {rep['shapes']}")
        for r in rep["rows"]:
            print(f"  {r['format']:14s} {r['bits_per_element']:.3f} bits/elem  history 1/{1 / r['history_ratio_vs_bf16']:.2f}"
                  f"  context({args.context}) 1/{1 / r['context_ratio_vs_bf16']:.2f}")
        for k, v in rep["targets"].items():
            print(f"  target {k}: {'met' if v['met'] else 'MISSED'}" + (f" by {v['met_by']}" if v.get("met_by") else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
