"""Cost of the main job's attention-level stage: held-out capture vs the old reservoir-resampling test.

    python bench/attention_stage.py --store DIR/calib.zarr --artifact DIR/artifact.safetensors \
        [--lengths 4k,16k] [--dtype bfloat16] [--old-rev cee392e]

Runs, in one process on the same store and artifact:
  - the old stage (validate/attention.py as of git revision --old-rev: keys resampled from the
    store's reservoirs), at its main-job lengths 4k,16k,64k,128k;
  - the new stage at the main job's settings (`oscar run`: --lengths, bfloat16, the model loaded once);
and writes bench/results/attention_stage.json: seconds of each, their ratio, the capture's share,
captured tokens, the capture rate, and the capture time the 64k/128k lengths would add at that
rate. The load average is recorded: absolute seconds are only meaningful on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

OUT = Path(__file__).with_name("results") / "attention_stage.json"


def _old_module(rev: str) -> types.ModuleType:
    src = subprocess.run(["git", "show", f"{rev}:validate/attention.py"], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).parents[1]).stdout
    mod = types.ModuleType("oscar_attention_old")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, f"{rev}:validate/attention.py", "exec"), mod.__dict__)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="a main job's calib.zarr")
    ap.add_argument("--artifact", required=True, help="the artifact fitted on it")
    ap.add_argument("--lengths", default="4k,16k", help="new stage lengths (default: the main job's 4k,16k)")
    ap.add_argument("--dtype", default="bfloat16", help="capture dtype (default: the main job's bfloat16)")
    ap.add_argument("--old-rev", default="cee392e", help="git revision of the old stage (default cee392e)")
    ap.add_argument("--out", default=str(OUT), help=f"result JSON (default {OUT})")
    a = ap.parse_args()

    from oscar.validate.attention import AttnConfig, run_attention, sequence_lengths, stream_rows_needed
    from oscar.validate.env import load_model
    from oscar.validate.ruler import parse_length

    lengths = [parse_length(x) for x in a.lengths.split(",")]
    res: dict = {"load_average_start": list(os.getloadavg()), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        old = _old_module(a.old_rev)
        t = time.perf_counter()
        old.run_attention(old.AttnConfig(out=tmp + "/old", store=a.store, artifact=a.artifact), progress=False)
        res["old_stage_s"] = time.perf_counter() - t
        from oscar.validate import methods

        methods._REFITS.clear()  # the new stage refits oscar-ref-int2 itself, as the old one did
        loaded = load_model("smollm2-135m")
        t = time.perf_counter()
        run_attention(AttnConfig(out=tmp + "/new", store=a.store, artifact=a.artifact, lengths=lengths, dtype=a.dtype),
                      progress=False, loaded=loaded)
        res["new_stage_s"] = time.perf_counter() - t
        meta = json.load(open(tmp + "/new/attention.json"))
    cap, tok = meta["capture_seconds"], meta["heldout"]["tokens"]
    res.update(old_rev=a.old_rev, lengths=lengths, dtype=a.dtype, ratio_new_vs_old=res["new_stage_s"] / res["old_stage_s"],
               capture_s=cap, captured_tokens=tok, capture_tokens_per_s=tok / cap,
               load_average_end=list(os.getloadavg()))
    for more in ([4096, 16384, 65536], [4096, 16384, 65536, 131072]):
        n = sum(sequence_lengths(stream_rows_needed(more, 64, 64, 8), 4096, 64))
        res[f"capture_s_projected_to_{more[-1] // 1024}k"] = {"tokens": n, "seconds": n / res["capture_tokens_per_s"]}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
