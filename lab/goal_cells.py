"""The accuracy goal, checked cell by cell: oscar-int2 against bf16 on the goal's grid, with the verdict rule of the
evidence issue (validate/intervals.py: PASS when every cell's 95 % interval clears the limit, MISSED when one cell's
interval at level 1 - 0.05/m lies beyond it, else UNRESOLVED, with the samples that would resolve it).

    qwen2.5-0.5b: needles within 2 points of bf16 at 1k-16k on niah_single_1/2/3 + niah_multikey_1 (the paired
                  difference's interval above -2), strict ppl <= 1.10x bf16, serving ppl <= 1.01x
    smollm2-135m: within 5 points at 1k-4k on niah_single_1/2, strict <= 1.15x, serving <= 1.01x

A needle cell is one length, the goal's tasks pooled (every task alone is listed too, and each task over all the
lengths measured: a loss no single cell resolves can resolve there; reported, not a goal cell); a cell the runs do
not hold is "not measured", and the goal cannot pass with one. The bf16 arm may come from another run of the same samples
(`oscar validate niah` is deterministic in its config and seed): a sample is (seed, task, length, index).

    python lab/goal_cells.py --goal qwen --niah runs/i16e/gp8k_short ... [--bf16 runs/i16e/q2k_8k ...] \\
        --ppl runs/i16e/gp8k_ppl \\
        --out lab/results/goal_qwen.json
"""

from __future__ import annotations

import argparse
import json
import os

from oscar.validate import evidence as ev
from oscar.validate import intervals as iv

GOALS = {"qwen": ev.ACCURACY_GOALS["qwen2.5-0.5b"], "smollm2": ev.ACCURACY_GOALS["smollm2-135m"]}  # one owner: oscar.validate.evidence


def _seed(d: str) -> int:
    return int(json.load(open(os.path.join(d, "niah_config.json")))["config"].get("seed", 0))


def read_needles(dirs: list[str], method: str, bf16_only: tuple[str, ...] = ()) -> dict:
    """{(task, length, (seed, index), arm)} -> record, arm in {bf16, method} (only bf16 from the `bf16_only`
    directories: runs of the same samples with another artifact); a later directory wins a duplicate."""
    done = {}
    for d in dirs:
        s = _seed(d)
        arms = ("bf16",) if d in bf16_only else ("bf16", method)
        for (t, L, i, m), r in ev.read_samples(os.path.join(d, "niah_samples.jsonl")).items():
            if m in arms:
                done[(t, L, (s, i), m)] = r
    return done


needle_goal = ev.needle_goal  # the goal's needle rule lives in the leaf: `oscar report` checks it too


def ppl_goal(dirs: list[str], goal: dict, method: str, looks: int = 1) -> dict:
    """Perplexity cells against the goal's limits. looks: how many times these cells have been checked on growing
    samples (a larger run decided after a straddling look): each verdict's interval at level 1 - 0.05/looks
    (Bonferroni over the looks), so looking again cannot buy a PASS the first look's level would not give."""
    windows, seen = [], set()
    for d in dirs:  # a method present in two runs is taken from the first (the runs share their windows)
        got = [w for w in ev.read_windows(os.path.join(d, "ppl_windows.jsonl")) if w["method"] in ("bf16", method)]
        windows += [w for w in got if w["method"] not in seen]
        seen |= {w["method"] for w in got}
    if not windows:
        return {"verdict": "not measured", "rows": []}
    conf = json.load(open(os.path.join(dirs[0], "ppl_config.json")))
    cfg, text = conf["config"], conf.get("text") or {}
    protocols = sorted({w["protocol"] for w in windows if w["method"] == method})
    split = text.get("split_tokens") if text.get("docstring_tokens") else None  # held-out split, then docstrings
    contexts = sorted({w["context"] for w in windows})
    rows, idx, m = [], ev._index(windows), len(contexts)
    for st in ev.ppl_stats(windows, ["bf16", method], protocols, contexts, cfg["tokens"]):
        if st["method"] != method:
            continue
        p, c, lim = st["protocol"], st["context"], goal[st["protocol"]]
        (ba, bb), _, _ = ev.blocks(idx, [(method, ev.proto_key(method, p)), ("bf16", "-")], c, cfg["tokens"] // c)
        _, alo, ahi, _ = ev.ratio_of(ba, bb, 1 - ev.ALPHA / (m * looks))  # for MISSED over the m contexts
        lo, hi = st["ratio_ci_low"], st["ratio_ci_high"]
        if looks > 1:
            _, lo, hi, _ = ev.ratio_of(ba, bb, 1 - ev.ALPHA / looks)
        rows.append({"protocol": p, "context": c, "limit": lim, "ratio": st["ratio"], "lo": lo, "hi": hi,
                     "level": 1 - ev.ALPHA / looks, "blocks": st["blocks"], "verdict": iv.verdict(lo, hi, lim, "below"),
                     "verdict_adjusted": iv.verdict(alo, ahi, lim, "below")})
        if split:  # past the held-out split: the ratio on each text alone, so a verdict is seen not to rest on one
            rows[-1]["by_text"] = {name: _ratio_on(windows, method, p, c, cfg["tokens"], keep) for name, keep in
                                   (("split", lambda w: (w + 1) * c <= split), ("docstrings", lambda w: w * c >= split))}
    out = {"rows": rows, "looks": looks}
    for p in protocols:
        rp = [r for r in rows if r["protocol"] == p]
        out[p] = iv.combine([r["verdict"] for r in rp], [r["verdict_adjusted"] for r in rp])
    return out


def _ratio_on(windows: list[dict], method: str, p: str, c: int, tokens: int, keep) -> dict:
    """The paired ratio on the windows of context c that `keep(window)` selects (whole windows of one text)."""
    idx = ev._index([w for w in windows if w["context"] == c and keep(w["window"])])
    (ba, bb), unit, n = ev.blocks(idx, [(method, ev.proto_key(method, p)), ("bf16", "-")], c, tokens // c)
    r, lo, hi, k = ev.ratio_of(ba, bb)
    return {"ratio": r, "lo": lo, "hi": hi, "windows": n, "blocks": k, "block": unit}


def markdown(res: dict) -> str:
    g, n = res["goal"], res["needles"]
    arm = res.get("label", res["method"])
    if not res["inputs"]["niah"]:  # a perplexity-only check (lab/ppl_more_text.sh): no needle table
        lines = [f"**{g['model']}**, {arm} vs bf16: perplexity only (needles: the goal tables)"]
    else:
        lines = [f"**{g['model']}**, {arm} vs bf16 ({n['rule']}): **{n['verdict']}**", "",
                 f"| length | pairs | bf16 % | {arm} % | difference [{100 * (1 - 0.05 / res.get('looks', 1)):g} %] "
                 "| verdict | per task (difference) |",
                 "|---|---|---|---|---|---|---|"]
    for r in n["rows"]:
        per = "; ".join(f"{t} {c['diff']:+.1f} [{c['lo']:+.0f}, {c['hi']:+.0f}]" for t, c in r["per_task"].items())
        res_n = f" (~{r['resolve_pairs']} pairs)" if r.get("resolve_pairs") else ""
        lines.append(f"| {r['length'] // 1024}k | {r['pairs']} | {r['bf16']:.1f} | {r['score']:.1f} | "
                     f"{r['diff']:+.1f} [{r['lo']:+.1f}, {r['hi']:+.1f}] | {r['verdict']}{res_n} | {per} |")
    if n.get("by_task"):
        lines += ["", "Each task over all lengths measured: " + "; ".join(
            f"{t} {c['diff']:+.1f} [{c['lo']:+.1f}, {c['hi']:+.1f}] ({c['pairs']} pairs)" for t, c in n["by_task"].items()) + "."]
    if n["not_measured"] and res["inputs"]["niah"]:
        lines += ["", "Not measured: " + ", ".join(n["not_measured"]) + "."]
    p = res["ppl"]
    if p["rows"]:
        lines += ["", "Perplexity: " + ", ".join(f"{q} **{p[q]}**" for q in ("strict", "serving") if q in p),
                  "", f"| perplexity | context | x bf16 [{100 * (1 - 0.05 / res.get('looks', 1)):g} %] | limit | verdict |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['protocol']} | {r['context']} | {r['ratio']:.3f} [{r['lo']:.3f}-{r['hi']:.3f}] | "
                  f"<= {r['limit']:.2f} | {r['verdict']} |" for r in p["rows"]]
        if any("by_text" in r for r in p["rows"]):
            t = lambda x: f"{x['ratio']:.3f} [{x['lo']:.3f}-{x['hi']:.3f}] ({x['windows']} windows)"  # noqa: E731
            lines += ["", "Each text alone (windows wholly inside it; the held-out split, then the standard library's "
                      "docstrings):", "", "| perplexity | context | held-out split | docstrings |", "|---|---|---|---|"]
            lines += [f"| {r['protocol']} | {r['context']} | {t(r['by_text']['split'])} | {t(r['by_text']['docstrings'])} |"
                      for r in p["rows"] if "by_text" in r]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--goal", choices=sorted(GOALS), required=True)
    ap.add_argument("--niah", nargs="+", default=[], help="`oscar validate niah` output directories")
    ap.add_argument("--bf16", nargs="*", default=[], help="directories whose bf16 arm only is read (the same samples, "
                    "another artifact)")
    ap.add_argument("--ppl", nargs="*", default=[], help="`oscar validate ppl` output directories")
    ap.add_argument("--method", default="oscar-int2")
    ap.add_argument("--looks", type=int, default=1, help="the times these cells were checked on growing samples (needles "
                    "and perplexity); verdicts read intervals at level 1 - 0.05/looks (default 1: 95 %%)")
    ap.add_argument("--label", help="the arm's name in the report when --method runs another artifact "
                    "(e.g. oscar-layer-copy-int2 run as oscar-int2); default: --method")
    ap.add_argument("--out", required=True, help="JSON path; the Markdown table is written next to it (.md)")
    a = ap.parse_args(argv)
    goal = GOALS[a.goal]
    for d in [*a.niah, *a.bf16]:
        ident = json.load(open(os.path.join(d, "niah_config.json")))["identity"]
        if ident["model"] != goal["model"]:
            raise SystemExit(f"{d} holds needles of {ident['model']}, not {goal['model']} (--goal {a.goal})")
    res = {"goal": goal, "method": a.method, "label": a.label or a.method, "looks": a.looks, "inputs": {"niah": a.niah, "bf16": a.bf16, "ppl": a.ppl},
           "needles": needle_goal(read_needles([*a.bf16, *a.niah], a.method, tuple(a.bf16)), goal, a.method, a.looks),
           "ppl": ppl_goal(a.ppl, goal, a.method, a.looks)}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
