"""The candidates' A/B table: the candidate key formats (CANDIDATES) against oscar-int2 and bf16, from the outputs of
`oscar validate niah` (one or more needle seeds, pooled) / `oscar validate ppl` (and optionally `oscar validate attention`, `oscar ablate`).

Every comparison is paired (the same needle samples, the same perplexity windows / segments) with its 95 %
interval from validate/evidence.py; a difference whose interval straddles 0 (needles) or 1 (perplexity
ratios) is UNRESOLVED.

    python lab/candidates_ab.py --niah runs/i16/niah [runs/i16/niah_seed1 ...] --ppl runs/i16/ppl [--attention runs/i16/attn]
        [--ablation runs/i16/ablate] --out lab/results/ab_smollm2.json

The commands that produce the inputs are in docs/decisions/README.md ("Issue 16 A/B").
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from oscar.validate import evidence as ev

BASE = "oscar-int2"
CANDIDATES = ("oscar-lm-int2", "oscar-sparse-int2", "oscar-mix-int2", "oscar-layer-int2", "oscar-mix-layer-int2",
              "oscar-tier-int2", "oscar-layer-top1-int2", "oscar-mix-layer-top1-int2",
              # --rename labels of oscar-int2 fitted or tuned otherwise (lab/calib_length.sh)
              "oscar-c4k-int2", "oscar-c8k-int2", "oscar-guarded-int2", "oscar-p4k-int2", "oscar-c4ks-int2",
              "oscar-scaled-int2", "oscar-unclip-int2", "oscar-layer-copy-int2", "oscar-layer-copy-2x1024")
HIGHER_BETTER = {"topk", "cos_k", "cos_v", "cos_o"}  # ablation metrics where larger is better (the rest: errors)


def _verdict_diff(lo: float, hi: float) -> str:
    return "better" if lo > 0 else "worse" if hi < 0 else "UNRESOLVED"


def _verdict_ratio(lo: float, hi: float) -> str:  # ppl(a) / ppl(b): below 1 is better
    return "better" if hi < 1 else "worse" if lo > 1 else "UNRESOLVED"


RENAME: dict[tuple[str, str], str] = {}  # (directory, method) -> the name it is compared under (--rename)


def _name(d: str, m: str) -> str:
    return RENAME.get((os.path.normpath(d), m), m)


def _seed_dirs(dirs: list[str]) -> dict[str, int]:
    """Directories of one needle seed pool together: a sample is (seed, index), so the runs of two artifacts on the
    same samples (`oscar validate niah` is deterministic in its config and seed) pair with each other."""
    out = {}
    for d in dirs:
        p = os.path.join(d, "niah_config.json")
        out[d] = int(json.load(open(p))["config"].get("seed", 0)) if os.path.exists(p) else len(out) + 1000
    return out


def niah_table(dirs: list[str]) -> list[dict]:
    """Pooled over the output directories (e.g. needle seeds): a sample is (seed, index), paired across methods and
    across directories of the same seed (the same samples; a method present in two of them: the later wins)."""
    done = {}
    seeds = _seed_dirs(dirs)
    for d in dirs:
        for (t, L, i, m), r in ev.read_samples(os.path.join(d, "niah_samples.jsonl")).items():
            done[(t, L, (seeds[d], i), _name(d, m))] = r
    cells = ev.cell_scores(done)
    tasks = sorted({t for t, _, _ in cells})
    lengths = sorted({L for _, L, _ in cells})
    methods = sorted({m for _, _, m in cells})
    rows = []
    # one row per length and task (and the tasks pooled), then each over every length measured ("all"): a pair is
    # one sample of one cell, so pooling over cells keeps the pairing
    for L in [*lengths, "all"]:
        ll = lengths if L == "all" else [L]
        for t in [*tasks, "pooled"]:
            tt = tasks if t == "pooled" else [t]
            for m in methods:
                x = np.concatenate([np.array(list(cells.get((u, l, m), {}).values())) for u in tt for l in ll])
                if not len(x):
                    continue
                lo, hi, how = ev.score_interval(x)
                r = {"task": t, "length": L, "method": m, "samples": len(x), "score": 100 * float(x.mean()),
                     "ci_low": lo, "ci_high": hi}
                for base in ("bf16", BASE):
                    if m == base or m == "bf16":
                        continue
                    pa = [ev.paired_arrays(cells, u, l, m, base) for u in tt for l in ll]
                    xa = np.concatenate([a for a, _ in pa])
                    xb = np.concatenate([b for _, b in pa])
                    if len(xa):
                        dd, dlo, dhi = ev.paired_diff(xa, xb)
                        r[f"vs_{base}"] = {"diff": dd, "lo": dlo, "hi": dhi, "paired": len(xa),
                                           "verdict": _verdict_diff(dlo, dhi)}
                rows.append(r)
    return rows


def ppl_table(dirs: list[str]) -> list[dict]:
    """Windows of one or more `oscar validate ppl` runs with the same config (the same windows): a method present in
    two of them is taken from the first."""
    d = dirs[0]
    cfg = json.load(open(os.path.join(d, "ppl_config.json"))) if os.path.exists(os.path.join(d, "ppl_config.json")) else {}
    windows, seen = [], set()
    for dd in dirs:
        got = [{**w, "method": _name(dd, w["method"])} for w in ev.read_windows(os.path.join(dd, "ppl_windows.jsonl"))]
        windows += [w for w in got if w["method"] not in seen]
        seen |= {w["method"] for w in got}
    idx = ev._index(windows)
    methods = sorted({w["method"] for w in windows})
    protocols = sorted({w["protocol"] for w in windows if w["method"] != "bf16"})
    contexts = sorted({w["context"] for w in windows})
    tokens = (cfg.get("config") or {}).get("tokens") or max(
        (w["window"] + 1) * w["context"] for w in windows)
    rows = []
    for st in ev.ppl_stats(windows, methods, protocols, contexts, tokens):
        m, p, c = st["method"], st["protocol"], st["context"]
        r = {k: st[k] for k in ("method", "protocol", "context", "ppl", "ppl_ci_low", "ppl_ci_high", "windows", "blocks",
                                "block")}
        if m != "bf16":
            r["vs_bf16"] = {"ratio": st["ratio"], "lo": st["ratio_ci_low"], "hi": st["ratio_ci_high"],
                            "verdict": _verdict_ratio(st["ratio_ci_low"], st["ratio_ci_high"])}
        if m not in ("bf16", BASE) and BASE in methods:
            (ba, bb), unit, _ = ev.blocks(idx, [(m, ev.proto_key(m, p)), (BASE, ev.proto_key(BASE, p))], c, tokens // c)
            q, lo, hi, n = ev.ratio_of(ba, bb)
            r[f"vs_{BASE}"] = {"ratio": q, "lo": lo, "hi": hi, "blocks": n, "block": unit, "verdict": _verdict_ratio(lo, hi)}
        rows.append(r)
    return rows


def memory(d: str) -> dict:
    p = os.path.join(d, "memory.json")
    return {r["method"]: r["bits_per_element"] for r in json.load(open(p))} if os.path.exists(p) else {}


def attention_table(d: str) -> list[dict]:
    """Per (method, length): top-1 kept (%), mean output error, mean needle weight INT2 / exact; the top-1
    difference to oscar-int2 paired by trial (layer, query head, window) with its interval (trials share
    windows across heads and layers, so the interval is narrower than independent samples would give)."""
    p = os.path.join(d, "attention.parquet")
    if not os.path.exists(p):
        return []
    import pandas as pd

    df = pd.read_parquet(p)
    df["needle_weight_ratio"] = df.needle_weight_int2 / df.needle_weight
    key = ["layer", "q_head", "window"]
    out = []
    for (m, L), g in df.groupby(["method", "length"]):
        r = {"method": m, "length": int(L), "trials": len(g), "top1": 100 * float(g.top1.mean()),
             "out_rel_err": float(g.out_rel_err.mean()), "needle_weight_ratio": float(g.needle_weight_ratio.mean())}
        b = df[(df.method == BASE) & (df.length == L)]
        if m != BASE and len(b):
            j = g.merge(b, on=key, suffixes=("", "_b"))
            dd, lo, hi = ev.paired_diff(j.top1.to_numpy(), j.top1_b.to_numpy())
            r[f"vs_{BASE}"] = {"diff": dd, "lo": lo, "hi": hi, "paired": len(j), "verdict": _verdict_diff(lo, hi)}
        out.append(r)
    return out


def ablation_table(d: str) -> list[dict]:
    p = os.path.join(d, "ks.parquet")
    if not os.path.exists(p):
        return []
    import pandas as pd

    ks = pd.read_parquet(p)
    return json.loads(ks.to_json(orient="records"))


def markdown(res: dict) -> str:
    tasks = "/".join(sorted({r["task"] for r in res["niah"] if r["task"] != "pooled"}))
    cols = res["lengths"] + (["all"] if len(res["lengths"]) > 1 else [])
    lines = [f"| needles (pooled {tasks}), % | bits | " + " | ".join(
        "all lengths" if L == "all" else f"{L // 1024}k" for L in cols) + " |", "|---|---|" + "---|" * len(cols)]
    pooled = [r for r in res["niah"] if r["task"] == "pooled"]
    for m in res["methods"]:
        cells = []
        for L in cols:
            r = next((r for r in pooled if r["method"] == m and r["length"] == L), None)
            if r is None:
                cells.append("–")
                continue
            s = f"{r['score']:.1f} [{r['ci_low']:.0f}–{r['ci_high']:.0f}]"
            for base in ("bf16", BASE):
                v = r.get(f"vs_{base}")
                if v:
                    s += f"; vs {base} {v['diff']:+.1f} [{v['lo']:+.0f}, {v['hi']:+.0f}]" + (
                        f" {v['verdict']}" if base == BASE else "")
            cells.append(s)
        lines.append(f"| {m} | {res['bits'].get(m, float('nan')):.3g} | " + " | ".join(cells) + " |")
    if res["ppl"]:
        lines += ["", f"| perplexity | protocol | context | × bf16 [95 %] | × {BASE} [95 %] |", "|---|---|---|---|---|"]
    for r in res["ppl"]:
        if r["method"] == "bf16":
            continue
        a = r.get("vs_bf16", {})
        b = r.get(f"vs_{BASE}")
        lines.append(f"| {r['method']} | {r['protocol']} | {r['context']} | {a.get('ratio', float('nan')):.3f} "
                     f"[{a.get('lo', float('nan')):.3f}–{a.get('hi', float('nan')):.3f}] | "
                     + (f"{b['ratio']:.3f} [{b['lo']:.3f}–{b['hi']:.3f}] {b['verdict']}" if b else "–") + " |")
    if res["attention"]:
        lines += ["", f"| attention level | length | trials | top-1 kept, % | vs {BASE} (paired) | needle weight INT2/exact | out rel err |",
                  "|---|---|---|---|---|---|---|"]
        for r in res["attention"]:
            v = r.get(f"vs_{BASE}")
            lines.append(f"| {r['method']} | {r['length']} | {r['trials']} | {r['top1']:.1f} | "
                         + (f"{v['diff']:+.1f} [{v['lo']:+.1f}, {v['hi']:+.1f}] {v['verdict']}" if v else "–")
                         + f" | {r['needle_weight_ratio']:.3f} | {r['out_rel_err']:.4f} |")
    ks = [r for r in res["ablation_ks"] if r["kind"] == "scheme"]
    if ks:
        lines += ["", "| ablation pair (production path, KS over seeds, Holm) | bits | metric | regimes: systematic better / "
                  "systematic worse / seed variance |", "|---|---|---|---|"]
        groups: dict = {}
        for r in ks:
            better = r["mean_a"] > r["mean_b"] if r["metric"] in HIGHER_BETTER else r["mean_a"] < r["mean_b"]
            c = groups.setdefault((f"{r['a']} vs {r['b']}", r["bits"], r["metric"]), [[], [], []])
            c[2 if r["verdict"] != "systematic" else 0 if better else 1].append(r["regime"])
        for (pair, bits, met), (b, w, n) in sorted(groups.items()):
            lines.append(f"| {pair} | {bits} | {met} | {len(b)} ({', '.join(b) or '-'}) / {len(w)} ({', '.join(w) or '-'}) / {len(n)} |")
        path = [r for r in res["ablation_ks"] if r["kind"] == "path"]
        sysm = [f"{r['a']} {r['regime']} {r['bits']} {r['metric']}" for r in path if r["verdict"] == "systematic"]
        lines += ["", f"oracle vs production (KS, Holm over {len(path)} tests): {len(sysm)} systematic"
                  + (": " + "; ".join(sysm) if sysm else "")]
    return "\n".join(lines)


def table_methods(niah: list[dict]) -> list[str]:
    """The rows of the needle table: bf16, the base, oscar-int2 and the known candidates in that order, then every
    other method the runs hold (a --rename label) in the order met."""
    seen = list(dict.fromkeys(r["method"] for r in niah))
    return [m for m in dict.fromkeys(("bf16", BASE, "oscar-int2", *CANDIDATES, *seen)) if m in seen]


def main(argv=None) -> int:
    global BASE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--niah", nargs="+", help="output directories of `oscar validate niah` (pooled)")
    ap.add_argument("--render", metavar="JSON", help="rewrite JSON's table rows and its .md from its records (no runs read)")
    ap.add_argument("--ppl", nargs="+", help="output directories of `oscar validate ppl` (the same windows)")
    ap.add_argument("--rename", nargs="*", default=[], metavar="DIR:METHOD=NAME",
                    help="compare METHOD of the run in DIR as NAME (two artifacts run as oscar-int2)")
    ap.add_argument("--attention", help="output directory of `oscar validate attention`")
    ap.add_argument("--ablation", help="output directory of `oscar ablate`")
    ap.add_argument("--base", default=BASE, help="the method every candidate is paired against (default: %(default)s)")
    ap.add_argument("--out", help="JSON written here (and the markdown table next to it, .md)")
    a = ap.parse_args(argv)
    BASE = a.base
    if a.render:  # a table written before its --rename labels were listed: its rows from the JSON's own records
        res = json.load(open(a.render))
        BASE = res["base"]
        res["methods"] = table_methods(res["niah"])
        with open(a.render, "w") as f:
            json.dump(res, f, indent=1, default=float)
        with open(os.path.splitext(a.render)[0] + ".md", "w") as f:
            f.write(markdown(res) + "\n")
        return 0
    if not (a.niah and a.out):
        ap.error("--niah and --out are required (or --render JSON)")
    for r in a.rename:
        d, rest = r.rsplit(":", 1)
        m, new = rest.split("=", 1)
        RENAME[(os.path.normpath(d), m)] = new
    niah = niah_table(a.niah)
    res = {"niah": niah, "ppl": ppl_table(a.ppl) if a.ppl else [],
           "attention": attention_table(a.attention) if a.attention else [],
           "ablation_ks": ablation_table(a.ablation) if a.ablation else [],
           "bits": {**{_name(d, k): v for d in a.niah for k, v in memory(d).items()},
                    **({_name(d, k): v for d in a.ppl for k, v in memory(d).items()} if a.ppl else {})},
           "rename": a.rename,
           "lengths": sorted({r["length"] for r in niah if r["length"] != "all"}),
           "methods": table_methods(niah),
           "base": BASE,
           "inputs": {"niah": a.niah, "ppl": a.ppl, "attention": a.attention, "ablation": a.ablation}}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=float)
    md = markdown(res)
    with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
