"""`oscar fit`, `oscar variants`, `oscar inspect` (a store or an artifact), `oscar export` and `oscar import`
(the converters live in stats/interop.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from oscar.cli_options import (DEFAULT_ENGINE, ENGINE_HELP, ENGINES, EXPORT_FORMATS, add_artifact, add_device, add_model,
                               add_out, add_ray, add_recipe, add_stages)
from oscar.common import (
    OscarError, attention_shapes, config_fingerprint, int_between, nonneg_float, nonneg_int, positional_or_option,
    positive_int,
)
from oscar.defaults import LATENT_GROUP, RECENT, SINK
from oscar.stats.rotations import LATENT_VARIANTS, VARIANTS


def fit_config(args: argparse.Namespace):
    """The FitConfig `oscar fit`'s options describe."""
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.stats.artifact import QuantConfig
    from oscar.stats.fit import FitConfig
    from oscar.stats.reduce import ReduceConfig

    quant = QuantConfig(bits=args.bits, group_size=args.group_size, key_axis=args.key_axis, mode=args.mode,
                        sink=args.sink, recent=args.recent, param_dtype=args.param_dtype)
    return FitConfig(variant=args.variant, quant=quant, partial=args.partial, blocks=args.blocks, clip=not args.no_clip,
                     reduce=ReduceConfig(estimator=args.estimator, shrinkage=args.shrinkage),
                     fallback=args.fallback, seed=args.seed, threads=args.threads, progress=not args.no_progress)


def fit_command(args: argparse.Namespace) -> int:
    """`oscar fit --no-tune --widths none`: the rotations and clips alone (the recipe's later steps read the model:
    oscar/recipe/driver.py, run by the handler the main CLI attaches)."""
    store = positional_or_option(args, "store", "--store")
    if is_latent_store(store):
        return _fit_latent(args, store)
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.stats.artifact import save_artifact
    from oscar.stats.fit import fit

    art = fit(store, fit_config(args))
    save_artifact(art, args.out)
    m = art.meta
    print(f"{args.out}: variant {m['variant']}, {art.num_layers} layers x {art.num_kv_heads} KV heads x D {art.head_dim}, "
          f"{len(m['fallbacks'])} fallback(s), blocks {len(m['provenance']['blocks'])}"
          f"{' (PARTIAL store)' if m['provenance']['partial'] else ''}, {m['fit']['seconds']} s")
    return 0


def is_latent_store(path: str) -> bool:
    """A latent (MLA) store: fitted by the latent fit (its root attributes only are read)."""
    # late: keeps zarr (0.33 s) out of `oscar --help`
    from oscar.pipeline.store import FORMAT_LATENT, store_format

    return store_format(path) == FORMAT_LATENT


def _fit_latent(args: argparse.Namespace, store: str) -> int:
    """`oscar fit --no-tune` of a latent store: the latent rotation, mean and per-group clips (stats/latent.py)."""
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.stats.artifact import save_latent_artifact

    art = latent_fit(args, store)
    save_latent_artifact(art, args.out)
    print(latent_line(args.out, art))
    return 0


def latent_line(path: str, art) -> str:
    """What `oscar fit` prints for a latent artifact."""
    m = art.meta
    tuning = m.get("clip_tuning") or {}
    return (f"{path}: latent variant {m['variant']}, {art.num_layers} layers x kv_lora_rank {art.rot[0].shape[0]}, "
            f"blocks {len(m['provenance']['blocks'])}{' (PARTIAL store)' if m['provenance']['partial'] else ''}, "
            f"{m['fit']['seconds']} s" + (f", clips x{tuning['chosen_factor']}" if tuning else ""))


def latent_fit(args: argparse.Namespace, store: str):
    """The latent artifact `oscar fit`'s options ask for (refused in one line where they name a per-head recipe)."""
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.stats.artifact import LatentQuant
    from oscar.stats.latent import LatentFitConfig, fit_latent

    variant = "attention" if args.variant == "scaled" else args.variant  # the default: the latent's attention fit
    if variant not in LATENT_VARIANTS:
        raise OscarError(f"{store} is a latent store (MLA model): --variant {args.variant} is a per-head recipe; "
                         f"latent variants: {', '.join(LATENT_VARIANTS)}")
    if args.bits != 2 or args.group_size not in (None, LATENT_GROUP) or args.key_axis != "token" or args.mode != "minmax":
        raise OscarError(f"{store} is a latent store: the latent cache stores 2-bit minmax groups of {LATENT_GROUP} "
                         "(--bits, --group-size, --key-axis and --mode are the per-head format's)")
    quant = LatentQuant(sink=args.sink, recent=args.recent)
    estimator = "plain" if args.estimator == "auto" else args.estimator
    return fit_latent(store, LatentFitConfig(variant=variant, quant=quant, estimator=estimator,
                                             clip=not args.no_clip, seed=args.seed), partial=args.partial)


def _cmd_variants(args: argparse.Namespace) -> int:
    for v in VARIANTS.values():
        print(f"{v.name:18s} {v.doc}")
    print("latent stores (MLA models):")
    for name, doc in LATENT_VARIANTS.items():
        print(f"  {name:16s} {doc}")
    return 0


def _inspect(args) -> int:
    path = Path(args.path)
    if not path.exists():
        raise OscarError(f"{path} does not exist")
    if path.suffix == ".safetensors":
        # late: keeps torch (2.1 s) out of `oscar --help`
        from oscar.stats.artifact import describe

        print(describe(str(path)))
        return 0
    # late: keeps zarr (0.33 s) out of `oscar --help`
    from oscar.pipeline.store import format_summary, summarize

    s = summarize(path, top=args.top)
    print(json.dumps(s, indent=2, default=str) if args.json else format_summary(s))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.modelconfig import load_model_config
    from oscar.stats.artifact import check_pairing, load_artifact
    from oscar.stats.interop import (
        GGUF_EXT, SGLANG, SGLANG_EXT, embedded_gguf, export_gguf, export_sglang, unsupported_parts,
    )

    path = positional_or_option(args, "artifact", "--artifact")
    if _is_latent_artifact(path):
        return _export_latent(args, path)
    art = load_artifact(path)
    fv = args.format_version
    ext = SGLANG_EXT if args.format == SGLANG else GGUF_EXT
    if fv is not None and fv not in ((1, 2, SGLANG_EXT) if args.format == SGLANG else (1, GGUF_EXT)):
        raise OscarError(f"--format-version {fv}: {args.format} has "
                         + ("1, 2 and 3" if args.format == SGLANG else "1 and 2"))
    lost = unsupported_parts(art)
    if lost and art.rot_q is None and (fv or 1) != ext:  # the extension carries every part; rot_q: refused below
        print(f"note: {args.format} version {fv or 'default'} carries rotations only; not exported: "
              f"{', '.join(lost)} (--format-version {ext}: the oscar extension carries them)", file=sys.stderr)
    if args.format == SGLANG:
        for p in export_sglang(art, args.out, tag=args.tag, format_version=fv):
            print(p)
    else:
        args.model_gguf = args.model_gguf or embedded_gguf()
        # the artifact against the GGUF's model (its config read from the file's metadata), before OUT is made
        check_pairing(art, load_model_config(args.model_gguf), path, args.model_gguf)
        os.makedirs(args.out, exist_ok=True)
        out = os.path.join(args.out, os.path.basename(args.model_gguf).replace(".gguf", ".oscar-rot.gguf"))
        print(export_gguf(art, args.model_gguf, out, format_version=fv))
    return 0


def _is_latent_artifact(path: str) -> bool:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.artifact_header import ARTIFACT_FORMAT_LATENT
    from oscar.stats.artifact import artifact_format

    return os.path.isfile(path) and artifact_format(path) == ARTIFACT_FORMAT_LATENT


def _export_latent(args: argparse.Namespace, path: str) -> int:
    """`oscar export` of a latent (MLA) artifact: sglang-oscar's latent_rotation_TAG.pt."""
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.stats.artifact import load_latent_artifact
    from oscar.stats.interop import SGLANG, export_sglang_latent

    if args.format != SGLANG or args.format_version not in (None, 1):
        raise OscarError(f"{path} is a latent (MLA) artifact: it exports as --format {SGLANG} (latent_rotation_TAG.pt, "
                         "format version 1) only")
    print(export_sglang_latent(load_latent_artifact(path), args.out, tag=args.tag))
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.modelconfig import load_model_config
    from oscar.stats.artifact import save_artifact
    from oscar.stats.interop import SGLANG, import_gguf, import_sglang, import_sglang_latent, latent_file

    lat = latent_file(args.path, args.tag) if args.format == SGLANG and os.path.isdir(args.path) else None
    if lat is not None:  # an MLA model's latent rotations
        # late: keeps torch (2.1 s) out of `oscar --help`
        from oscar.stats.artifact import save_latent_artifact

        art = import_sglang_latent(lat)
        if args.model:
            art.check_model(load_model_config(args.model))
        save_latent_artifact(art, args.out)
        print(args.out)
        return 0
    art = import_sglang(args.path, tag=args.tag, num_kv_heads=args.num_kv_heads) if args.format == SGLANG else import_gguf(args.path)
    if args.model:
        cfg = load_model_config(args.model)  # the config alone: same fingerprint as the resolved model's
        art.meta["model"] = dict(attention_shapes(cfg), fingerprint=config_fingerprint(cfg), name=args.model)
        art.check_model(cfg)
    save_artifact(art, args.out)
    print(args.out)
    return 0


def _register_interop(sub) -> None:
    p = sub.add_parser("export", help="export an artifact for a serving engine (sglang-oscar, gguf-rot)",
                       description="Write an artifact in a format a serving engine loads: the sglang-oscar .pt files "
                                   "or a copy of a GGUF model with the rotations added (docs/interop.md). The plain "
                                   "formats carry rotations only; the oscar extension carries the whole recipe.")
    p.add_argument("artifact_pos", nargs="?", metavar="ARTIFACT", default=None,
                   help="artifact .safetensors; the same as --artifact (the positional spelling scripts use)")
    add_artifact(p, "artifact .safetensors to export; required, here or as ARTIFACT")
    p.add_argument("--format", choices=EXPORT_FORMATS, required=True,
                   help="sglang-oscar ({k,v}_rotation_TAG.pt) or gguf-rot (GGUF model copy with rotation tensors)")
    add_out(p, "output directory")
    p.add_argument("--tag", default="oscar", help="file tag for sglang-oscar ({k,v}_rotation_TAG.pt)")
    p.add_argument("--format-version", type=int, choices=(1, 2, 3), default=None,
                   help="sglang-oscar: 1 = one rotation per layer, 2 = per KV head (the published fork's schema, "
                        "rotations only), 3 = oscar extension (query transform, key mean, clips, quant config); "
                        "gguf-rot: 1 = rotations only, 2 = oscar extension (default: the extension when the artifact "
                        "has a query transform, which nothing else can carry, else the smallest rotation-only version)")
    p.add_argument("--model-gguf", help="gguf-rot: the GGUF model file to copy (default: the embedded SmolLM2)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("import", help="import rotations calibrated elsewhere into an artifact",
                       description="Read sglang-oscar .pt files or a gguf-rot GGUF (plain or oscar extension) back into "
                                   "an artifact that `oscar validate` and OscarCache load.")
    p.add_argument("path", help="sglang-oscar directory or gguf-rot file")
    p.add_argument("--format", choices=EXPORT_FORMATS, required=True, help="format of PATH: sglang-oscar or gguf-rot")
    add_out(p, "artifact .safetensors to write")
    p.add_argument("--tag", default=None, help="sglang-oscar file tag to read (default: the only {k,v}_rotation_*.pt pair)")
    p.add_argument("--num-kv-heads", type=positive_int, default=None,
                   help="KV heads to broadcast a per-layer (format_version 1) rotation to (default: none; v1 needs it)")
    add_model(p, "record and check this model's fingerprint (default: no check)", default=None)
    p.set_defaults(func=_cmd_import)


def register(sub) -> None:
    p = sub.add_parser("fit", help="fit the shipped recipe from a calibration store: rotations, clips, tuned key clips "
                       "and per-layer key widths, into an artifact",
                       description="Eigendecompose the store's accumulated statistics per layer and KV head, build the "
                                   "variant's rotations and search the clip thresholds for the cache format; then tune "
                                   "the key clips and choose per-layer key widths through the model on the store's "
                                   "calibration text (oscar-int2 as `oscar run` ships it), and write a versioned "
                                   ".safetensors artifact (docs/artifact-format.md). The steps resume from OUT's "
                                   "sibling directory <OUT without .safetensors>.recipe/. --no-tune --widths none: the "
                                   "rotations and clips alone, without the model.")
    p.add_argument("store_pos", nargs="?", metavar="STORE", default=None,
                   help="calibration store; the same as --store (the positional spelling scripts use)")
    p.add_argument("--store", default=None, help="calibration store (zarr directory, oscar-calib/2; /1 read with a warning); required, "
                   "here or as STORE (no default)")
    add_out(p, "artifact .safetensors to write")
    p.add_argument("--variant", default="scaled", help=f"rotation recipe: {', '.join(sorted(VARIANTS))} (default scaled, "
                   "the rotations `oscar run` ships; oscar: the published recipe; `oscar variants` describes each); a "
                   f"latent store (MLA model): {', '.join(LATENT_VARIANTS)} (the default fits attention)")
    p.add_argument("--estimator", default="auto", help="covariance estimator across blocks: auto (robust where tails "
                   "are heavy) | plain | mom (median of means) | trimmed")
    p.add_argument("--shrinkage", default="oas", choices=("oas", "lw", "none"),
                   help="eigenvalue shrinkage when rows < 10 x head_dim: oas, lw (Ledoit-Wolf on reservoir rows), none")
    p.add_argument("--partial", action="store_true", help="fit an incomplete store from its fully done blocks only")
    p.add_argument("--blocks", type=positive_int, default=None,
                   help="fit the store's first N done blocks only (a budget study's prefixes of one calibration; "
                        "default: every done block)")
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
    add_recipe(p)
    add_model(p, "model the tune and the widths read: preset, HF directory or .gguf file (default: the store's)",
              default=None)
    p.add_argument("--engine", default=DEFAULT_ENGINE, choices=ENGINES, help=ENGINE_HELP + "; for the tune")
    add_device(p, "device the tune and the widths run the model on: cpu (default), cuda or cuda:N")
    g = p.add_argument_group("pipeline stages (Ray)")
    add_ray(g, "run the tune's windows and the widths' gradient on stage actors holding the layer ranges "
               "calibration uses: ADDRESS (ray://..., host:port) or auto (a running local cluster, else one on "
               "127.0.0.1); not with --widths copy (default: none, the model in this process)")
    add_stages(g, "stage actors (layer ranges balanced by parameters; default 1 with --ray)")
    g.add_argument("--cpus-per-stage", type=nonneg_float, default=1.0, help="Ray CPUs reserved per stage actor")
    p.set_defaults(func=fit_command)  # the recipe's handler replaces it where the main CLI is built (oscar/cli.py)

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

    _register_interop(sub)
