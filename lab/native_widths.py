"""The copy-probe widths in the cache's own per-layer format, checked on the real model.

Converts a "layers" codec artifact (what `lab/layer_copy_widths.py` wrote and every A/B ran through the simulator)
into the per-layer format OscarCache serves (`validate.codebooks.native_layer_artifact`, oscar-artifact/3), then on
held-out windows (serving protocol, float32) compares, window by window, the NLL per token of
  codec   the simulator on the codec artifact (the arm the A/B tables measured),
  native  the simulator on the converted artifact (must equal codec: same grids, clips, rounding),
  cache   OscarCache on the converted artifact (`--engine cache`: pages, the fused decode path for the last
          tokens, the reference kernels on CPU), against the simulator at the matched protocol (recent - 1),
and records the bits per element by the memory accounting (`oscar bench memory --artifact`).

    python lab/native_widths.py --model smollm2-135m --artifact runs/i16e/s4096/copy.safetensors \
        --out-artifact runs/i16e/s4096/copy.native.safetensors --out lab/results/native_widths_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    import torch

    from oscar.kernels.memory import artifact_row
    from oscar.stats.artifact import load_artifact, save_artifact
    from oscar.scoring import engine
    from oscar.recipe.widths import native_layer_artifact
    from oscar.validate.codebooks import codec_bits_per_element
    from oscar.validate.env import load_model
    from oscar.scoring.protocols import SERVING
    from oscar.validate.ppl import heldout_ids
    from oscar.scoring.nll import window_nll
    from oscar.kernels.window_attention import simulated

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--artifact", required=True, help='a "layers" codec artifact (lab/layer_copy_widths.py)')
    ap.add_argument("--out-artifact", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--length", type=int, default=1024)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    codec = load_artifact(args.artifact)
    native = native_layer_artifact(codec)
    save_artifact(native, args.out_artifact)
    native = load_artifact(args.out_artifact)  # what a user serves: the file
    model, tok, _ = load_model(args.model)
    ids = torch.tensor(heldout_ids(tok, "pydoc", args.windows * args.length)).view(args.windows, args.length)
    matched = engine.simulator_protocol(SERVING)
    rows = []
    for w in range(args.windows):
        x = ids[w:w + 1]
        r = {"window": w}
        for name, a in (("codec", codec), ("native", native)):
            with simulated(model, a, matched):
                s, n = window_nll(model, x)[:2]
            r[name] = s / n
        t0 = time.time()
        s, n = engine.window_nll(model, "oscar-int2", native, SERVING, x)[:2]
        r["cache"], r["cache_seconds"] = s / n, round(time.time() - t0, 1)
        rows.append(r)
        print(f"window {w}: NLL/token codec {r['codec']:.6f}  native {r['native']:.6f}  cache {r['cache']:.6f}")
    wide = {l: native.quant_for(l).bits + native.quant_for(l).key_top for l in range(native.num_layers)
            if native.quant_for(l).key_split}
    mem = artifact_row(native, model.config)
    res = {"model": args.model, "artifact": args.artifact, "native_artifact": args.out_artifact,
           "protocol": {"cache": SERVING.name, "sink": SERVING.sink, "recent": SERVING.recent,
                        "simulator_recent": matched.recent},
           "windows": args.windows, "length": args.length, "rows": rows,
           "max_abs_native_minus_codec": max(abs(r["native"] - r["codec"]) for r in rows),
           "max_rel_cache_minus_native": max(abs(r["cache"] - r["native"]) / r["native"] for r in rows),
           "wide_key_layers": wide, "bits_per_element_memory_accounting": mem["bits_per_element"],
           "bits_per_element_codec": codec_bits_per_element(codec), "history_ratio_vs_bf16": mem["history_ratio_vs_bf16"]}
    print(f"wide keys {wide}; {mem['bits_per_element']:.4f} bits per element (codec accounting "
          f"{res['bits_per_element_codec']:.4f}); |native - codec| <= {res['max_abs_native_minus_codec']:.2e}, "
          f"|cache - native| / native <= {res['max_rel_cache_minus_native']:.2e}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    json.dump(res, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
