"""What a committed example made by the main job must hold, as a list of problems (empty: it holds).

`example_problems(DIR, Sizes(...))` reads a run directory of `oscar run` and checks:
- every (task, length, method) needle cell has at least `samples` sample lines, the long-end cells `long_samples`,
  and every perplexity (method, protocol, context) at least `windows` windows;
- run.json's command is `oscar run` and every step's recorded command parses as a product command (the CLI's own
  parser), with its CPU seconds; the calibration's positions are at least `min_positions` and cover every length
  served, as the served artifact's provenance says; the needle and perplexity files name that artifact (one
  artifact per example);
- results.parquet's and ppl.parquet's figures and intervals recompute from the sample and window lines.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shlex
from collections import defaultdict
from dataclasses import dataclass, field

import pandas as pd

from oscar.__main__ import build_parser
from oscar.common import file_fingerprint
from oscar.validate.evidence import niah_stats, read_samples, read_windows, ppl_stats
from oscar.validate.intervals import wilson
from oscar.stats.artifact import calibrated_length, load_artifact

NIAH_COLUMNS = ("samples", "score", "ci_low", "ci_high", "diff_vs_bf16", "diff_ci_low", "diff_ci_high", "paired",
                "p_vs_bf16", "p_holm")
PPL_COLUMNS = ("ppl", "ppl_ci_low", "ppl_ci_high", "windows", "blocks", "ratio", "ratio_ci_low", "ratio_ci_high")


@dataclass
class Sizes:
    tasks: list[str]
    lengths: list[int]
    methods: list[str]
    samples: int = 20
    contexts: list[int] = field(default_factory=lambda: [1024, 4096, 8192])
    windows: int = 8
    min_positions: int = 8192
    long_task: str | None = None  # the long-end cells: one task, bf16 and oscar-int2 (those of `methods`)
    long_lengths: list[int] = field(default_factory=list)
    long_samples: int = 5


def _same(a, b) -> bool:
    a, b = float(a), float(b)
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def cell_problems(d: str, s: Sizes) -> list[str]:
    done = read_samples(os.path.join(d, "niah_samples.jsonl"))
    n = defaultdict(set)
    for (t, L, i, m) in done:
        n[(t, L, m)].add(i)
    out = [f"needle cell {t} {L} {m}: {len(n[(t, L, m)])} samples, fewer than {s.samples}"
           for t in s.tasks for L in s.lengths for m in s.methods if len(n[(t, L, m)]) < s.samples]
    out += [f"long-end cell {s.long_task} {L} {m}: {len(n[(s.long_task, L, m)])} samples, fewer than {s.long_samples}"
            for L in s.long_lengths for m in s.methods if m in ("bf16", "oscar-int2")
            and len(n[(s.long_task, L, m)]) < s.long_samples]
    wins = defaultdict(set)
    for w in read_windows(os.path.join(d, "ppl_windows.jsonl")):
        wins[(w["method"], w["protocol"], w["context"])].add(w["window"])
    for m in s.methods:
        for p in (["-"] if m == "bf16" else ["strict", "serving"]):
            out += [f"perplexity {m} {p} {c}: {len(wins[(m, p, c)])} windows, fewer than {s.windows}"
                    for c in s.contexts if len(wins[(m, p, c)]) < s.windows]
    return out


def run_json_problems(d: str, s: Sizes) -> list[str]:
    info = json.load(open(os.path.join(d, "run.json")))
    parser = build_parser()
    out = []
    cmd = info.get("command", "")
    if not cmd.startswith("oscar run "):
        out.append(f"run.json's command is not `oscar run`: {cmd!r}")
    steps = {st["stage"]: st for st in info.get("steps") or []}
    for need in ("calibrate", "fit", "tune", "widths", "niah", "ppl"):
        if need not in steps:
            out.append(f"run.json records no {need} step")
    args = {}
    for name, st in steps.items():
        words = shlex.split(st.get("command") or "")
        try:
            if words[:1] != ["oscar"]:
                raise SystemExit(2)
            with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage text: the problem says it
                args[name] = parser.parse_args(words[1:])
        except SystemExit:
            out.append(f"run.json's {name} step is not a product command: {st.get('command')!r}")
        if not isinstance(st.get("cpu_s"), (int, float)) or st["cpu_s"] <= 0:
            out.append(f"run.json's {name} step records no CPU seconds")
    served = max([*s.lengths, *s.contexts, *s.long_lengths])
    if "calibrate" in args:
        a = args["calibrate"]
        pos = a.positions or a.seq_len
        if not pos or pos < max(s.min_positions, served):
            out.append(f"calibration at positions {pos}: fewer than {max(s.min_positions, served)} (the longest served)")
    art_path = os.path.join(d, "artifact.safetensors")
    n = calibrated_length(load_artifact(art_path))
    if not n or n < served:
        out.append(f"the served artifact is calibrated to {n} positions, not the {served} served")
    fp = file_fingerprint(art_path)
    for f in ("niah_config.json", "ppl_config.json"):
        if json.load(open(os.path.join(d, f)))["identity"].get("artifact") != fp:
            out.append(f"{f} names another artifact than {art_path}")
    return out


def interval_problems(d: str) -> list[str]:
    done = read_samples(os.path.join(d, "niah_samples.jsonl"))
    res = pd.read_parquet(os.path.join(d, "results.parquet")).set_index(["task", "length", "method"])
    out = []
    rows = niah_stats(done)
    if len(rows) != len(res):
        out.append(f"results.parquet has {len(res)} cells, the sample lines {len(rows)}")
    for r in rows:
        key = (r["task"], r["length"], r["method"])
        if key not in res.index:
            out.append(f"results.parquet lacks the cell {key}")
            continue
        got = res.loc[key]
        bad = [c for c in NIAH_COLUMNS if not _same(got[c], r[c])]
        if got["ci_method"] == "wilson":  # the interval itself, not only the function that wrote it
            scores = [float(v["score"]) for k, v in done.items() if (k[0], k[1], k[3]) == key]
            lo, hi = wilson(sum(scores), len(scores))
            bad += [] if _same(got["ci_low"], 100 * lo) and _same(got["ci_high"], 100 * hi) else ["wilson"]
        if bad:
            out.append(f"results.parquet {key}: {', '.join(bad)} do not recompute from the sample lines")
    cfg = json.load(open(os.path.join(d, "ppl_config.json")))["config"]
    windows = read_windows(os.path.join(d, "ppl_windows.jsonl"))
    once = {w["method"] for w in windows if w["protocol"] == "-"}
    ppl = pd.read_parquet(os.path.join(d, "ppl.parquet")).set_index(["method", "protocol", "context"])
    for r in ppl_stats(windows, cfg["methods"], cfg["protocols"], cfg["contexts"], cfg["tokens"],
                       bf16_key=lambda m, p: "-" if m in once else p):
        key = (r["method"], r["protocol"], r["context"])
        bad = [c for c in PPL_COLUMNS if key not in ppl.index or not _same(ppl.loc[key][c], r[c])]
        if bad:
            out.append(f"ppl.parquet {key}: {', '.join(bad)} do not recompute from the window lines")
    return out


def example_problems(d: str, s: Sizes) -> list[str]:
    return cell_problems(d, s) + run_json_problems(d, s) + interval_problems(d)
