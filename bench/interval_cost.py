"""What the intervals cost: (1) the statistics (intervals, paired tests, verdicts) against the run time
of the main job; (2) perplexity over 8192 held-out tokens (8 windows at 1k) against 4096 (the previous
main-job default), measured in the same run on SmolLM2 in bfloat16 (methods without an artifact),
in the order 4096, 8192, 4096 (the ratio is to the mean of the two 4096 runs).

    python bench/interval_cost.py [--example reports/examples/smollm2] [--out bench/results/interval_cost.json]

(1) times every statistic the main job computes (validate/evidence.py: NIAH cell intervals + paired tests
+ Holm, perplexity block bootstrap, the product goal, the report's checks) on the committed example's
per-sample and per-window files, plus the same perplexity statistics on this run's 8192-token windows
scaled to the example's number of rows; the ratio is to the example's recorded run time (run.json) and
to this run's own perplexity stage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time


def _stats_seconds(d: str, reps: int = 3) -> dict:
    import pandas as pd

    from oscar.reports.build import acceptance, load_results
    from oscar.validate import evidence as ev

    t = {"niah": [], "ppl": [], "goal_and_checks": []}
    cfg = json.load(open(os.path.join(d, "ppl_config.json")))["config"]
    for _ in range(reps):
        a = time.perf_counter()
        done = ev.read_samples(os.path.join(d, "niah_samples.jsonl"))
        ev.niah_stats(done)
        b = time.perf_counter()
        wins = ev.read_windows(os.path.join(d, "ppl_windows.jsonl"))
        df = pd.DataFrame(ev.ppl_stats(wins, cfg["methods"], cfg["protocols"], cfg["contexts"], cfg["tokens"]))
        c = time.perf_counter()
        df["bits_per_element"] = 2.5
        ev.product_goal(df, wins, cfg["tokens"])
        R = load_results(d)
        acceptance(R.res, R.ppl, R.done, R.windows, R.tokens)
        e = time.perf_counter()
        t["niah"].append(b - a)
        t["ppl"].append(c - b)
        t["goal_and_checks"].append(e - c)
    return {k: min(v) for k, v in t.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--example", default="reports/examples/smollm2", help="committed example (default: %(default)s)")
    ap.add_argument("--methods", default="bf16,naive-int2,hadamard-int2",
                    help="perplexity methods timed (no artifact needed; default: %(default)s)")
    ap.add_argument("--out", default="bench/results/interval_cost.json", help="JSON written (default: %(default)s)")
    args = ap.parse_args()

    import pandas as pd

    from oscar.validate import evidence as ev
    from oscar.validate.env import load_model
    from oscar.validate.ppl import PplConfig, run_ppl

    loaded = load_model("smollm2-135m")
    methods = args.methods.split(",")
    ppl_s, rows8, runs = {}, None, []
    with tempfile.TemporaryDirectory() as tmp:
        for i, tokens in enumerate((4096, 8192, 4096)):  # A-B-A: the machine's load drifts between runs
            out = os.path.join(tmp, f"t{tokens}_{i}")
            t = time.perf_counter()
            df = run_ppl(PplConfig(out=out, methods=methods, contexts=[1024, 4096], tokens=tokens, dtype="bfloat16"),
                         loaded=loaded, progress=False)
            runs.append({"tokens": tokens, "seconds": time.perf_counter() - t, "loadavg": os.getloadavg()[0]})
            ppl_s.setdefault(tokens, []).append(runs[-1]["seconds"])
            if tokens == 8192:
                wins8 = ev.read_windows(os.path.join(out, "ppl_windows.jsonl"))
                rows8 = df
    ppl_s = {k: sum(v) / len(v) for k, v in ppl_s.items()}
    a = time.perf_counter()
    ev.ppl_stats(wins8, methods, ["strict", "serving"], [1024, 4096], 8192)
    ppl8_stats = time.perf_counter() - a
    ex = _stats_seconds(args.example)
    run = json.load(open(os.path.join(args.example, "run.json")))
    ex_rows = len(pd.read_parquet(os.path.join(args.example, "ppl.parquet")))
    stats_s = ex["niah"] + ex["goal_and_checks"] + ppl8_stats * ex_rows / max(1, len(rows8))
    res = {
        "command": f"python bench/interval_cost.py --methods {args.methods}",
        "host": f"{platform.node()} ({os.cpu_count()} CPUs)", "loadavg": os.getloadavg()[0],
        "ppl_seconds": {str(k): v for k, v in ppl_s.items()}, "ppl_runs": runs, "ppl_methods": methods,
        "ppl_8192_vs_4096": ppl_s[8192] / ppl_s[4096],
        "stats_seconds_example": ex, "ppl_stats_seconds_8192_this_run": ppl8_stats,
        "stats_seconds_main_job_estimate": stats_s,
        "example_run_seconds": run["total_seconds"],
        "stats_share_of_example_run": stats_s / run["total_seconds"],
        "stats_share_of_this_ppl_stage": ppl8_stats / ppl_s[8192],
        "target_share": 0.01,
        "met": stats_s / run["total_seconds"] < 0.01,
        "windows_8192": rows8[["method", "protocol", "context", "windows", "blocks", "block"]].to_dict("records"),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    json.dump(res, open(args.out, "w"), indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "windows_8192"}, indent=1))


if __name__ == "__main__":
    main()
