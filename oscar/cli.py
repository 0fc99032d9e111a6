"""The commands that compose stages with reports: `oscar run` (the main job, oscar/run.py) and `oscar ablate`
(the synthetic ablation, oscar.validate.ablation, then its report); and the handlers of `oscar validate tune /
widths`, which write an artifact. Like oscar/run.py this may import every stage."""

from __future__ import annotations

import argparse
import dataclasses
import os

from oscar.cli_options import DEFAULT_ENGINE, ENGINE_HELP, ENGINES, add_device, add_methods, add_model, add_out
from oscar.common import OscarError, nonneg_int, positive_float, positive_int
from oscar.defaults import TUNE_OBJECTIVES
from oscar.validate.cli import _qa_args


def register(sub: argparse._SubParsersAction) -> None:
    _register_run(sub)
    _register_ablate(sub)
    _attach_validate_writers(sub)


def _attach_validate_writers(sub: argparse._SubParsersAction) -> None:
    """`oscar validate tune` and `oscar validate widths` end by writing an artifact: their parsers are validation's
    (validate/cli.py), their handlers live here, beside the main job, since validate/ writes no artifact."""
    v = sub.choices.get("validate")
    if v is None:  # the validate stage's CLI is not registered
        return
    vs = next(a for a in v._actions if isinstance(a, argparse._SubParsersAction))
    vs.choices["tune"].set_defaults(func=_validate_tune)
    vs.choices["widths"].set_defaults(func=_validate_widths)


def _validate_tune(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.stats.artifact import load_artifact, save_artifact
    from oscar.validate.cli import _csv
    from oscar.validate.engine import check_engine, resolve_device
    from oscar.validate.env import load_model
    from oscar.validate.tune import TuneConfig, tune_key_clip

    cfg = TuneConfig(factors=tuple(float(x) for x in _csv(args.factors)), tokens=args.tokens, protocol=args.protocol,
                     corpus=args.corpus, objective=args.objective, nll_slack=args.nll_slack,
                     copy_windows=args.copy_windows)
    check_engine(args.engine)
    resolve_device(args.device)  # before loading weights
    art = load_artifact(args.artifact)
    model, tok, _ = load_model(args.model)
    tuned, rec = tune_key_clip(model, tok, art, cfg, progress=not args.no_progress, engine=args.engine,
                               device=args.device)
    save_artifact(tuned, args.out)
    copy = rec.get("copy_nll_per_token", {})
    for f, v in rec["nll_per_token"].items():
        c = f"  copy NLL/token {copy[f]:.5f}" if f in copy else ""
        print(f"factor {f}: NLL/token {v:.5f}{c}{'  <- chosen' if float(f) == rec['chosen_factor'] else ''}")
    print(f"{args.out}: key clips x{rec['chosen_factor']} (mean {rec['mean_clip_k_before']:.3f} -> {rec['mean_clip_k_after']:.3f})")
    return 0


def _validate_widths(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.kernels.memory import artifact_bits_per_element
    from oscar.stats.artifact import load_artifact, save_artifact
    from oscar.validate.env import load_model
    from oscar.validate.tune import TuneConfig, copy_widths_artifact

    art = load_artifact(args.artifact)
    model, tok, _ = load_model(args.model)
    cfg = TuneConfig(copy_windows=args.windows, copy_length=args.length)
    log = args.out + (".probes.jsonl" if args.estimate == "probe" else ".gradients.jsonl")
    out, err = copy_widths_artifact(model, tok, art, cfg, log=log, progress=not args.no_progress, estimate=args.estimate)
    save_artifact(out, args.out)
    for l in range(out.num_layers):
        q = out.quant_for(l)
        kb = q.bits + (q.key_top if q.key_split else 0)
        print(f"layer {l:3d}: {kb}-bit keys  copy NLL change ({args.estimate}) at 3 / 4 bits {err[l, 1]:+.4f} / {err[l, 2]:+.4f}")
    print(f"{args.out}: {artifact_bits_per_element(out):.3f} bits per element (memory accounting; "
          f"{artifact_bits_per_element(art):.3f} for {args.artifact})")
    return 0


def _register_run(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="the main job: calibrate -> fit -> validate -> report, resumable by stage",
                       description="The main job on the embedded defaults: calibrate (a local Ray cluster on "
                                   "127.0.0.1), fit the recipe behind oscar-int2, tune its key clips, run the needle "
                                   "tests, perplexity and attention-level retrieval, and write DIR/report.md and "
                                   "DIR/report.html. Re-running the same command skips finished stages and resumes "
                                   "inside calibrate, niah and ppl.")
    add_out(r, "run directory (everything the job writes; resumes what it holds)")
    r.add_argument("--no-ray", action="store_true", help="calibrate in this process instead of a local Ray cluster")
    add_model(r)
    r.add_argument("--samples", type=positive_int, default=None, help="NIAH samples per cell (default 20)")
    r.add_argument("--seq-len", "--calib-seq-len", dest="calib_seq_len", type=positive_int, default=None,
                   help="calibration sequence length, as `oscar calibrate --seq-len` (default: the longest context "
                        "validated, 4096: the fit sees every position it is judged on; --calib-seq-len: the older "
                        "spelling)")
    r.add_argument("--positions", "--calib-positions", dest="calib_positions", type=positive_int, default=None,
                   help="absolute positions the calibration covers, as `oscar calibrate --positions` (default: the "
                        "longest context validated); a shorter --seq-len is read at RoPE offsets up to it "
                        "(--calib-positions: the older spelling)")
    add_methods(r, "comma list of KV-cache methods to compare (default: %(default)s; also tq-int2, sq-int2, "
                   "kivi2-clip, hadamard-clip-int2: validate/methods.py)")
    r.add_argument("--full", action="store_true", help="larger perplexity budget (12288 held-out tokens per context, all the pydoc held-out split holds "
                        "at 4k: 12 windows at 1k, 3 at 4k; default 8192; slower)")
    r.add_argument("--variant", default=None, help="fit variant behind oscar-int2 (see `oscar variants`; default scaled, "
                   "split with --widths none)")
    r.add_argument("--widths", default="gradient", choices=("none", "copy", "gradient"),
                   help="per-layer key widths, chosen after the tune by the NLL of spans copied from the INT2 "
                        "history of calibration text with one layer's keys at 3 / 4 bits, served as a per-layer "
                        "artifact at the same bits: gradient = that NLL change to first order (default; ~2.5 min for "
                        "SmolLM2 on 2 CPUs); copy = measured layer by layer (`oscar validate widths`, ~35 min); none = "
                        "the tuned fit (split keys)")
    r.add_argument("--no-tune", action="store_true", help="keep the fit's key clips (skip `oscar validate tune`)")
    r.add_argument("--tune-objective", default="nll", choices=TUNE_OBJECTIVES,
                   help="what the key-clip tune minimises (`oscar validate tune --objective`; default %(default)s)")
    r.add_argument("--tasks", default="niah_single_1,niah_single_2",
                   help="RULER tasks of the needle stage (`oscar validate niah --tasks`): a comma list, or 'all' "
                        "(every task the inputs allow: qa_1 / qa_2 only with --squad / --hotpotqa; the others skipped "
                        "are named on stderr and in the report)")

    _qa_args(r)
    r.add_argument("--niah-protocol", default="serving", choices=("serving", "strict"),
                   help="cache protocol of the needle stage (`oscar validate niah --protocol`; named for its stage "
                        "because perplexity always reports both)")
    r.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="model compute dtype for NIAH, perplexity and the attention capture: auto (default: bfloat16 "
                        "on CUDA and on CPUs that multiply it natively, AVX-512 BF16 or AMX; float32 on other CPUs, "
                        "where bfloat16 runs ~6x slower), bfloat16 (serving precision) or float32 (steadier digits)")
    add_device(r)
    r.add_argument("--engine", default=DEFAULT_ENGINE, choices=ENGINES,
                   help=ENGINE_HELP + "; for the tune, needle, perplexity and attention stages")
    r.add_argument("--no-progress", action="store_true", help="no progress bars (ours, transformers' and Ray's); "
                   "stage lines are still printed")
    r.set_defaults(func=_run)


def _run(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.run import RunConfig, run_main
    from oscar.validate.methods import parse_methods

    run_main(RunConfig(out=args.out, ray=not args.no_ray, model=args.model, samples=args.samples, full=args.full,
                       seq_len=args.calib_seq_len, positions=args.calib_positions,
                       methods=parse_methods(args.methods), tasks=[t.strip() for t in args.tasks.split(",") if t.strip()],
                       squad=args.squad, hotpotqa=args.hotpotqa,
                       variant=args.variant, widths=args.widths, tune=not args.no_tune, tune_objective=args.tune_objective, niah_protocol=args.niah_protocol, dtype=args.dtype,
                       engine=args.engine, device=args.device, progress=not args.no_progress))
    return 0


def _register_ablate(sub) -> None:
    p = sub.add_parser("ablate", help="controlled ablation: synthetic/real regimes x KV schemes x budgets, KS tests, report",
                       description="Run seed 004's controlled ablation; re-running the same command resumes.")
    add_out(p, "output directory (ablation.parquet, ks.parquet, report.md, plots)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_const", const="quick", dest="preset", help="CI size (< 3 min on 2 cores); default: the full preset")
    g.add_argument("--smoke", action="store_const", const="smoke", dest="preset", help="tiny, for tests")
    p.add_argument("--seeds", type=positive_int, help="seeds per regime (default 30)")
    p.add_argument("--regimes", nargs="+", help="subset of regimes (default: all of the preset)")
    p.add_argument("--schemes", nargs="+", help="subset of schemes (default: all of the preset)")
    p.add_argument("--bits", nargs="+", type=positive_int, help="budgets among 2 3 4 (default: the preset's)")
    p.add_argument("--nu", type=positive_float, help="Student-t degrees of freedom of the heavy regime (default 3)")
    p.add_argument("--store", help="calibration store (oscar-calib/2 or /1) for the real regime (default: no real regime)")
    p.add_argument("--layer", type=nonneg_int, help="store layer for the real regime (default: middle)")
    p.add_argument("--head", type=nonneg_int, default=0, help="KV head for the real regime")
    p.add_argument("--triton-seeds", type=nonneg_int, help="also run N seeds of plain/oscar on isotropic/heavy through the "
                   "serving cache's Triton quantizer (CPU interpreter: slow; default: none)")
    p.add_argument("--correction", choices=["holm", "bh"], default="holm", help="multiple-testing control")
    p.add_argument("--no-report", action="store_true", help="write the tables only, no report.md / plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_ablate, preset="full")


def _ablate(args: argparse.Namespace) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.reports.ablation import build_report
    from oscar.validate.ablation.ablate import AblationConfig, run_ablation
    from oscar.validate.ablation.regimes import RegimeConfig

    if args.store and not os.path.exists(args.store):
        raise OscarError(f"--store {args.store}: no such path")
    data = RegimeConfig()
    over = {k: v for k, v in dict(nu=args.nu, store=args.store, layer=args.layer, head=args.head).items() if v is not None}
    data = dataclasses.replace(data, **over)
    kw = {k: v for k, v in dict(seeds=args.seeds, regimes=args.regimes, schemes=args.schemes, bits=args.bits,
                                triton_seeds=args.triton_seeds).items() if v}
    cfg = AblationConfig.preset(args.preset, args.out, data=data, correction=args.correction,
                                progress=not args.no_progress, **kw)
    paths = run_ablation(cfg)
    if not args.no_report:
        paths["report"] = build_report(cfg.out)
    for k, v in paths.items():
        print(f"{k}: {v}")
    return 0
