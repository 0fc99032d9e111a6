"""Speed of the validation stages of `oscar run`: NIAH sample and perplexity window, old path vs new.

Same process, same model object, same sample / window, same artifact:

- NIAH (one sample, all methods): baseline = one exact prefill, then per method its own
  `SimQuantCache` and greedy decode (the previous `run_niah` loop); new = `PrefillPool` prefill +
  one `MethodBatchCache` decoded as a batch (the current loop). Predictions must be equal. The
  baseline already gets the GQA attention of `greedy` (no repeat_kv), so its figure is conservative.
- Perplexity (one window, one INT2 method and protocol): baseline = the dense masked softmax
  (`simulated(..., dense=True)`); new = flash far part + band (`simulated(...)`).

    python bench/validate_speed.py [--artifact A] [--length 4096] [--ppl-context 1024] [--threads 1]

Writes bench/results/validate_speed.json: CPU seconds (process time, robust to a shared machine)
and wall seconds of both paths, their ratios, the load average, and whether predictions match.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from oscar.stats.artifact import load_artifact
from oscar.defaults import DEFAULT_METHODS
from oscar.validate import env
from oscar.kernels.backends import CacheSpec, make_cache
from oscar.kernels.simulate import MethodBatchCache
from oscar.validate.methods import method_artifact
from oscar.scoring.protocols import PROTOCOLS
from oscar.validate.niah import eos_ids, greedy
from oscar.scoring.prefill import PrefillPool
from oscar.validate.ppl import heldout_ids
from oscar.scoring.nll import window_nll
from oscar.kernels.window_attention import simulated
from oscar.validate.ruler import Sources, make_sample

OUT = Path(__file__).with_name("results") / "validate_speed.json"


class Clock:
    def __enter__(self):
        self.w, self.c = time.time(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.time() - self.w, time.process_time() - self.c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", default="reports/examples/smollm2/artifact.safetensors")
    ap.add_argument("--task", default="niah_single_2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--protocol", default="serving")
    ap.add_argument("--ppl-method", default="oscar-int2")
    ap.add_argument("--ppl-protocol", default="strict")
    ap.add_argument("--ppl-context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok, _ = env.load_model("smollm2-135m")
    fitted = load_artifact(a.artifact)
    methods = list(DEFAULT_METHODS)
    arts = [method_artifact(m, model.config, fitted) for m in methods]
    proto = PROTOCOLS[a.protocol]
    s = make_sample(a.task, a.length, a.index, tok, Sources.from_text(env.heldout_text("pydoc")))
    eos = eos_ids(model, tok)
    load0 = os.getloadavg()

    with torch.no_grad():
        from transformers import DynamicCache

        with Clock() as base:
            exact = DynamicCache()
            model(input_ids=torch.tensor([s.context_ids]), cache=exact, use_cache=True, logits_to_keep=1)
            old = [greedy(model, make_cache(CacheSpec.one(art, proto, prefill=exact)), s.question_ids, s.max_new_tokens, eos)[0]
                   for art in arts]
        with Clock() as new:
            ex2 = PrefillPool(model).prefill(s.context_ids)
            cache = MethodBatchCache.from_prefill(arts, proto, ex2, capacity=s.total_tokens)
            got = greedy(model, cache, s.question_ids, s.max_new_tokens, eos, rows=len(arts))

    art = method_artifact(a.ppl_method, model.config, fitted)
    win = torch.tensor([heldout_ids(tok, "pydoc", a.ppl_context)])
    with Clock() as pbase:
        with simulated(model, art, PROTOCOLS[a.ppl_protocol], dense=True):
            nll_dense = window_nll(model, win)[0]
    with Clock() as pnew:
        with simulated(model, art, PROTOCOLS[a.ppl_protocol]):
            nll_new = window_nll(model, win)[0]

    res = {
        "host": f"{platform.node()} ({os.cpu_count()} CPUs)", "threads": a.threads,
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
        "niah": {"task": a.task, "length": a.length, "prompt_tokens": s.prompt_tokens, "methods": methods,
                 "protocol": a.protocol, "baseline_cpu_s": base.cpu, "new_cpu_s": new.cpu,
                 "baseline_wall_s": base.wall, "new_wall_s": new.wall, "speedup_cpu": base.cpu / new.cpu,
                 "preds_equal": [x == y for x, y in zip(old, got)]},
        "ppl": {"method": a.ppl_method, "protocol": a.ppl_protocol, "context": a.ppl_context,
                "baseline_cpu_s": pbase.cpu, "new_cpu_s": pnew.cpu, "baseline_wall_s": pbase.wall,
                "new_wall_s": pnew.wall, "speedup_cpu": pbase.cpu / pnew.cpu, "nll_dense": nll_dense,
                "nll_new": nll_new},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
