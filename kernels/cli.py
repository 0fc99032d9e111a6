"""`oscar bench memory`: KV-cache bytes per token by component, BF16 vs each INT2 mode."""

from __future__ import annotations

import argparse
import json

from oscar.cli_options import add_artifact, add_model, add_out
from oscar.common import OscarError, nonneg_int, positive_int
from oscar.defaults import PAGE_SIZE, RECENT, SINK


def register(sub) -> None:
    bench = sub.add_parser("bench", help="cache benchmarks (memory accounting)",
                           description="Cache benchmarks; `oscar bench memory` accounts KV-cache bytes per token.")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    m = bsub.add_parser("memory", help="bytes per token by component for BF16 and each INT2 cache mode")
    add_model(m, "model spec or config.json path (default: the embedded SmolLM2)")
    m.add_argument("--context", type=positive_int, default=32768, help="sequence length (tokens) for the whole-context totals")
    m.add_argument("--sink", type=nonneg_int, default=SINK, help="first tokens kept in BF16 by every INT2 format")
    m.add_argument("--recent", type=nonneg_int, default=RECENT, help="latest tokens kept in BF16 by every INT2 format")
    m.add_argument("--page-size", type=positive_int, default=PAGE_SIZE, help="tokens per INT2 page")
    add_artifact(m, "also account this artifact's own format, layer by layer (per-layer widths); "
                    "default: none, the preset formats only")
    m.add_argument("--json", action="store_true", help="print the report as JSON")
    add_out(m, "also write the JSON report to this file (default: print only)", required=False)
    m.set_defaults(func=memory_cmd)


def memory_cmd(args: argparse.Namespace) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.kernels.memory import default_formats, load_model_config, report

    if args.context < 1:
        raise OscarError(f"--context must be >= 1, got {args.context}")
    cfg = load_model_config(args.model)
    rep = report(cfg, args.context, default_formats(args.sink, args.recent, args.page_size))
    rep["model"] = args.model
    if args.artifact:
        # late: keeps torch (2.1 s) out of `oscar --help`
        from oscar.kernels.memory import artifact_row
        from oscar.stats.artifact import load_artifact

        rep["artifact"] = {"path": args.artifact, **artifact_row(load_artifact(args.artifact), cfg)}
    text = json.dumps(rep, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        print(f"{args.model}: {rep['shapes']}  context {args.context}")
        print(f"{'format':14s} {'bits/elem':>9s} {'hist B/tok':>10s} {'vs bf16':>8s} {'ctx MiB':>9s} {'vs bf16':>8s}")
        for r in rep["rows"]:
            print(f"{r['format']:14s} {r['bits_per_element']:9.3f} {r['history_bytes_per_token_total']:10.1f} "
                  f"1/{1 / r['history_ratio_vs_bf16']:<6.2f} {r['context_bytes_total'] / 2**20:9.2f} "
                  f"1/{1 / r['context_ratio_vs_bf16']:<6.2f}")
        if rep.get("kind") == "latent":
            print("  (MLA latent cache: c_kv quantized in groups with fp32 scale + zero, k_pe and the sink / recent "
                  "windows 16-bit; bits/elem per latent value, k_pe apart)")
            for r in rep["rows"]:
                print(f"  {r['format']:14s} {r['bytes_per_token_layer']:8.1f} B per token and layer")
        if "artifact" in rep:
            a = rep["artifact"]
            print(f"{'artifact':14s} {a['bits_per_element']:9.3f} {sum(a['history_bytes_per_token'].values()):10.1f} "
                  f"1/{1 / a['history_ratio_vs_bf16']:<6.2f}  ({a['path']}, layer by layer)")
        for k, v in rep["targets"].items():
            by = f" by {v['met_by']}" if v.get("met_by") else ""
            print(f"target {k}: {'met' if v['met'] else 'MISSED'}{by}  {v.get('why', '')}")
            for name, r in v.get("rows", {}).items():
                print(f"  {name:14s} 1/{1 / r['ratio']:.2f} {'met' if r['met'] else 'missed'}  {r.get('why', '')}")
    return 0
