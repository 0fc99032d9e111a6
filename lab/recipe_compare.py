"""Two needle runs of one model side by side, cell by cell: each method's score and its paired gap to bf16 in its own
run (95 % intervals), per (task, length) and with the tasks pooled per length.

    git archive REV reports/examples/qwen2.5-0.5b | tar -x -C /tmp/old
    python lab/recipe_compare.py /tmp/old/reports/examples/qwen2.5-0.5b reports/examples/qwen2.5-0.5b \
        --labels "old recipe,shipped recipe" --method oscar-int2

The runs need not share samples: each gap is paired inside its own run.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from oscar.validate.evidence import cell_scores, paired_arrays, paired_diff, read_samples


def _gap(cells: dict, tasks: list[str], L: int, m: str) -> str:
    xs, ys = zip(*[paired_arrays(cells, t, L, m) for t in tasks]) if tasks else ((), ())
    x, y = np.concatenate(xs), np.concatenate(ys)
    if not len(x):
        return "—"
    d, lo, hi = paired_diff(x, y)
    return f"{100 * x.mean():.1f} ({d:+.1f} [{lo:+.1f}, {hi:+.1f}], n={len(x)})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs=2, help="two run directories holding niah_samples.jsonl")
    ap.add_argument("--labels", default="A,B", help="their names in the table (default A,B)")
    ap.add_argument("--method", default="oscar-int2", help="the method compared (default oscar-int2)")
    a = ap.parse_args(argv)
    labels = a.labels.split(",")
    cells = [cell_scores(read_samples(os.path.join(d, "niah_samples.jsonl"))) for d in a.runs]
    keys = sorted({(t, L) for c in cells for (t, L, m) in c if m == a.method}, key=lambda k: (k[1], k[0]))
    print(f"{a.method}: score % (gap to bf16 in points, paired in its own run [95 % interval], pairs)\n")
    print(f"| task | length | {' | '.join(labels)} |\n|---|---|" + "---|" * len(labels))
    for t, L in keys:
        print(f"| {t} | {L // 1024}k | " + " | ".join(_gap(c, [t], L, a.method) for c in cells) + " |")
    for L in sorted({L for _, L in keys}):
        tasks = sorted({t for t, LL in keys if LL == L})
        print(f"| pooled ({len(tasks)} task{'s' if len(tasks) > 1 else ''}) | {L // 1024}k | "
              + " | ".join(_gap(c, tasks, L, a.method) for c in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
