"""`oscar report DIR`: Markdown + self-contained HTML from a run's result files."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="Markdown + self-contained HTML report of a results directory",
                       description="Build DIR/report.md and DIR/report.html from the result files a run wrote.")
    p.add_argument("dir", help="directory with results.parquet / ppl.parquet / memory.json / calibration/ / ablation/")
    p.add_argument("--title", default="oscar-kv validation report", help="report title (default: %(default)s)")
    p.add_argument("--readme", metavar="README",
                   help="also rewrite the generated results block of this Markdown file (e.g. README.md) from DIR "
                        "(default: not done)")
    p.set_defaults(func=_report)


def _report(args) -> int:
    # late: keeps scipy (1.3 s) out of `oscar --help`
    from oscar.reports.build import build_report

    r = build_report(args.dir, title=args.title)
    print(f"wrote {r.md_path} and {r.html_path}")
    if args.readme:
        # late: keeps scipy (1.3 s) out of `oscar --help`
        from oscar.reports.readme import rewrite_readme

        changed = rewrite_readme(args.readme, args.dir, f"oscar report {args.dir} --readme {args.readme}")
        print(f"{args.readme}: generated block {'rewritten' if changed else 'unchanged'}")
    return 0
