"""`oscar fit` and `oscar variants` (export/import live in stats/interop.py)."""

from __future__ import annotations

import argparse
import sys


def _cmd_fit(args: argparse.Namespace) -> int:
    from oscar.stats.artifact import QuantConfig, save_artifact
    from oscar.stats.fit import FitConfig, fit
    from oscar.stats.reduce import ReduceConfig

    quant = QuantConfig(bits=args.bits, group_size=args.group_size, key_axis=args.key_axis, mode=args.mode,
                        sink=args.sink, recent=args.recent, param_dtype=args.param_dtype)
    cfg = FitConfig(variant=args.variant, quant=quant, partial=args.partial, clip=not args.no_clip,
                    reduce=ReduceConfig(estimator=args.estimator, shrinkage=args.shrinkage),
                    fallback=args.fallback, seed=args.seed, threads=args.threads, progress=not args.quiet)
    art = fit(args.store, cfg)
    save_artifact(art, args.out)
    m = art.meta
    print(f"{args.out}: variant {m['variant']}, {art.num_layers} layers x {art.num_kv_heads} KV heads x D {art.head_dim}, "
          f"{len(m['fallbacks'])} fallback(s), blocks {len(m['provenance']['blocks'])}"
          f"{' (PARTIAL store)' if m['provenance']['partial'] else ''}, {m['fit']['seconds']} s")
    return 0


def _cmd_variants(args: argparse.Namespace) -> int:
    from oscar.stats.rotations import VARIANTS

    for v in VARIANTS.values():
        print(f"{v.name:18s} {v.doc}")
    return 0


def register(sub) -> None:
    from oscar.stats.rotations import VARIANTS  # light: numpy + the registry

    p = sub.add_parser("fit", help="fit rotations and clip thresholds from a calibration store into an artifact")
    p.add_argument("store", help="calibration store (zarr directory, oscar-calib/1)")
    p.add_argument("--out", required=True, help="artifact .safetensors to write")
    p.add_argument("--variant", default="oscar", help=f"rotation recipe: {', '.join(sorted(VARIANTS))} (default oscar)")
    p.add_argument("--estimator", default="auto", help="auto (robust where tails are heavy) | plain | mom | trimmed")
    p.add_argument("--shrinkage", default="oas", choices=("oas", "lw", "none"))
    p.add_argument("--partial", action="store_true", help="fit an incomplete store from its fully done blocks only")
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--key-axis", choices=("token", "channel"), default="token")
    p.add_argument("--mode", choices=("minmax", "static"), default="minmax")
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--recent", type=int, default=256)
    p.add_argument("--param-dtype", choices=("float16", "float8_e4m3fn"), default="float16",
                   help="minmax scale/zero storage; the clip search fits that format (float8_e4m3fn: 8-bit, 2.25 bits "
                        "per element at head_dim 64)")
    p.add_argument("--no-clip", action="store_true", help="skip the clip search (clip 1.0)")
    p.add_argument("--fallback", choices=("hadamard", "none"), default="hadamard")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd_fit)

    p = sub.add_parser("variants", help="list the rotation variants `oscar fit --variant` accepts")
    p.set_defaults(func=_cmd_variants)
