"""`oscar fit`, `oscar variants` and `oscar inspect` (a store or an artifact; export/import live in stats/interop.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from oscar.cli_options import add_out
from oscar.common import int_between, nonneg_int, positive_int
from oscar.defaults import RECENT, SINK


def _cmd_fit(args: argparse.Namespace) -> int:
    from oscar.stats.artifact import QuantConfig, save_artifact
    from oscar.stats.fit import FitConfig, fit
    from oscar.stats.reduce import ReduceConfig

    quant = QuantConfig(bits=args.bits, group_size=args.group_size, key_axis=args.key_axis, mode=args.mode,
                        sink=args.sink, recent=args.recent, param_dtype=args.param_dtype)
    cfg = FitConfig(variant=args.variant, quant=quant, partial=args.partial, clip=not args.no_clip,
                    reduce=ReduceConfig(estimator=args.estimator, shrinkage=args.shrinkage),
                    fallback=args.fallback, seed=args.seed, threads=args.threads, progress=not args.no_progress)
    from oscar.common import positional_or_option

    art = fit(positional_or_option(args, "store", "--store"), cfg)
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


def _inspect(args) -> int:
    from oscar.common import OscarError

    path = Path(args.path)
    if not path.exists():
        raise OscarError(f"{path} does not exist")
    if path.suffix == ".safetensors":
        from oscar.stats.artifact import describe

        print(describe(str(path)))
        return 0
    from oscar.pipeline.store import format_summary, summarize

    s = summarize(path, top=args.top)
    print(json.dumps(s, indent=2, default=str) if args.json else format_summary(s))
    return 0


def register(sub) -> None:
    from oscar.stats.rotations import VARIANTS  # light: numpy + the registry

    p = sub.add_parser("fit", help="fit rotations and clip thresholds from a calibration store into an artifact",
                       description="Eigendecompose the store's accumulated statistics per layer and KV head, build the "
                                   "variant's rotations, search the clip thresholds for the cache format and write a "
                                   "versioned .safetensors artifact (docs/artifact-format.md).")
    p.add_argument("store_pos", nargs="?", metavar="STORE", default=None,
                   help="calibration store; the same as --store (the positional spelling scripts use)")
    p.add_argument("--store", default=None, help="calibration store (zarr directory, oscar-calib/2; /1 read with a warning); required, "
                   "here or as STORE (no default)")
    add_out(p, "artifact .safetensors to write")
    p.add_argument("--variant", default="scaled", help=f"rotation recipe: {', '.join(sorted(VARIANTS))} (default scaled, "
                   "the rotations `oscar run` ships; oscar: the published recipe; `oscar variants` describes each)")
    p.add_argument("--estimator", default="auto", help="covariance estimator across blocks: auto (robust where tails "
                   "are heavy) | plain | mom (median of means) | trimmed")
    p.add_argument("--shrinkage", default="oas", choices=("oas", "lw", "none"),
                   help="eigenvalue shrinkage when rows < 10 x head_dim: oas, lw (Ledoit-Wolf on reservoir rows), none")
    p.add_argument("--partial", action="store_true", help="fit an incomplete store from its fully done blocks only")
    p.add_argument("--bits", type=int_between(1, 8), default=2, help="bits per stored K/V element")
    p.add_argument("--group-size", type=positive_int, default=None,
                   help="elements per quantization group (default: head_dim for per-token groups, page_size tokens "
                        "for per-channel keys)")
    p.add_argument("--key-axis", choices=("token", "channel"), default="token",
                   help="key grouping: token (one group per token) or channel (KIVI-style, over a group of tokens)")
    p.add_argument("--mode", choices=("minmax", "static"), default="minmax",
                   help="minmax: per-group scale/zero with clip ratios; static: fixed symmetric grid at absolute clips")
    p.add_argument("--sink", type=nonneg_int, default=SINK, help="first tokens of each sequence kept in the model dtype")
    p.add_argument("--recent", type=nonneg_int, default=RECENT, help="latest tokens kept in the model dtype")
    p.add_argument("--param-dtype", choices=("float16", "float8_e4m3fn"), default="float16",
                   help="minmax scale/zero storage; the clip search fits that format (float8_e4m3fn: 8-bit, 2.25 bits "
                        "per element at head_dim 64)")
    p.add_argument("--no-clip", action="store_true", help="skip the clip search (clip 1.0)")
    p.add_argument("--fallback", choices=("hadamard", "none"), default="hadamard",
                   help="rotation of a head whose eigenbasis is unstable across blocks: hadamard (H P_br) or none (keep it)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the randomised variants (random, clip search samples)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads of the clip search (default: torch's own choice)")
    p.add_argument("--no-progress", "--quiet", dest="no_progress", action="store_true",
                   help="no progress bars (--quiet: the same, the older spelling)")
    p.set_defaults(func=_cmd_fit)

    p = sub.add_parser("variants", help="list the rotation variants `oscar fit --variant` accepts",
                       description="Print each rotation variant `oscar fit --variant` (and `oscar run --variant`) "
                                   "accepts, with a one-line description of its recipe.")
    p.set_defaults(func=_cmd_variants)

    p = sub.add_parser("inspect", help="summarise a calibration store or an artifact",
                       description="A zarr calibration store: schema, blocks done, tokens, per-layer top "
                                   "eigenvalues of C_Q and C_S, key kurtosis. A .safetensors artifact: its metadata.")
    p.add_argument("path", help="a calibration store (zarr directory) or an artifact (.safetensors)")
    p.add_argument("--json", action="store_true", help="print a store's summary as JSON (an artifact is always described as text)")
    p.add_argument("--top", type=positive_int, default=3, help="eigenvalues shown per layer (default 3)")
    p.set_defaults(func=_inspect)
