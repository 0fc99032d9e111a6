"""Can the committed Qwen2.5-0.5B example's rows that read no artifact (bf16, kivi2) be carried into the main job's
run, and what would it save?

    python lab/qwen_carry_over.py samples          # every old (task, length, index): does today's code build the
                                                   # same sample (prompt tokens, answers)? no model run
    python lab/qwen_carry_over.py preds DIR        # index 0 of every 1k-8k cell rerun for bf16 and kivi2 into DIR
                                                   # (resumable): the same predictions as the old lines?
    python lab/qwen_carry_over.py cost DIR         # one 8k sample, one batch of 1 row (bf16) and one of 3 rows
                                                   # (bf16, kivi2, oscar-int2): CPU of the shared prefill and of a row

Each step merges its figures into lab/results/qwen_carry_over.json. tq-int2 is not asked about: it is built from
the calibration store the served artifact was fitted from (validate/codebooks.py tq_artifact: outlier channels and
key means), so a new calibration makes new tq-int2 rows.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "reports", "examples", "qwen2.5-0.5b")
OUT = os.path.join(ROOT, "lab", "results", "qwen_carry_over.json")
MODEL = "qwen2.5-0.5b"
TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1"]
LENGTHS = [1024, 2048, 4096, 8192]


def _old() -> dict:
    from oscar.validate.evidence import read_samples

    return read_samples(os.path.join(EX, "niah_samples.jsonl"))


def _save(key: str, rec: dict) -> None:
    res = json.load(open(OUT)) if os.path.exists(OUT) else {}
    res[key] = rec
    json.dump(res, open(OUT, "w"), indent=1)
    print(json.dumps({key: rec}, indent=1))


def samples() -> None:
    from oscar.pipeline.models import load_tokenizer
    from oscar.validate import env
    from oscar.validate.heldout import more_heldout_words
    from oscar.validate.ruler import Sources, make_sample

    tok = load_tokenizer(MODEL)
    src = Sources.from_text(env.heldout_text("pydoc"), more=more_heldout_words("pydoc"))
    keys = sorted({(t, L, i) for (t, L, i, _) in _old()})
    old = {(t, L, i): r for (t, L, i, _), r in _old().items()}
    same, diff = 0, []
    for t, L, i in keys:
        s = make_sample(t, L, i, tok, src, seed=0)
        r = old[(t, L, i)]
        if s.prompt_tokens == r["prompt_tokens"] and list(s.answers) == list(r["answers"]):
            same += 1
        else:
            diff.append([t, L, i, r["prompt_tokens"], s.prompt_tokens])
    _save("samples", {"samples": len(keys), "same_prompt_tokens_and_answers": same, "different": diff[:20]})


def preds(d: str) -> None:
    from oscar.validate.niah import NiahConfig, run_niah

    run_niah(NiahConfig(out=d, model=MODEL, methods=["bf16", "kivi2"], tasks=TASKS, lengths=LENGTHS, samples=1,
                        protocol="serving", dtype="bfloat16"), progress=False)
    from oscar.validate.evidence import read_samples

    new, old = read_samples(os.path.join(d, "niah_samples.jsonl")), _old()
    rows = [[k[0], k[1], k[3], old[k]["pred"], r["pred"]] for k, r in sorted(new.items())]
    _save("preds", {"pairs": len(rows), "same_pred": sum(a == b for *_, a, b in rows),
                    "different": [r for r in rows if r[3] != r[4]],
                    "batch_cpu_s": {f"{t} {L}": r["batch_cpu_s"] for (t, L, _, m), r in sorted(new.items()) if m == "bf16"}})


def cost(d: str) -> None:
    from oscar.validate.evidence import read_samples
    from oscar.validate.niah import NiahConfig, run_niah

    art = os.path.join(EX, "artifact.safetensors")  # what oscar-int2 reads does not change its cost
    out = {}
    for name, methods in (("1row", ["bf16"]), ("3rows", ["bf16", "kivi2", "oscar-int2"])):
        sub = os.path.join(d, name)
        run_niah(NiahConfig(out=sub, model=MODEL, artifact=art, methods=methods, tasks=["niah_single_1"],
                            lengths=[8192], samples=1, protocol="serving", dtype="bfloat16"), progress=False, workers=1)
        out[name] = next(iter(read_samples(os.path.join(sub, "niah_samples.jsonl")).values()))["batch_cpu_s"]
    row = (out["3rows"] - out["1row"]) / 2
    _save("cost_8k", {"batch_cpu_s": out, "row_cpu_s": row, "prefill_cpu_s": out["1row"] - row})


if __name__ == "__main__":
    step = sys.argv[1]
    {"samples": lambda: samples(), "preds": lambda: preds(sys.argv[2]), "cost": lambda: cost(sys.argv[2])}[step]()
