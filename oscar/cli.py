"""The commands that compose stages with reports: `oscar run` (the main job, oscar/run.py) and `oscar ablate`
(the synthetic ablation, oscar.validate.ablation, then its report); and the handler of `oscar fit`, whose recipe
(oscar/recipe/driver.py) reads the model through the INT2 cache. Like oscar/run.py this may import every stage."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys

from oscar.cli_options import (DEFAULT_ENGINE, ENGINE_HELP, ENGINES, add_device, add_methods, add_model, add_out,
                                add_recipe, add_stages)
from oscar.defaults import DEMO_SIZES as DEMO, FULL_SIZES as FULL
from oscar.common import (OscarError, length_list, nonneg_int, positional_or_option, positive_float, positive_int,
                          token_count)
from oscar.validate.cli import _qa_args


def register(sub: argparse._SubParsersAction) -> None:
    _register_run(sub)
    _register_ablate(sub)
    _attach_fit_recipe(sub)


def _attach_fit_recipe(sub: argparse._SubParsersAction) -> None:
    """`oscar fit` makes the shipped recipe: the fit (stats/), then the tune and the widths, which read the model
    through the INT2 cache (oscar/recipe/driver.py). Its parser is the fit stage's (stats/cli.py), its handler lives here,
    beside the main job, since stats/ imports no later stage."""
    p = sub.choices.get("fit")
    if p is not None:
        p.set_defaults(func=_fit)


def _fit(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.stats.cli import fit_command, fit_config, is_latent_store

    if args.stages and not args.ray:
        raise OscarError("--stages needs --ray ADDRESS|auto")
    if args.no_tune and args.widths == "none":  # the plain fit: no model read
        return fit_command(args)
    if is_latent_store(positional_or_option(args, "store", "--store")):
        if args.widths != "none":
            raise OscarError("oscar fit: a latent store (MLA model): its cache has one format, no per-layer widths; "
                             "pass --widths none (the clip tune runs unless --no-tune)")
        return _fit_latent_tuned(args)
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.cluster.pipeline import ClusterConfig
    from oscar.cluster.scoring import StagedScorer
    from oscar.kernels.memory import artifact_bits_per_element
    from oscar.recipe.driver import RecipeConfig, RecipePaths, Stages, check_staged_widths, run_recipe, store_inputs
    from oscar.recipe.tune import TuneConfig
    from oscar.stats.artifact import load_artifact
    from oscar.scoring.engine import check_engine, resolve_device
    from oscar.validate.env import load_model

    store = positional_or_option(args, "store", "--store")
    if args.variant == "split":
        raise OscarError(f"oscar fit: --widths {args.widths} and the tune work on a one-group fit; --variant split "
                         "already splits the keys (pass --no-tune --widths none for the split fit alone)")
    if args.ray:
        check_staged_widths(args.widths)
    fcfg = fit_config(args)
    check_engine(args.engine)
    resolve_device(args.device)  # before loading weights
    name, corpus, fp_cal = store_inputs(store)  # an unreadable store is refused before any model is loaded
    rcfg = RecipeConfig(tune=not args.no_tune, objective=args.tune_objective, widths=args.widths, corpus=corpus,
                        engine=args.engine, device=args.device, progress=not args.no_progress)
    stem = args.out[:-len(".safetensors")] if args.out.endswith(".safetensors") else args.out
    work = stem + ".recipe"  # the steps' artifacts, markers and logs: a rerun resumes from them
    os.makedirs(work, exist_ok=True)
    paths = RecipePaths(fit=os.path.join(work, "fit.safetensors"),
                        tuned=os.path.join(work, "tuned.safetensors") if args.widths != "none" else args.out,
                        out=args.out, logs=work)
    loaded: list = []

    def model():
        if not loaded:
            loaded.append(load_model(args.model or name))
        return loaded[0]

    if args.ray:  # the tune's windows and the widths' gradient on the stage actors; nothing here holds weights
        cc = ClusterConfig(stages=args.stages or 1, cpus_per_stage=args.cpus_per_stage, dtype=TuneConfig().dtype)
        with StagedScorer(args.model or name, cc, address=args.ray) as sc:
            run_recipe(store, paths, fcfg, rcfg, Stages(work), fp_cal, model, scorer=sc)
    else:
        run_recipe(store, paths, fcfg, rcfg, Stages(work), fp_cal, model)
    art = load_artifact(args.out)
    tuning = art.meta.get("clip_tuning") or {}
    print(f"{args.out}: variant {art.meta['variant']}, {art.num_layers} layers x {art.num_kv_heads} KV heads x D "
          f"{art.head_dim}" + (f", key clips x{tuning['chosen_factor']}" if tuning else "") +
          f", {artifact_bits_per_element(art):.3f} bits per element (steps in {work})")
    return 0


def _fit_latent_tuned(args) -> int:
    """`oscar fit LATENT_STORE --widths none`: the latent fit, then its clip tune (one factor on every group's clip,
    by the strict NLL of calibration text read through the latent cache), in one process or on the stages."""
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.cluster.pipeline import ClusterConfig
    from oscar.cluster.scoring import StagedScorer
    from oscar.recipe.driver import store_inputs
    from oscar.recipe.tune import TuneConfig, tune_key_clip
    from oscar.scoring.engine import check_engine, resolve_device
    from oscar.stats.artifact import save_latent_artifact
    from oscar.stats.cli import latent_fit, latent_line
    from oscar.validate.env import load_model

    store = positional_or_option(args, "store", "--store")
    check_engine(args.engine)
    resolve_device(args.device)  # before loading weights
    name, corpus, _ = store_inputs(store)
    tcfg = TuneConfig(corpus=corpus, objective=args.tune_objective)
    if tcfg.objective != "nll" or args.engine != "simulate":
        raise OscarError(f"oscar fit: a latent store's tune reads the strict NLL through the latent cache's simulator: "
                         f"--tune-objective nll --engine simulate (got {args.tune_objective}, {args.engine})")
    art = latent_fit(args, store)
    if args.ray:
        cc = ClusterConfig(stages=args.stages or 1, cpus_per_stage=args.cpus_per_stage, dtype=tcfg.dtype)
        with StagedScorer(args.model or name, cc, address=args.ray) as sc:
            tuned, _ = tune_key_clip(None, None, art, tcfg, scorer=sc)
    else:
        model, tok, _ = load_model(args.model or name, latent=True)
        tuned, _ = tune_key_clip(model, tok, art, tcfg, progress=not args.no_progress, device=args.device)
    save_latent_artifact(tuned, args.out)
    print(latent_line(args.out, tuned))
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
    r.add_argument("--samples", type=positive_int, default=None, help=f"NIAH samples per cell (default {DEMO['samples']}; --full: {FULL['samples']})")
    r.add_argument("--lengths", type=length_list, default=None,
                   help=f"needle haystack lengths, e.g. 1k,2k,4k,8k (default {_lengths(DEMO)}; --full: {_lengths(FULL)})")
    r.add_argument("--long-lengths", type=length_list, default=None,
                   help="the long end: needle cells at these lengths too (e.g. 16k,32k), for the first task only, bf16 "
                        "and oscar-int2, --long-samples each; the calibration positions cover them (one artifact); default: none")
    r.add_argument("--long-samples", type=positive_int, default=5, help="samples per long-end cell (default 5)")
    r.add_argument("--ppl-contexts", type=length_list, default=None,
                   help=f"perplexity context lengths (default {_lengths(DEMO, 'ppl_contexts')}; --full: "
                        f"{_lengths(FULL, 'ppl_contexts')})")
    r.add_argument("--ppl-tokens", type=token_count, default=None,
                   help=f"held-out tokens scored per perplexity context, as `oscar validate ppl --tokens`: windows = "
                        f"tokens // context (default {DEMO['ppl_tokens']}; --full: {FULL['ppl_tokens']}; past the "
                        "held-out split the text continues with the standard library's docstrings)")
    r.add_argument("--attn-lengths", type=length_list, default=None,
                   help=f"lengths of the attention-level test (default {_lengths(DEMO, 'attn_lengths')}; --full: "
                        f"{_lengths(FULL, 'attn_lengths')})")
    r.add_argument("--seq-len", "--calib-seq-len", dest="calib_seq_len", type=token_count, default=None,
                   help="calibration sequence length, as `oscar calibrate --seq-len` (default: the longest context "
                        "validated, 4096: the fit sees every position it is judged on; --calib-seq-len: the older "
                        "spelling)")
    r.add_argument("--calib-tokens", type=positive_int, default=None,
                   help=f"calibration tokens, as `oscar calibrate --tokens` (default {DEMO['calib_tokens']}; --full: "
                        f"{FULL['calib_tokens']}; the pydoc calibration split holds ~90k)")
    r.add_argument("--positions", "--calib-positions", dest="calib_positions", type=token_count, default=None,
                   help="absolute positions the calibration covers, as `oscar calibrate --positions` (default: the "
                        "longest context validated); a shorter --seq-len is read at RoPE offsets up to it "
                        "(--calib-positions: the older spelling)")
    add_methods(r, f"comma list of KV-cache methods to compare (default: {','.join(DEMO['methods'])}; --full: "
                   f"{','.join(FULL['methods'])}; also tq-int2, sq-int2, kivi2-clip, hadamard-clip-int2: "
                   "validate/methods.py; named ones the model cannot serve are refused before calibrating, while from the "
                   "sizes' list they are left out and said)", default=None)
    r.add_argument("--full", action="store_true",
                   help=f"the evidence sizes instead of the 15-minute defaults: {FULL['samples']} samples per needle "
                        f"cell at {_lengths(FULL)} (default {DEMO['samples']} at {_lengths(DEMO)}), "
                        f"{len(FULL['methods'])} methods (default {len(DEMO['methods'])}), perplexity at "
                        f"{_lengths(FULL, 'ppl_contexts')} with {FULL['ppl_tokens']} held-out tokens per context "
                        f"(default {_lengths(DEMO, 'ppl_contexts')}, {DEMO['ppl_tokens']}), the attention-level test at "
                        f"{_lengths(FULL, 'attn_lengths')} (default {_lengths(DEMO, 'attn_lengths')}), "
                        f"{FULL['calib_tokens']} calibration tokens (default {DEMO['calib_tokens']}); ~3.5x the time")
    r.add_argument("--variant", default=None, help="fit variant behind oscar-int2 (see `oscar variants`; default scaled, "
                   "split with --widths none)")
    add_recipe(r)
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
    add_stages(r, "run the tune, widths, needles and perplexity on this many pipeline stage actors on the local Ray "
                  "cluster, each holding a layer range as calibration's stages do (CPU, simulator; the attention-level "
                  "test is then not run); default 1: the model in this process")
    r.add_argument("--no-progress", action="store_true", help="no progress bars (ours, transformers' and Ray's); "
                   "stage lines are still printed")
    r.set_defaults(func=_run)


def _lengths(sizes: dict, key: str = "lengths") -> str:
    return ", ".join(f"{n // 1024}k" for n in sizes[key])


def run_config(args):
    """`oscar run`'s arguments as the RunConfig they ask for (sizes not given: None, filled by RunConfig)."""
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.run import RunConfig
    from oscar.validate.methods import parse_methods

    return RunConfig(out=args.out, ray=not args.no_ray, model=args.model, samples=args.samples, full=args.full,
                     calib_tokens=args.calib_tokens, seq_len=args.calib_seq_len, positions=args.calib_positions,
                     lengths=args.lengths, ppl_contexts=args.ppl_contexts, ppl_tokens=args.ppl_tokens,
                     attn_lengths=args.attn_lengths, long_lengths=args.long_lengths, long_samples=args.long_samples,
                     methods=parse_methods(args.methods) if args.methods else None, tasks=[t.strip() for t in args.tasks.split(",") if t.strip()],
                     squad=args.squad, hotpotqa=args.hotpotqa,
                     variant=args.variant, widths=args.widths, tune=not args.no_tune, tune_objective=args.tune_objective, niah_protocol=args.niah_protocol, dtype=args.dtype,
                     engine=args.engine, device=args.device, stages=args.stages, progress=not args.no_progress)


def _run(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.host import process_seconds
    from oscar.run import run_main

    # a kill (SIGTERM) unwinds like Ctrl-C: the step in progress records the time it spent before the next run resumes it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_main(run_config(args), elapsed=process_seconds)  # the report's time: the command's, from its process's start
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
