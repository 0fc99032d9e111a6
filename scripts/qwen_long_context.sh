#!/usr/bin/env bash
# reports/examples/qwen2.5-0.5b: Qwen2.5-0.5B on CPU: needle tests at 8k, 16k and 32k (one task, 5 samples), the
# 32k cell through 2 pipeline stages, RULER's needle tasks at 1k-8k (20 samples per cell) and perplexity.
#
#   bash scripts/qwen_long_context.sh            # every step; re-running resumes (store blocks, needle samples)
#   STEPS="niah-32k report" bash scripts/qwen_long_context.sh   # some steps only
#
# One thread throughout (a shared host). Each step is one `oscar` command, timed into $OUT/steps.jsonl;
# the last step writes $OUT/run.json from it and builds $OUT/report.md with `oscar report` (which lists
# the commands and their CPU time). The artifact is calibrated and tuned on the calibration split only;
# the needle haystacks are held-out text (noise sentences for niah_single_1).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/examples/qwen2.5-0.5b}
WORK=${WORK:-runs/qwen}  # the calibration store and the untuned fit (not committed)
STEPS=${STEPS:-"install calibrate fit tune calibration-section niah-8k niah-16k niah-32k niah-32k-stages ruler-1k ruler-2k ruler-4k ruler-8k ppl report"}
export OMP_NUM_THREADS=1 OSCAR_THREADS=1
OSCAR=${OSCAR:-.venv/bin/oscar}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT" "$WORK"
METHODS=bf16,oscar-int2,tq-int2,kivi2

step() {  # step NAME COMMAND...: run it, append {stage, command, cpu_s, wall_s, maxrss_kb} to steps.jsonl
  local name=$1; shift
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  if [ -n "${SKIP_IF:-}" ] && [ -e "$SKIP_IF" ]; then echo "$name: $SKIP_IF exists (skipped)"; return 0; fi
  local t; t=$(mktemp)
  /usr/bin/time -o "$t" -f "%U %S %e %M" "$@"
  read -r u s e m < "$t"; rm -f "$t"
  printf '{"stage": "%s", "command": "%s", "cpu_s": %s, "wall_s": %s, "maxrss_kb": %s}\n' \
    "$name" "$CMD" "$(awk "BEGIN{print $u + $s}")" "$e" "$m" >> "$OUT/steps.jsonl"
}

CMD="oscar models install qwen2.5-0.5b"
step install $OSCAR models install qwen2.5-0.5b
CMD="oscar calibrate --model qwen2.5-0.5b --store $WORK/calib.zarr --seq-len 2048 --tokens 8192 --block-tokens 4096 --threads 1"
step calibrate $OSCAR calibrate --model qwen2.5-0.5b --store "$WORK/calib.zarr" --seq-len 2048 --tokens 8192 \
  --block-tokens 4096 --threads 1 --no-progress
# fit and tune write timings into the artifact's metadata, so a second run would change its fingerprint and the
# needle samples already scored for it would be refused: an artifact that exists is kept.
CMD="oscar fit $WORK/calib.zarr --variant scaled --no-tune --widths none --out $WORK/artifact.fit.safetensors --threads 1"
SKIP_IF=$WORK/artifact.fit.safetensors step fit $OSCAR fit "$WORK/calib.zarr" --variant scaled --no-tune --widths none \
  --out "$WORK/artifact.fit.safetensors" --threads 1 --no-progress
CMD="oscar fit $WORK/calib.zarr --variant scaled --widths none --out $WORK/artifact.safetensors && cp $WORK/artifact.safetensors $OUT/"
SKIP_IF=$OUT/artifact.safetensors step tune sh -c "$OSCAR fit '$WORK/calib.zarr' --variant scaled --widths none \
  --out '$WORK/artifact.safetensors' --threads 1 --no-progress && cp '$WORK/artifact.safetensors' '$OUT/artifact.safetensors'"
CMD="python -c 'calibration_section(artifact, store, $OUT/calibration)'"
step calibration-section $PY -c "from oscar.reports.calibration import calibration_section as c; \
c('$OUT/artifact.safetensors', '$WORK/calib.zarr', '$OUT/calibration')"
for L in 8k 16k 32k; do
  CMD="OMP_NUM_THREADS=1 oscar validate niah --model qwen2.5-0.5b --artifact $OUT/artifact.safetensors --methods $METHODS --tasks niah_single_1 --lengths $L --samples 5 --protocol serving --dtype bfloat16 --out $OUT"
  step "niah-$L" $OSCAR validate niah --model qwen2.5-0.5b --artifact "$OUT/artifact.safetensors" --methods $METHODS \
    --tasks niah_single_1 --lengths "$L" --samples 5 --protocol serving --dtype bfloat16 --out "$OUT" --no-progress
done

# The RULER cells people compare with published tables: four needle tasks at 1k-8k, 20 samples per cell (the 8k
# niah_single_1 cell above grows from 5 to 20), and perplexity over 8 windows of 1k and of 4k (held-out text,
# continued into the standard library's docstrings past the pydoc split).
RULER_TASKS=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1
for L in 1k 2k 4k 8k; do
  CMD="oscar validate niah --model qwen2.5-0.5b --artifact $OUT/artifact.safetensors --methods $METHODS --tasks $RULER_TASKS --lengths $L --samples 20 --protocol serving --dtype bfloat16 --out $OUT"
  step "ruler-$L" $OSCAR validate niah --model qwen2.5-0.5b --artifact "$OUT/artifact.safetensors" --methods $METHODS \
    --tasks $RULER_TASKS --lengths "$L" --samples 20 --protocol serving --dtype bfloat16 --out "$OUT" --no-progress
done
CMD="oscar validate ppl --model qwen2.5-0.5b --artifact $OUT/artifact.safetensors --methods $METHODS --contexts 1k,4k --tokens 32768 --dtype bfloat16 --out $OUT"
step ppl $OSCAR validate ppl --model qwen2.5-0.5b --artifact "$OUT/artifact.safetensors" --methods $METHODS \
  --contexts 1k,4k --tokens 32768 --dtype bfloat16 --out "$OUT" --no-progress

# The same 32k cell through 2 pipeline stages on a local Ray cluster (the path a model too large for one device
# takes): bf16 and oscar-int2, 2 samples; every answer must equal the one-process answer above.
CMD="oscar validate niah --ray auto --stages 2 --model qwen2.5-0.5b --artifact $OUT/artifact.safetensors --methods bf16,oscar-int2 --tasks niah_single_1 --lengths 32k --samples 2 --protocol serving --dtype bfloat16 --out $OUT/two-stages"
step niah-32k-stages $OSCAR validate niah --ray auto --stages 2 --model qwen2.5-0.5b --artifact "$OUT/artifact.safetensors" \
  --methods bf16,oscar-int2 --tasks niah_single_1 --lengths 32k --samples 2 --protocol serving --dtype bfloat16 \
  --out "$OUT/two-stages" --no-progress
case " $STEPS " in *" niah-32k-stages "*)
  $PY - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
key = lambda r: (r["task"], r["length"], r["index"], r["method"])  # noqa: E731
one = {key(r): r["pred"] for r in map(json.loads, open(os.path.join(out, "niah_samples.jsonl")))}
two = [json.loads(l) for l in open(os.path.join(out, "two-stages", "niah_samples.jsonl"))]
same = [one[key(r)] == r["pred"] for r in two]
print(f"2 stages vs one process: {sum(same)} of {len(same)} answers identical")
sys.exit(0 if all(same) else 1)
EOF
;; esac

case " $STEPS " in *" report "*)
  $PY - "$OUT" <<'EOF'
import json, os, platform, sys
out = sys.argv[1]
steps = [json.loads(l) for l in open(os.path.join(out, "steps.jsonl"))]
last = {}
for s in steps:  # a resumed step keeps every attempt's time: sum them
    k = s["stage"]
    last.setdefault(k, {**s, "cpu_s": 0.0, "wall_s": 0.0, "attempts": 0})
    last[k]["cpu_s"] += s["cpu_s"]; last[k]["wall_s"] += s["wall_s"]; last[k]["attempts"] += 1
    last[k]["maxrss_kb"] = max(last[k].get("maxrss_kb", 0), s.get("maxrss_kb", 0))
    if s.get("note"):
        last[k]["note"] = s["note"]
rows = [{**v, "note": "; ".join(x for x in (v.get("note"), f"peak RSS {v['maxrss_kb'] / 2**20:.1f} GiB" if v.get("maxrss_kb") else "",
                                          f"{v['attempts']} attempts" if v["attempts"] > 1 else "") if x)}
        for v in last.values()]
cpu = sum(r["cpu_s"] for r in rows)
info = {"command": "bash scripts/qwen_long_context.sh", "model": "qwen2.5-0.5b",
        "host": f"{platform.node()} ({os.cpu_count()} CPUs, one thread used, shared with other jobs)",
        "total_seconds": sum(r["wall_s"] for r in rows), "cpu_seconds": cpu, "steps": rows,
        "summary": f"{cpu / 60:.1f} CPU min in all (one thread); wall time is the host's load, not this job's cost."}
json.dump(info, open(os.path.join(out, "run.json"), "w"), indent=1)
EOF
  $OSCAR report "$OUT" --title "Qwen2.5-0.5B: long-context needles on CPU" ;;
esac
