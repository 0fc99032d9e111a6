"""Decode attention benchmark: the INT2 paged cache vs a float cache, ratios measured in one run.

CPU (default when no GPU): the reference decode path (what `dispatch` runs on CPU)
at 8k context vs `scaled_dot_product_attention` on the dequantized equivalent
float32 (and bf16) cache, timings interleaved rep by rep so machine load hits both
alike. Target: ratio <= 3.

CUDA: the fused Triton kernel at batch 1 and 32, contexts 4k..128k, vs BF16 SDPA
(and FlashInfer's paged BF16 decode if importable), with achieved bandwidth on the
bytes the kernel must read (codes + scales + BF16 sink/ring + block tables) against
the device's peak and against a measured device-to-device copy.
Targets: >= 70% of peak at >= 32k, faster than BF16 SDPA from 16k up.

    python bench/decode.py                      # CPU -> bench/results/decode_cpu.json
    python bench/decode.py --device cuda --out $OUT/decode_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from oscar.kernels import reference as ref
from oscar.kernels.dispatch import quantize_pages
from oscar.kernels.paged import PagedConfig, PagedLayerCache, layout
from oscar.kernels.rotation import LayerRotation
from oscar.stats.artifact import QuantConfig

HERE = Path(__file__).resolve().parent

# shapes: (name, Hkv, G = Hq / Hkv, D)
SMOLLM2 = ("smollm2-135m", 3, 3, 64)
GLM47 = ("glm-4.7", 8, 12, 128)


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE, capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:  # not a git checkout (e.g. a copied tree)
        return os.environ.get("OSCAR_COMMIT", "unknown")


def random_rotation(H: int, D: int, device, seed: int = 0) -> LayerRotation:
    g = torch.Generator().manual_seed(seed)
    r = lambda: torch.linalg.qr(torch.randn(H, D, D, generator=g))[0]  # noqa: E731
    return LayerRotation(rot_k=r().to(device), rot_v=r().to(device), clip_k=torch.full((H,), 0.9, device=device),
                         clip_v=torch.full((H,), 0.9, device=device), k_mean=torch.randn(H, D, generator=g).to(device))


def build_cache(H, D, batch, context, device, mode="minmax", key_axis="token", seed=0,
                param_dtype=torch.float16) -> tuple[PagedLayerCache, list[int]]:
    """One layer's cache with `batch` sequences of `context` tokens, each on its own pages."""
    quant = QuantConfig(mode=mode, key_axis=key_axis, param_dtype=str(param_dtype).removeprefix("torch."))
    cfg = PagedConfig(quant, H, D, num_pages=batch * (context // 16 + 1), max_seqs=batch, device=device)
    c = PagedLayerCache(cfg, random_rotation(H, D, device, seed), quantizer=quantize_pages)
    g = torch.Generator(device=device).manual_seed(seed)
    seqs = []
    for _ in range(batch):
        s = c.new_sequence()
        for lo in range(0, context, 16384):  # chunks keep the float32 staging small
            t = min(16384, context - lo)
            c.append(s, torch.randn(H, t, D, generator=g, device=device) * 2, torch.randn(H, t, D, generator=g, device=device))
        seqs.append(s)
    return c, seqs


def kernel_bytes(c: PagedLayerCache, seqs: list[int]) -> int:
    """Bytes decode attention must read: INT2 codes, per-page metadata, sink + ring, block tables."""
    cfg = c.cfg
    H, D, P = cfg.num_kv_heads, cfg.head_dim, cfg.quant.page_size
    esz = torch.finfo(cfg.dtype).bits // 8
    total = 0
    for s in seqs:
        lay = layout(c.lengths[s], cfg)
        n_hist = lay.num_pages * P
        total += 2 * n_hist * H * cfg.packed_dim  # K and V codes
        if cfg.quant.mode != "static":
            k_meta = lay.num_pages * H * D if cfg.quant.key_axis == "channel" else n_hist * H * cfg.groups
            total += 2 * c.k_scale.element_size() * (k_meta + n_hist * H * cfg.groups)  # scale + zero, K and V
        total += 2 * (lay.sink_len + lay.ring_len) * H * D * esz
        total += 4 * lay.num_pages
    return total


def interleaved(fns: dict, reps: int) -> dict:
    """Median seconds of each fn, timed in turn rep by rep (robust to load drift): both the
    process CPU time (immune to preemption on a shared machine; counts every thread)
    and wall time."""
    for f in fns.values():
        f()
    cpu = {k: [] for k in fns}
    wall = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0, w0 = time.process_time(), time.perf_counter()
            f()
            cpu[k].append(time.process_time() - t0)
            wall[k].append(time.perf_counter() - w0)
    return {k: statistics.median(v) for k, v in cpu.items()}, {k: statistics.median(v) for k, v in wall.items()}


# ------------------------------------------------------------------ CPU
def bench_cpu(context: int, reps: int, threads: int, shapes) -> list[dict]:
    torch.set_num_threads(threads)
    rows = []
    for name, H, G, D in shapes:
        c, seqs = build_cache(H, D, 1, context, "cpu")
        q = torch.randn(1, H * G, D)
        k, v = ref.dequantize_sequence(c, seqs[0], dtype=torch.float32)  # the equivalent float cache (Hkv, n, D)
        k32, v32 = k[None], v[None]
        k16, v16 = k32.bfloat16(), v32.bfloat16()
        q4 = q[:, :, None]  # (1, Hq, 1, D)
        sdpa = lambda kk, vv, qq: F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)  # noqa: E731
        o_ref = ref.decode_attention(q, c, seqs)
        o_sdpa = sdpa(k32, v32, q4)[:, :, 0]
        err = (o_ref - o_sdpa).abs().max().item()
        t, wall = interleaved({
            "reference_int2": lambda: ref.decode_attention(q, c, seqs),
            "sdpa_fp32": lambda: sdpa(k32, v32, q4),
            "sdpa_bf16": lambda: sdpa(k16, v16, q4.bfloat16()),
        }, reps)
        row = {
            "shape": name, "kv_heads": H, "q_heads": H * G, "head_dim": D, "context": context, "batch": 1,
            "format": "int2 minmax token groups (G=D), sink 64, recent 256, page 16, rotation + key mean",
            "cpu_ms": {k: round(v * 1e3, 3) for k, v in t.items()},
            "wall_ms": {k: round(v * 1e3, 3) for k, v in wall.items()},
            "ratio_vs_sdpa_fp32": round(t["reference_int2"] / t["sdpa_fp32"], 3),  # on CPU time
            "wall_ratio_vs_sdpa_fp32": round(wall["reference_int2"] / wall["sdpa_fp32"], 3),
            "ratio_vs_sdpa_bf16": round(t["reference_int2"] / t["sdpa_bf16"], 3),
            "max_abs_diff_vs_sdpa_fp32": err,
            "target_ratio": 3.0,
        }
        row["target_met_vs_sdpa_fp32"] = row["ratio_vs_sdpa_fp32"] <= 3.0
        row["target_met_vs_sdpa_bf16"] = row["ratio_vs_sdpa_bf16"] <= 3.0
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# ------------------------------------------------------------------ CUDA
def peak_bandwidth(device) -> tuple[float | None, str]:
    p = torch.cuda.get_device_properties(device)
    clock, bus = getattr(p, "memory_clock_rate", None), getattr(p, "memory_bus_width", None)
    if clock and bus:  # kHz, bits; double data rate
        return 2.0 * clock * 1e3 * bus / 8, "device properties (2 x memory_clock_rate x bus_width)"
    table = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100": 3.35e12, "B200": 8.0e12, "A100": 2.0e12, "L40S": 0.864e12}
    for k, v in table.items():
        if k in p.name:
            return v, f"spec sheet for {k}"
    return None, "unknown device"


def copy_bandwidth(device) -> float:
    import triton.testing

    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * x.numel() / (ms * 1e-3)


def flashinfer_decode(q, k, v, page_size=16):
    """A BF16 paged decode with FlashInfer (None if not importable). k, v: (B, Hkv, n, D)."""
    try:
        import flashinfer
    except Exception:
        return None
    B, H, n, D = k.shape
    Hq = q.shape[1]
    npg = -(-n // page_size)
    pad = npg * page_size - n
    kp = F.pad(k, (0, 0, 0, pad)).reshape(B, H, npg, page_size, D).permute(0, 2, 1, 3, 4)  # (B, np, H, P, D)
    vp = F.pad(v, (0, 0, 0, pad)).reshape(B, H, npg, page_size, D).permute(0, 2, 1, 3, 4)
    kv = torch.stack([kp, vp], 2).reshape(B * npg, 2, H, page_size, D).contiguous()  # HND pages
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=Hq // H >= 4)
    indptr = torch.arange(B + 1, dtype=torch.int32, device=q.device) * npg
    indices = torch.arange(B * npg, dtype=torch.int32, device=q.device)
    last = torch.full((B,), n - (npg - 1) * page_size, dtype=torch.int32, device=q.device)
    w.plan(indptr, indices, last, Hq, H, D, page_size, pos_encoding_mode="NONE", data_type=torch.bfloat16,
           q_data_type=torch.bfloat16)
    return lambda: w.run(q, kv)


def bench_cuda(contexts, batches, shape, tune: bool, dry_run: bool = False, param_dtype=torch.float16,
               on_row=None) -> dict:
    """dry_run: the same code path on CPU under TRITON_INTERPRET=1 with tiny sizes (checks the script, times nothing real).
    on_row(result so far): called after every row, so a run stopped by its time limit keeps what it measured."""
    import triton.testing

    from oscar.kernels.triton_decode import DecodeConfig, decode_attention

    dev = torch.device("cpu" if dry_run else "cuda")
    name, H, G, D = shape
    if dry_run:
        peak, peak_src, copy_bw, dev_name = None, "dry run", 1.0, "cpu (TRITON_INTERPRET dry run)"
        bench = lambda f: interleaved({"f": f}, 1)[1]["f"] * 1e3  # noqa: E731
    else:
        peak, peak_src = peak_bandwidth(dev)
        copy_bw, dev_name = copy_bandwidth(dev), torch.cuda.get_device_name(dev)
        bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=50)  # noqa: E731  ms, L2 flushed between runs
    out = {"device": dev_name, "peak_bandwidth_Bps": peak, "peak_source": peak_src,
           "copy_bandwidth_Bps": copy_bw, "shape": name, "kv_heads": H, "q_heads": H * G, "head_dim": D, "rows": []}
    config = DecodeConfig()
    if tune:  # a small sweep at 32k, batch 1; the best config is used for the table
        c, seqs = build_cache(H, D, 1, max(contexts) if dry_run else 32768, dev, param_dtype=param_dtype)
        q = torch.randn(1, H * G, D, device=dev, dtype=torch.bfloat16)
        sweep = []
        for bn in ((32,) if dry_run else (32, 64, 128)):
            for nw in ((4,) if dry_run else (4, 8)):
                cfgx = DecodeConfig(block_n=bn, num_warps=nw)
                try:
                    ms = bench(lambda: decode_attention(q, c, seqs, config=cfgx))
                except Exception as e:  # a config that does not compile or fit
                    sweep.append({"block_n": bn, "num_warps": nw, "error": str(e)[:200]})
                    continue
                sweep.append({"block_n": bn, "num_warps": nw, "ms": ms})
        best = min((s for s in sweep if "ms" in s), key=lambda s: s["ms"])
        config = DecodeConfig(block_n=best["block_n"], num_warps=best["num_warps"])
        out["tune_sweep_32k_b1"] = sweep
        del c
    out["config"] = {"block_n": config.block_n, "num_warps": config.num_warps, "num_stages": config.num_stages,
                     "dot_fp16": config.dot_fp16}
    for B in batches:
        for n in contexts:
            row = {"batch": B, "context": n}
            c = seqs = k = v = fi = None
            try:
                c, seqs = build_cache(H, D, B, n, dev, param_dtype=param_dtype)
                q = torch.randn(B, H * G, D, device=dev, dtype=torch.bfloat16)
                ms = bench(lambda: decode_attention(q, c, seqs, config=config))
                nbytes = kernel_bytes(c, seqs)
                row.update(int2_ms=ms, int2_bytes=nbytes, int2_bandwidth_Bps=nbytes / (ms * 1e-3))
                if peak:
                    row["int2_fraction_of_peak"] = row["int2_bandwidth_Bps"] / peak
                row["int2_fraction_of_copy"] = row["int2_bandwidth_Bps"] / copy_bw
                # correctness on the benchmarked cache: fused kernel vs torch reference
                o = decode_attention(q[:1].float(), c, seqs[:1], config=config)
                o_ref = ref.decode_attention(q[:1].float(), c, seqs[:1])
                row["max_abs_diff_vs_reference"] = (o - o_ref).abs().max().item()
                del c
                if not dry_run:
                    torch.cuda.empty_cache()
                k = torch.randn(B, H, n, D, device=dev, dtype=torch.bfloat16)
                v = torch.randn(B, H, n, D, device=dev, dtype=torch.bfloat16)
                q4 = q[:, :, None]
                try:  # its own try: an SDPA OOM must not lose the INT2 figures
                    ms_sdpa = bench(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))
                    row.update(sdpa_bf16_ms=ms_sdpa, sdpa_bf16_bandwidth_Bps=2 * k.numel() * 2 / (ms_sdpa * 1e-3),
                               speedup_vs_sdpa_bf16=ms_sdpa / ms)
                except Exception as e:
                    row["sdpa_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                try:
                    fi = flashinfer_decode(q, k, v)
                    if fi is not None:
                        ms_fi = bench(fi)
                        row.update(flashinfer_bf16_ms=ms_fi, speedup_vs_flashinfer_bf16=ms_fi / ms)
                    del fi
                except Exception as e:
                    row["flashinfer_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                del k, v
            except Exception as e:  # OOM or a kernel failure: record it, keep going
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            c = seqs = k = v = fi = None  # drop this row's buffers before the next one is built
            if not dry_run:
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            out["rows"].append(row)
            if on_row:
                on_row(out)
    rows = [r for r in out["rows"] if "int2_ms" in r]
    out["targets"] = {
        "fraction_of_peak_ge_0.7_at_ge_32k": all(r.get("int2_fraction_of_peak", 0) >= 0.7 for r in rows if r["context"] >= 32768),
        "faster_than_sdpa_bf16_from_16k": all(r.get("speedup_vs_sdpa_bf16", 0) > 1 for r in rows if r["context"] >= 16384),
        # None when FlashInfer was not importable or 64k batch 1 did not run
        "faster_than_flashinfer_bf16_at_64k_b1": next((r["speedup_vs_flashinfer_bf16"] > 1 for r in rows
                                                       if (r["context"], r["batch"]) == (65536, 1)
                                                       and "speedup_vs_flashinfer_bf16" in r), None),
    }
    return out


def plot_cuda(result: dict, path: Path) -> None:
    """Latency vs context (INT2 fused, BF16 SDPA, FlashInfer) and INT2 bandwidth / peak, per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "int2_ms" in r]
    batches = sorted({r["batch"] for r in rows})
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for B in batches:
        rs = sorted((r for r in rows if r["batch"] == B), key=lambda r: r["context"])
        x = [r["context"] for r in rs]
        axes[0].plot(x, [r["int2_ms"] for r in rs], "o-", label=f"INT2 fused, B={B}")
        if all("sdpa_bf16_ms" in r for r in rs):
            axes[0].plot(x, [r["sdpa_bf16_ms"] for r in rs], "s--", label=f"BF16 SDPA, B={B}")
        if all("flashinfer_bf16_ms" in r for r in rs):
            axes[0].plot(x, [r["flashinfer_bf16_ms"] for r in rs], "^:", label=f"FlashInfer BF16, B={B}")
        frac = [r.get("int2_fraction_of_peak", r["int2_fraction_of_copy"]) for r in rs]
        axes[1].plot(x, frac, "o-", label=f"B={B}")
    axes[0].set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode attention, one layer (ms)",
                title=f"{result['shape']} on {result['device']}")
    axes[1].axhline(0.7, color="gray", ls="--", lw=1)
    axes[1].set(xscale="log", ylim=(0, 1.05), xlabel="context (tokens)", ylabel="achieved / peak bandwidth",
                title="INT2 kernel bandwidth (bytes it must read)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/decode_<device>.json)")
    ap.add_argument("--context", type=int, default=8192, help="CPU context")
    ap.add_argument("--reps", type=int, default=30, help="CPU interleaved repetitions")
    ap.add_argument("--threads", type=int, default=1, help="CPU torch threads (1: stable on a shared machine)")
    ap.add_argument("--contexts", default="4096,16384,32768,65536,131072")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--shape", choices=["smollm2", "glm"], default=None)
    ap.add_argument("--param-dtype", choices=["float16", "float8_e4m3fn"], default="float16",
                    help="CUDA: scale/zero storage of the INT2 pages (float8_e4m3fn: 8-bit, the 1/7 memory mode)")
    ap.add_argument("--dry-run", action="store_true", help="run the CUDA code path on CPU (TRITON_INTERPRET=1), tiny sizes")
    args = ap.parse_args(argv)
    out_path = Path(args.out or HERE / "results" / f"decode_{args.device}.json")
    meta = {"commit": commit(), "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "argv": sys.argv[1:], "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.dry_run:
        args.device = "cuda"
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--dry-run needs TRITON_INTERPRET=1")
    if args.device == "cpu":
        shapes = {"smollm2": [SMOLLM2], "glm": [GLM47]}.get(args.shape, [SMOLLM2, GLM47])
        result = dict(meta, threads=args.threads, rows=bench_cpu(args.context, args.reps, args.threads, shapes))
    else:
        shape = GLM47 if args.shape != "smollm2" else SMOLLM2
        out_path.parent.mkdir(parents=True, exist_ok=True)
        partial = lambda r: out_path.write_text(json.dumps(dict(meta, **r, partial=True), indent=2))  # noqa: E731
        result = dict(meta, **bench_cuda([int(x) for x in args.contexts.split(",")], [int(x) for x in args.batches.split(",")],
                                         shape, tune=not args.no_tune, dry_run=args.dry_run,
                                         param_dtype=getattr(torch, args.param_dtype), on_row=partial),
                      param_dtype=args.param_dtype)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {out_path}")
    if args.device == "cuda":
        plot_cuda(result, out_path.with_suffix(".png"))
        print(f"wrote {out_path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
