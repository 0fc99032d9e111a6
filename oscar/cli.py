"""`oscar run`, the main job's CLI (oscar/run.py); like oscar/run.py it may import every stage."""

from __future__ import annotations

import argparse

from oscar.defaults import EMBEDDED_MODEL
from oscar.validate import DEFAULT_METHODS as _DEFAULT_METHODS

DEFAULT_METHODS = ",".join(_DEFAULT_METHODS)


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="the main job: calibrate -> fit -> validate -> report, resumable by stage",
                       description="The main job on the embedded defaults: calibrate (a local Ray cluster on "
                                   "127.0.0.1), fit the recipe behind oscar-int2, tune its key clips, run the needle "
                                   "tests, perplexity and attention-level retrieval, and write DIR/report.md and "
                                   "DIR/report.html. Re-running the same command skips finished stages and resumes "
                                   "inside calibrate, niah and ppl.")
    r.add_argument("--out", required=True, help="run directory (everything the job writes; resumes what it holds)")
    r.add_argument("--no-ray", action="store_true", help="calibrate in this process instead of a local Ray cluster")
    r.add_argument("--model", default=EMBEDDED_MODEL, help="model preset, HF directory or .gguf file")
    r.add_argument("--samples", type=int, default=None, help="NIAH samples per cell (default 20)")
    r.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma list of KV-cache methods to compare (default: %(default)s; also tq-int2, sq-int2, "
                        "kivi2-clip, hadamard-clip-int2: validate/methods.py)")
    r.add_argument("--full", action="store_true", help="larger perplexity budget (12288 held-out tokens per context, all the pydoc held-out split holds "
                        "at 4k: 12 windows at 1k, 3 at 4k; default 8192; slower)")
    r.add_argument("--variant", default="scaled", help="fit variant behind oscar-int2 (see `oscar variants`)")
    r.add_argument("--no-tune", action="store_true", help="keep the fit's key clips (skip `oscar validate tune`)")
    r.add_argument("--niah-protocol", default="serving", choices=("serving", "strict"),
                   help="cache protocol of the needle stage (`oscar validate niah --protocol`; named for its stage "
                        "because perplexity always reports both)")
    r.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                   help="model compute dtype for NIAH and perplexity (default bfloat16: serving precision, fast on "
                        "CPUs with bf16 units; float32: steadier digits, ~1.7x slower)")
    from oscar.validate.engine import DEFAULT_DEVICE, DEFAULT_ENGINE, DEVICE_HELP, ENGINE_HELP, ENGINES

    r.add_argument("--device", default=DEFAULT_DEVICE, help=DEVICE_HELP)
    r.add_argument("--engine", default=DEFAULT_ENGINE, choices=ENGINES,
                   help=ENGINE_HELP + "; for the tune, needle, perplexity and attention stages")
    r.add_argument("--no-progress", action="store_true", help="no progress bars (ours, transformers' and Ray's); "
                   "stage lines are still printed")
    r.set_defaults(func=_run)


def _run(args) -> int:
    from oscar.run import RunConfig, run_main
    from oscar.validate.methods import parse_methods

    run_main(RunConfig(out=args.out, ray=not args.no_ray, model=args.model, samples=args.samples, full=args.full,
                       methods=parse_methods(args.methods),
                       variant=args.variant, tune=not args.no_tune, niah_protocol=args.niah_protocol, dtype=args.dtype,
                       engine=args.engine, device=args.device, progress=not args.no_progress))
    return 0
