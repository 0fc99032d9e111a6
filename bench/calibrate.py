"""Capture overhead and store write share of `oscar calibrate` (SmolLM2-135M, 2048-token sequences).

Same process, same tokens, same model object: a plain forward of the base model (transformers' sdpa, no
capture) against `run_blocks` as `oscar calibrate` runs it (forward with the capturing attention function +
statistics + store writes; the capture's attention is the native CPU causal kernel where this host's probe chose
it, kernels/cpu_attention.py), alternating so that load drift on a shared machine hits both alike. Where the
native attention runs, a third arm, the plain forward with that same attention, splits the ratio in two:
`attention_speedup` (plain sdpa / plain native attention) and `capture_overhead_ratio` (plain native attention /
calibrate: what the statistics and the store cost against the same forward). `--capture-attention sdpa`
measures the capture on sdpa (two arms).

    python bench/calibrate.py [--blocks 2] [--seqs 8] [--reps 3] [--seq-len 2048] [--as-avx2]

--as-avx2 measures as an AVX2-only host runs (oscar.host.AVX2: torch, oneDNN and MKL held to AVX2, the native
kernels built without AVX-512, no bfloat16 units): the script runs itself again under that environment.

A measured run is `--blocks` blocks of `--seqs` sequences: by default `oscar calibrate`'s own
blocking (16384 tokens per block = 8 sequences of 2048), two blocks so that the store writer
overlaps block 0's writes with block 1's compute as in a long run (a one-block run would show
only the last block's write, never the steady state). `--seqs 1` is the finest blocking: a
block's statistics are ~39 MB whatever its size, so the store's share is 8x larger there.

Writes bench/results/calibrate.json, one record per host (`runs`, keyed by `oscar.host.describe()` and the
blocking; a run replaces its own record and keeps the others), each with a one-thread float32 GEMM's speed measured
just before it (the same VM runs at different speeds an hour apart). Targets: block checksums (CRC-32 of every chunk, timed in the
writer thread) < 2 % of the calibration wall time (`checksum_share`; `verify_share` is what verifying
the written blocks costs a resume / inspect / fit, relative to calibrating them); throughput ratio (median plain time / median
calibrate time over the reps) >= 0.95, store writes < 5 % of the wall time (the writes the run
waits for; the writer thread's total busy time is reported too). Each rep's own ratio and the
statistics' share of the wall time (timed inside the capture, immune to load drift) are reported
beside it: on this shared 2-core VM the plain forward alone drifts by +-15 % between reps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from oscar.host import avx2_env, gemm_gflops, is_avx2_env
from oscar import host
from oscar.common import keep_freed_memory, set_threads
from oscar.kernels import cpu_attention as CA
from oscar.pipeline import capture as C
from oscar.pipeline import native
from oscar.pipeline.calibrate import run_blocks
from oscar.pipeline.corpus import load_corpus, make_blocks
from oscar.pipeline.models import load_model
from oscar.pipeline.store import CalibStore, StoreMeta, WriterLock

OUT = Path(__file__).with_name("results") / "calibrate.json"
TARGET = 0.95  # the capture's throughput against a plain forward


class _PartTimer:
    """Wall time inside the statistics' parts while a calibrate arm runs: the C kernel's one call per layer and
    sequence (statistics and reservoir candidates); the rest of `stats_s` is the glue and the block's assembly."""

    PARTS = {"sequence_kernel": (native, "sequence")}

    def __init__(self):
        self.s = dict.fromkeys(self.PARTS, 0.0)
        self.calls = 0  # (layer, sequence) pairs: one kernel call each
        for key, (obj, name) in self.PARTS.items():
            setattr(obj, name, self._wrap(key, getattr(obj, name)))

    def _wrap(self, key, f):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.s[key] += time.perf_counter() - t
                self.calls += key == "sequence_kernel"
        return timed

    def take(self) -> dict:
        out, self.s, self.calls = {"s": dict(self.s), "layer_sequences": self.calls}, dict.fromkeys(self.s, 0.0), 0
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=2, help="blocks per measured run")
    ap.add_argument("--seqs", type=int, default=8, help="sequences per block (oscar calibrate's default: 8)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--reservoir", type=int, default=256)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--as-avx2", action="store_true", help="measure as an AVX2-only host runs (module docstring)")
    ap.add_argument("--capture-attention", choices=("product", "sdpa"), default="product",
                    help="the capture's attention: as `oscar calibrate` runs it (default), or transformers' sdpa")
    args = ap.parse_args()
    if args.as_avx2 and not is_avx2_env():  # the restriction must be set before torch starts: run again under it
        sys.exit(subprocess.run([sys.executable, *sys.argv], env=avx2_env()).returncode)
    gflops = gemm_gflops()
    threads = set_threads()
    kept = keep_freed_memory()  # as `oscar calibrate` sets it, before either arm runs
    load0 = os.getloadavg()

    t0 = time.perf_counter()
    model, tok, info = load_model(args.model, attn_implementation="sdpa", dtype=torch.float32)
    load_s = time.perf_counter() - t0
    corpus = load_corpus("pydoc")
    plan = make_blocks(tok, corpus.calibration, seq_len=args.seq_len, seqs_per_block=args.seqs)
    tokens, mask = plan.tokens[:args.blocks], plan.mask[:args.blocks]  # (blocks, S, T): the first full blocks
    assert mask.all(), "a measured block has padding"
    n_tok = int(mask.sum())
    base = C.base_model(model)
    ids = torch.from_numpy(tokens.reshape(-1, args.seq_len).astype(np.int64))  # (blocks*S, T)
    am = torch.from_numpy(mask.reshape(-1, args.seq_len).astype(np.int64))

    native_attn = args.capture_attention == "product" and CA.chosen(torch.float32)
    if native_attn:
        CA.register()  # as `oscar calibrate` does: the capture's sdpa runs the native kernel

    def plain(attn: str = "sdpa") -> float:
        model.set_attn_implementation(attn)
        t = time.perf_counter()
        with torch.no_grad():
            for s in range(ids.shape[0]):
                base(input_ids=ids[s:s + 1], attention_mask=am[s:s + 1], use_cache=False)
        return time.perf_counter() - t

    tmp = Path(tempfile.mkdtemp(prefix="oscar-bench-"))
    meta = StoreMeta(model={k: getattr(info, k) for k in ("name", "fingerprint", "num_layers", "num_q_heads",
                                                          "num_kv_heads", "head_dim")},
                     corpus=corpus.to_dict(), seq_len=args.seq_len, sink=args.sink, num_blocks=args.blocks,
                     seqs_per_block=args.seqs, reservoir=args.reservoir, config={"seed": 0, "bench": True})

    def calib(rep: int) -> dict:
        model.set_attn_implementation("sdpa")  # the loaded model's, which the capture wraps
        path = tmp / f"s{rep}.zarr"
        with WriterLock(path, range(info.num_layers)):
            t = time.perf_counter()
            st = CalibStore.open_or_create(path, meta, tokens, mask)
            create_s = time.perf_counter() - t
            r = run_blocks(model, st, batch_size=1, progress=False)
        t = time.perf_counter()
        bad = CalibStore(path).verify()  # what a resume, inspect or fit pays to verify the blocks
        verify_s = time.perf_counter() - t
        assert not bad, bad
        shutil.rmtree(path)
        return {"wall_s": r.wall_s, "forward_capture_s": r.forward_s, "stats_s": r.stats_s, "write_s": r.write_s,
                "write_busy_s": r.write_busy_s, "create_s": create_s, "checksum_s": st.checksum_s,
                "verify_s": verify_s}

    with torch.no_grad():  # warm-up (allocator, kernels) on a short prefix, both paths
        base(input_ids=ids[:1, :256], attention_mask=am[:1, :256], use_cache=False)
        if native_attn:
            model.set_attn_implementation(CA.NAME)
            base(input_ids=ids[:1, :256], attention_mask=am[:1, :256], use_cache=False)
    arms = ["plain", "calib"] + (["plain_attn"] if native_attn else [])
    plain_s, attn_s, calib_runs = [], [], []
    kernel = {arm: [] for arm in arms}  # per arm and rep: the process's minor page faults and system time
    parts = _PartTimer()
    for rep in range(args.reps):
        for arm in arms[rep % len(arms):] + arms[:rep % len(arms)]:  # each arm leads in turn
            ru = resource.getrusage(resource.RUSAGE_SELF)
            if arm == "plain":
                plain_s.append(plain())
            elif arm == "plain_attn":
                attn_s.append(plain(CA.NAME))
            else:
                parts.take()
                calib_runs.append({**calib(rep), "parts": parts.take()})
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            kernel[arm].append({"minor_faults": ru1.ru_minflt - ru.ru_minflt, "sys_s": ru1.ru_stime - ru.ru_stime})
        print(f"rep {rep}: plain {plain_s[-1]:.2f} s, calibrate {calib_runs[-1]['wall_s']:.2f} s "
              f"(writes {calib_runs[-1]['write_s']:.3f} s)" + (f", plain with the native attention "
                                                              f"{attn_s[-1]:.2f} s" if attn_s else ""), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)

    p = statistics.median(plain_s)
    c = statistics.median(r["wall_s"] for r in calib_runs)
    w = statistics.median(r["write_s"] / r["wall_s"] for r in calib_runs)
    wb = statistics.median(r["write_busy_s"] / r["wall_s"] for r in calib_runs)
    st = statistics.median(r["stats_s"] / r["wall_s"] for r in calib_runs)
    # Checksums: CRC-32 of every chunk + the checksum records, timed inside the writer thread (which
    # overlaps the next block's compute, so this share of the wall time is an upper bound on the
    # throughput they cost); measured in the same runs, immune to load drift.
    ck = statistics.median(r["checksum_s"] / r["wall_s"] for r in calib_runs)
    vf = statistics.median(r["verify_s"] / r["wall_s"] for r in calib_runs)
    pairs = [ps / r["wall_s"] for ps, r in zip(plain_s, calib_runs)]  # each rep's plain and calibrate ran back to back
    res = {
        "model": info.name, "seq_len": args.seq_len, "blocks_per_run": args.blocks, "seqs_per_block": args.seqs,
        "tokens_per_run": n_tok,
        "reps": args.reps, "sink": args.sink, "reservoir": args.reservoir, "dtype": "float32",
        "attn_implementation": "sdpa",
        "capture_attention": "native (kernels/cpu_attention.py)" if native_attn else "sdpa",
        "capture_kernel": "native (pipeline/_moments.c)" if native.available() else f"torch ops ({native.WHY_NOT})",
        "plain_forward_tokens_per_s": n_tok / p,
        "calibrate_tokens_per_s": n_tok / c,
        "host": host.describe(), "gemm_gflops_1thread": gflops, "date": time.strftime("%Y-%m-%d"),
        "throughput_ratio": p / c, "throughput_ratio_target": TARGET, "throughput_ratio_met": p / c >= TARGET,
        "throughput_ratio_per_rep": pairs,
        # Where the capture runs the native attention: the same forward without the capture, so the ratio splits
        # into the attention's gain and what the statistics and the store cost (medians; per rep beside them).
        **({"attention_speedup": p / statistics.median(attn_s),
            "attention_speedup_per_rep": [ps / a for ps, a in zip(plain_s, attn_s)],
            "capture_overhead_ratio": statistics.median(attn_s) / c,
            "capture_overhead_ratio_per_rep": [a / r["wall_s"] for a, r in zip(attn_s, calib_runs)]}
           if attn_s else {}),
        # Cross-check that load drift cannot fake: the share of the calibration's wall time spent inside
        # the statistics (Capture.record + finish_block); 1 - this - store_write_share is the ratio against the
        # same forward (capture_overhead_ratio where the native attention runs, else the headline) that a perfectly
        # steady machine would show if the capture did not slow the forward itself.
        "statistics_share": st,
        # ms per (layer, sequence) inside the statistics, medians over the reps; "other": the rest of stats_s
        "statistics_ms_per_layer_sequence": _parts_ms(calib_runs),
        "store_write_share": w, "store_write_share_target": 0.05, "store_write_share_met": w < 0.05,
        "store_writer_busy_share": wb,
        "checksum_share": ck, "checksum_share_target": 0.02, "checksum_share_met": ck < 0.02,
        "verify_share": vf,  # re-reading + hashing every done block (resume / inspect / fit), vs calibrating it
        "store_create_s": statistics.median(r["create_s"] for r in calib_runs),
        # glibc keeps freed memory (oscar.common.keep_freed_memory, as `oscar calibrate` runs): without it the
        # capture's forward page-faulted its activations in again at every layer
        "keep_freed_memory": kept,
        "page_faults_and_system_time": kernel,
        "runs": {"plain_s": plain_s, "calibrate": calib_runs, **({"plain_native_attention_s": attn_s} if attn_s else {})},
        "machine": {"cpus": os.cpu_count(), "torch_threads": threads, "loadavg_start": load0,
                    "loadavg_end": os.getloadavg(), "platform": platform.platform(), "torch": torch.__version__,
                    "device": "cpu"},
        "model_load_s": load_s,
        "command": "python bench/calibrate.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                          if k not in ("out", "as_avx2", "capture_attention"))
                   + (" --capture-attention sdpa" if args.capture_attention == "sdpa" else "")
                   + (" --as-avx2" if args.as_avx2 else ""),
    }
    out = Path(args.out)
    try:
        runs = json.loads(out.read_text())["runs"]
    except (OSError, ValueError, KeyError):  # none yet: started afresh
        runs = {}
    runs[f"{res['host']} / {args.blocks} x {args.seqs} x {args.seq_len}"
         + (" / capture on sdpa" if args.capture_attention == "sdpa" else "")] = res
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("plain_forward_tokens_per_s", "calibrate_tokens_per_s", "throughput_ratio",
                                          "throughput_ratio_per_rep", "statistics_share",
                                          "statistics_ms_per_layer_sequence", "store_write_share",
                                          *(("attention_speedup", "capture_overhead_ratio") if attn_s else ()),
                                          "store_writer_busy_share", "checksum_share", "verify_share")}, indent=2))


def _parts_ms(calib_runs: list[dict]) -> dict:
    """Medians over the reps of each part's ms per (layer, sequence); empty where the C kernel did not run."""
    per = []
    for r in calib_runs:
        n = r["parts"]["layer_sequences"]
        if not n:  # the torch-ops path: no per-call count to divide by
            continue
        ms = {k: 1e3 * v / n for k, v in r["parts"]["s"].items()}
        ms["other"] = 1e3 * r["stats_s"] / n - sum(ms.values())
        ms["all"] = 1e3 * r["stats_s"] / n
        per.append(ms)
    return {k: statistics.median(p[k] for p in per) for k in per[0]} if per else {}


if __name__ == "__main__":
    main()
