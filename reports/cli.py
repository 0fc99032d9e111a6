"""`oscar report DIR`: Markdown + self-contained HTML from a run's result files."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="Markdown + self-contained HTML report of a results directory",
                       description="Build DIR/report.md and DIR/report.html from the result files a run wrote.")
    p.add_argument("dir", help="directory with results.parquet / ppl.parquet / memory.json / calibration/ / ablation/")
    p.add_argument("--title", default="oscar-kv validation report", help="report title")
    p.set_defaults(func=_report)


def _report(args) -> int:
    from oscar.reports.build import build_report

    r = build_report(args.dir, title=args.title)
    print(f"wrote {r.md_path} and {r.html_path}")
    return 0
