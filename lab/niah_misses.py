"""What a method answers where bf16 finds the needle: another needle's value, a near copy, or something else.

Rebuilds each missed sample from its (task, length, index, seed) and classifies the prediction:
  distractor  a value of the answer's length found in the same context: another needle's (the wrong key was read)
  near        the right value miscopied (difflib ratio >= 0.75: a digit or two changed, dropped or added)
  other       anything else
A directory may hold only some methods; --bf16 DIRS lend their bf16 arm for the same samples.

  python lab/niah_misses.py --model qwen2.5-0.5b --niah runs/i16e/gp8k_short ... --bf16 runs/i16e/qp4k_4k \
      --tasks niah_multikey_1 --out lab/results/misses_qwen.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter
from difflib import SequenceMatcher

from oscar.validate import evidence as ev


def classify(pred: str, answer: str, context: str) -> str:
    words = re.findall(r"\d+" if answer.isdigit() else r"[0-9A-Za-z][0-9A-Za-z-]*", pred)
    if not words:
        return "other"
    g = words[0]
    if g != answer and len(g) == len(answer) and re.search(rf"(?<![0-9A-Za-z-]){re.escape(g)}(?![0-9A-Za-z-])", context):
        return "distractor"
    if SequenceMatcher(None, g, answer).ratio() >= 0.75:
        return "near"
    return "other"


def _rows(dirs: list[str], method: str | None = None) -> dict:
    """(seed, task, length, index, method) -> record; a later directory wins a duplicate, a line cut by a kill is skipped."""
    rows = {}
    for d in dirs:
        seed = json.load(open(os.path.join(d, "niah_config.json")))["identity"]["seed"]
        for (t, L, i, m), r in ev.read_samples(os.path.join(d, "niah_samples.jsonl")).items():
            if not method or m == method:
                rows[(seed, t, L, i, m)] = r
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--niah", nargs="+", required=True)
    ap.add_argument("--bf16", nargs="*", default=[], help="runs lending only their bf16 arm (the same samples)")
    ap.add_argument("--method", default="oscar-int2")
    ap.add_argument("--tasks", default=None, help="comma-separated; default: every task found")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from oscar.validate import env
    from oscar.validate.heldout import more_heldout_words
    from oscar.validate.ruler import Sources, make_sample

    rows = {**_rows(a.bf16, "bf16"), **_rows(a.niah)}
    tasks = set(a.tasks.split(",")) if a.tasks else None
    _, tok, _ = env.load_model(a.model)
    src = Sources.from_text(env.heldout_text("pydoc"), more=more_heldout_words("pydoc"))
    misses, counts = [], Counter()
    for (seed, t, L, i, m), r in sorted(rows.items()):
        b = rows.get((seed, t, L, i, "bf16"))
        if m != a.method or (tasks and t not in tasks) or b is None:
            continue
        counts["pairs"] += 1
        if r["score"] >= 1 or b["score"] < 1:
            continue
        s = make_sample(t, L, i, tok, src, seed=seed)
        kind = classify(r["pred"], r["answers"][0], s.context_text)
        counts[kind] += 1
        misses.append({"seed": seed, "task": t, "length": L, "index": i, "pred": r["pred"].strip(), "answer": r["answers"][0],
                       "kind": kind})
    out = {"model": a.model, "method": a.method, "inputs": a.niah, "bf16": a.bf16, "counts": dict(counts),
           "misses": misses}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    json.dump(out, open(a.out, "w"), indent=1)
    for m in misses:
        print(f"seed {m['seed']} {m['task']} {m['length']} #{m['index']}: {m['pred']!r} for {m['answer']} -> {m['kind']}")
    print(dict(counts))


if __name__ == "__main__":
    main()
