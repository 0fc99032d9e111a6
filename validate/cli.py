"""`oscar validate niah|ppl|attention` and the main job `oscar run`."""

from __future__ import annotations

import argparse

from oscar.validate import DEFAULT_METHODS as _DEFAULT_METHODS

DEFAULT_METHODS = ",".join(_DEFAULT_METHODS)


def _lengths(s: str) -> list[int]:
    from oscar.validate.ruler import parse_length

    return [parse_length(x) for x in s.split(",") if x.strip()]


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def register(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("validate", help="RULER-style needle tests, perplexity, attention-level retrieval")
    vs = v.add_subparsers(dest="validate_command", required=True, metavar="CHECK")

    n = vs.add_parser("niah", help="RULER-style tasks under the strict protocol (resumable)")
    n.add_argument("--model", default="smollm2-135m")
    n.add_argument("--artifact", help="fitted artifact (needed by oscar-int2)")
    n.add_argument("--methods", default=DEFAULT_METHODS)
    n.add_argument("--tasks", default="niah_single_1,niah_single_2", help="comma list, or 'all'")
    n.add_argument("--lengths", default="1k,2k,4k", help="e.g. 1k,2k,4k,...,128k (1k = 1024 tokens)")
    n.add_argument("--samples", type=int, default=20)
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--protocol", default="strict", choices=["strict", "serving", "strict-token"])
    n.add_argument("--corpus", default="pydoc")
    n.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model compute dtype")
    n.add_argument("--out", required=True)
    n.set_defaults(func=_niah)

    p = vs.add_parser("ppl", help="held-out perplexity, strict and serving protocols")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--artifact")
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--contexts", default="1k,4k")
    p.add_argument("--protocols", default="strict,serving",
                   help="comma-separated: strict, serving, strict-token (diagnostic; docs/validation.md)")
    p.add_argument("--tokens", type=int, default=8192, help="held-out tokens scored per context")
    p.add_argument("--corpus", default="pydoc")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model compute dtype")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_ppl)

    t = vs.add_parser("tune", help="scale the artifact's key clips by the factor with the lowest strict NLL on calibration text")
    t.add_argument("--model", default="smollm2-135m")
    t.add_argument("--artifact", required=True)
    t.add_argument("--factors", default="1.0,1.1,1.2,1.3,1.4,1.5", help="× the fitted key clip (ratios capped at 1)")
    t.add_argument("--tokens", type=int, default=2048, help="calibration-split tokens scored per factor")
    t.add_argument("--protocol", default="strict", choices=["strict", "serving"])
    t.add_argument("--corpus", default="pydoc")
    t.add_argument("--out", required=True, help="tuned artifact (.safetensors)")
    t.set_defaults(func=_tune)

    a = vs.add_parser("attention", help="attention-level retrieval to 128k on real captured q/k/v (not a model run)")
    a.add_argument("--store", required=True, help="calibration store (reservoirs layers/{l}/{q,k,v}_res)")
    a.add_argument("--artifact")
    a.add_argument("--methods", default="naive-int2,kivi2,hadamard-int2,oscar-ref-int2,oscar-int2")
    a.add_argument("--lengths", default="4k,16k,32k,64k,128k")
    a.add_argument("--trials", type=int, default=8)
    a.add_argument("--layers", default="", help="comma list of layers (default: 4 spread over depth)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--out", required=True)
    a.set_defaults(func=_attention)

    r = sub.add_parser("run", help="the main job: calibrate -> fit -> validate -> report, resumable by stage")
    r.add_argument("--out", required=True)
    r.add_argument("--no-ray", action="store_true", help="calibrate in this process instead of a local Ray cluster")
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--samples", type=int, default=None, help="NIAH samples per cell (default 20)")
    r.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma list of KV-cache methods to compare (default: %(default)s; also tq-int2, sq-int2: "
                        "validate/methods.py)")
    r.add_argument("--full", action="store_true", help="larger perplexity budget (8192 held-out tokens per context; slower)")
    r.add_argument("--variant", default="scaled", help="fit variant behind oscar-int2 (see `oscar variants`)")
    r.add_argument("--no-tune", action="store_true", help="keep the fit's key clips (skip `oscar validate tune`)")
    r.add_argument("--niah-protocol", default="serving", choices=("serving", "strict"),
                   help="cache protocol for the needle tests (perplexity reports both)")
    r.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                   help="model compute dtype for NIAH and perplexity (default bfloat16: serving precision, fast on "
                        "CPUs with bf16 units; float32 is digit-comparable with `oscar validate` defaults)")
    r.set_defaults(func=_run)


def _niah(args) -> int:
    from oscar.validate.niah import NiahConfig, run_niah
    from oscar.validate.ruler import TASKS

    tasks = list(TASKS) if args.tasks == "all" else _csv(args.tasks)
    cfg = NiahConfig(out=args.out, model=args.model, artifact=args.artifact, methods=_csv(args.methods), tasks=tasks,
                     lengths=_lengths(args.lengths), samples=args.samples, seed=args.seed, protocol=args.protocol,
                     corpus=args.corpus, dtype=args.dtype)
    df = run_niah(cfg)
    print(df.pivot_table(index=["task", "method"], columns="length", values="score").round(1).to_string())
    return 0


def _ppl(args) -> int:
    from oscar.validate.ppl import PplConfig, run_ppl

    cfg = PplConfig(out=args.out, model=args.model, artifact=args.artifact, methods=_csv(args.methods),
                    contexts=_lengths(args.contexts), protocols=_csv(args.protocols), tokens=args.tokens, corpus=args.corpus,
                    dtype=args.dtype)
    df = run_ppl(cfg)
    print(df.round(3).to_string(index=False))
    return 0


def _tune(args) -> int:
    from oscar.stats.artifact import load_artifact, save_artifact
    from oscar.validate.env import load_model
    from oscar.validate.tune import TuneConfig, tune_key_clip

    cfg = TuneConfig(factors=tuple(float(x) for x in _csv(args.factors)), tokens=args.tokens, protocol=args.protocol,
                     corpus=args.corpus)
    art = load_artifact(args.artifact)
    model, tok, _ = load_model(args.model)
    tuned, rec = tune_key_clip(model, tok, art, cfg)
    save_artifact(tuned, args.out)
    for f, v in rec["nll_per_token"].items():
        print(f"factor {f}: NLL/token {v:.5f}{'  <- chosen' if float(f) == rec['chosen_factor'] else ''}")
    print(f"{args.out}: key clips x{rec['chosen_factor']} (mean {rec['mean_clip_k_before']:.3f} -> {rec['mean_clip_k_after']:.3f})")
    return 0


def _attention(args) -> int:
    from oscar.validate.attention import AttnConfig, run_attention

    cfg = AttnConfig(out=args.out, store=args.store, artifact=args.artifact, methods=_csv(args.methods),
                     lengths=_lengths(args.lengths), trials=args.trials, seed=args.seed,
                     layers=[int(x) for x in _csv(args.layers)])
    df = run_attention(cfg)
    print(df.round(4).to_string(index=False))
    return 0


def _run(args) -> int:
    from oscar.validate.run import RunConfig, run_main

    from oscar.validate.methods import parse_methods

    run_main(RunConfig(out=args.out, ray=not args.no_ray, model=args.model, samples=args.samples, full=args.full,
                       methods=parse_methods(args.methods),
                       variant=args.variant, tune=not args.no_tune, niah_protocol=args.niah_protocol, dtype=args.dtype))
    return 0
