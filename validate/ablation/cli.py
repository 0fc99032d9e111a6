"""`oscar ablate`: CLI registration (thin; the work is in oscar.validate.ablation.ablate)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("ablate", help="controlled ablation: synthetic/real regimes x KV schemes x budgets, KS tests, report",
                       description="Run seed 004's controlled ablation; re-running the same command resumes.")
    p.add_argument("--out", required=True, help="output directory (ablation.parquet, ks.parquet, report.md, plots)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_const", const="quick", dest="preset", help="CI size (< 3 min on 2 cores); default: the full preset")
    g.add_argument("--smoke", action="store_const", const="smoke", dest="preset", help="tiny, for tests")
    p.add_argument("--seeds", type=int, help="seeds per regime (default 30)")
    p.add_argument("--regimes", nargs="+", help="subset of regimes (default: all of the preset)")
    p.add_argument("--schemes", nargs="+", help="subset of schemes (default: all of the preset)")
    p.add_argument("--bits", nargs="+", type=int, help="budgets among 2 3 4 (default: the preset's)")
    p.add_argument("--nu", type=float, help="Student-t degrees of freedom of the heavy regime (default 3)")
    p.add_argument("--store", help="calibration store (oscar-calib/2 or /1) for the real regime (default: no real regime)")
    p.add_argument("--layer", type=int, help="store layer for the real regime (default: middle)")
    p.add_argument("--head", type=int, default=0, help="KV head for the real regime")
    p.add_argument("--triton-seeds", type=int, help="also run N seeds of plain/oscar on isotropic/heavy through the "
                   "serving cache's Triton quantizer (CPU interpreter: slow; default: none)")
    p.add_argument("--correction", choices=["holm", "bh"], default="holm", help="multiple-testing control")
    p.add_argument("--no-report", action="store_true", help="write the tables only, no report.md / plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=handler, preset="full")


def handler(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from oscar.common import OscarError
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
                                report=not args.no_report, progress=not args.no_progress, **kw)
    paths = run_ablation(cfg)
    for k, v in paths.items():
        print(f"{k}: {v}")
    return 0
