"""End-to-end GPU checks on random-init models with GLM-4.7's shapes (no weights, no downloads).

decode     A random-init Glm4MoeForCausalLM with GLM-4.7's attention (96 query / 8 KV heads,
           head_dim 128, partial RoPE, q/k norm, qkv bias) and full hidden/MLP/vocab sizes, cut to
           --layers dense layers. Per context (32k, 128k): chunked prefill into an OscarCache
           (random orthogonal rotations + key means, the shipped quant defaults: sink 64, recent
           256, pages of 16, INT2 per-token groups), then timed decode steps of the whole model,
           against the same model decoding with transformers' DynamicCache in BF16 (SDPA), in the
           same run. Reports ms/step, the ratio, and cache bytes vs the BF16 cache.
calibrate  GLM-4.7's full layer shapes cut to its first --layers layers (3 dense, then MoE with
           160 experts, top-8), saved as sharded safetensors, calibrated on CUDA by two pipeline
           stages (the stage-actor class of oscar.cluster), each loading only its own layers'
           keys. Through Ray when `ray` imports (a local 1-GPU head, half a GPU per stage);
           otherwise the same StageWorker objects are driven in-process, block by block and
           micro-batch by micro-batch, as the Ray driver would, and the JSON says so
           (`"ray": false`). Reports tokens/s, expert token counts, and per stage the resident
           parameter bytes and peak memory against `oscar plan`'s prediction for the same cut.

calibrate-fp8
           The same cut (default 1 dense + 1 MoE layer, --experts 16 to bound the disk) written in GLM-4.7-FP8's
           block-FP8 layout (float8_e4m3fn decoder weights, a float32 weight_scale_inv per 128x128 block,
           per-expert keys; tests/helpers/fp8.py) and as its dequantized BF16 twin; both calibrated by two
           stages on CUDA as above. Reports the largest relative difference between the two stores' arrays
           (each stage dequantizes its own layers' FP8 weights at load: 0 expected), and the checkpoint sizes.

needles    The same cut (--layers dense layers, GLM-4.7's attention) decoding a needle batch through two pipeline
           stages on the device (cluster/scoring.py `StagedScorer`: a local Ray head, half a GPU per stage, each
           stage keeping its own layers' rows of the batch's INT2 cache), bf16 and an INT2 method (random
           rotations) for --samples random-token prompts of --context tokens, --new tokens each; the same batch in
           one process on the same device (`validate.niah.decode_batch`). Reports how many answers agree and the
           stages' and the process's wall time per batch. Without Ray (the GPU image has none) the same stage
           objects and driver run in this process (`"ray": false`). --engine cache: the product cache instead,
           each stage keeping its own layers' OscarCache (the Triton kernels on CUDA) per (sample, method) row,
           against `scoring.engine.niah_answers` in one process.

latent     GLM-5's MLA attention shapes (64 heads, kv_lora_rank 512, RoPE key 64), random data: one decode step of
           the Triton latent kernel (kernels/triton_latent.py: INT2 latent history, exact sinks + recent window,
           absorbed form) against the torch reference (kernels/latent.py) at each of --contexts; error and ms/step.

--dry-run runs each on CPU with tiny sizes (what tests/test_gpu_scripts.py does), so the script
keeps working between GPU sessions.

    python bench/gpu_e2e.py decode --out $OUT/e2e_decode.json
    python bench/gpu_e2e.py calibrate --out $OUT/e2e_calibrate.json
    python bench/gpu_e2e.py calibrate-fp8 --out $OUT/e2e_calibrate_fp8.json
    python bench/gpu_e2e.py needles --out $OUT/e2e_needles.json
    python bench/gpu_e2e.py needles --engine cache --out $OUT/e2e_needles_cache.json
    python bench/gpu_e2e.py latent --contexts 4096,32768 --out $OUT/e2e_latent.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from decode import commit  # noqa: E402  (bench/decode.py: the git commit, or OSCAR_COMMIT)


def glm47_cut(layers: int, dense: int, dry_run: bool):
    """GLM-4.7's config with `layers` layers of which the first `dense` are dense (tiny when dry_run)."""
    from oscar.cluster.plan import load_model_config

    c = load_model_config("glm-4.7")
    c.num_hidden_layers, c.first_k_dense_replace, c.num_nextn_predict_layers = layers, dense, 0
    if dry_run:  # the same architecture at toy size; 49152 = the SmolLM2 tokenizer the corpus uses
        c.hidden_size, c.intermediate_size, c.moe_intermediate_size = 128, 256, 32
        c.num_attention_heads, c.num_key_value_heads, c.head_dim = 12, 2, 64
        c.n_routed_experts, c.num_experts_per_tok, c.vocab_size = 8, 2, 49152
    c.pad_token_id, c.eos_token_id = 0, 0
    return c


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def random_artifact(config, seed: int = 0):
    """Random orthogonal key/value rotations and key means (every rotation term of the cache is exercised)."""
    from oscar.stats.artifact import identity_artifact

    art = identity_artifact(config, variant="random-gpu-check")
    g = torch.Generator().manual_seed(seed)
    H, D = art.num_kv_heads, art.head_dim
    orth = lambda: torch.linalg.qr(torch.randn(H, D, D, generator=g, dtype=torch.float64))[0].float()  # noqa: E731
    art.rot_k = [orth() for _ in range(art.num_layers)]
    art.rot_v = [orth() for _ in range(art.num_layers)]
    art.k_mean = [0.3 * torch.randn(H, D, generator=g) for _ in range(art.num_layers)]
    return art


def decode_steps(model, cache, token: torch.Tensor, steps: int, dev: torch.device) -> tuple[list[float], torch.Tensor]:
    """Wall ms of each greedy decode step of the whole model (token (1, 1)) and the last logits."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.x renamed it
    times = []
    with torch.no_grad():
        for _ in range(steps):
            sync(dev)
            t0 = time.perf_counter()
            logits = model(input_ids=token, use_cache=True, **{name: cache}).logits[:, -1]  # (1, V)
            sync(dev)
            times.append((time.perf_counter() - t0) * 1e3)
            token = logits.argmax(-1, keepdim=True)
    return times, logits


def timed_run(model, cache, ids: torch.Tensor, args, dev: torch.device, tag: str) -> dict:
    """Chunked prefill of ids (1, n) into `cache`, then args.steps timed greedy decode steps."""
    from oscar.kernels.generation import prefill

    sync(dev)
    t0 = time.perf_counter()
    logits = prefill(model, cache, ids, chunk=args.chunk)
    sync(dev)
    prefill_s = time.perf_counter() - t0
    ms, last = decode_steps(model, cache, logits.argmax(-1, keepdim=True), args.steps, dev)
    return {f"{tag}_prefill_s": prefill_s, f"{tag}_step_ms": statistics.median(ms[1:] or ms),  # step 1 may compile
            f"{tag}_first_step_ms": ms[0], f"{tag}_logits_finite": bool(torch.isfinite(last).all())}


def bench_decode(args, dev: torch.device, on_row=None) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache

    from oscar.kernels.cache import OscarCache

    cfg = glm47_cut(args.layers, args.layers, args.dry_run)  # dense layers: the attention is what is measured
    torch.manual_seed(0)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    art = random_artifact(cfg)
    contexts = [int(x) for x in args.contexts.split(",")]
    out = {"model": "glm-4.7 attention shape, random init", "layers": cfg.num_hidden_layers,
           "q_heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
           "hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "quant": dict(vars(art.quant)), "rows": []}
    for n in contexts:
        row = {"context": n}
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(dev)
        for tag in ("oscar", "bf16"):
            try:
                if tag == "oscar":
                    cache = OscarCache.from_artifact(model, art, max_len=n + args.steps + 8)
                else:
                    model.set_attn_implementation("sdpa")
                    cache = DynamicCache(config=cfg)
                row.update(timed_run(model, cache, ids, args, dev, tag))
                if tag == "oscar":
                    row["oscar_cache_bytes"] = int(sum(cache.memory().values()))
                    row["bf16_cache_bytes"] = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
                                               * 2 * (n + args.steps))  # K and V, 2 bytes
                    row["cache_ratio_vs_bf16"] = row["oscar_cache_bytes"] / row["bf16_cache_bytes"]
                    cache.release()
                del cache
            except Exception as e:  # record and keep going: the other cache's figures still tell something
                row[f"{tag}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if "oscar_step_ms" in row and "bf16_step_ms" in row:
            row["speedup_vs_bf16"] = row["bf16_step_ms"] / row["oscar_step_ms"]
        if dev.type == "cuda":
            row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
        if on_row:  # a run stopped by its time limit keeps the contexts it measured
            on_row(out)
    return out


# ------------------------------------------------------------------ calibration
def save_random_model(cfg, d: str, dev: torch.device) -> None:
    """Random-init weights of `cfg` (bf16) as sharded safetensors cut at layer boundaries + the SmolLM2 tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oscar.pipeline.models import _save_sharded

    tok_dir = os.environ.get("OSCAR_TOKENIZER_DIR")  # carried to the GPU machine (bench/gpu_prepare.sh)
    if tok_dir:
        tok = AutoTokenizer.from_pretrained(tok_dir)
    else:
        from oscar.pipeline.models import load_tokenizer

        tok = load_tokenizer("smollm2-135m")
    torch.manual_seed(0)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    _save_sharded(model.cpu(), tok, d, layers_per_shard=1)
    del model


def drive_in_process(store_path: str, model_dir: str, ranges, dev: torch.device, micro_batch: int) -> dict:
    """The Ray driver's block loop without Ray: the same StageWorker objects, chained in one process."""
    import uuid

    from oscar.cluster.actors import StageArgs, StageWorker
    from oscar.cluster.pipeline import _ensure_expert_arrays, job_id_for
    from oscar.pipeline.store import CalibStore, WriterLock

    store = CalibStore(store_path, mode="r+")
    job = f"{job_id_for(store_path)}-{uuid.uuid4().hex[:8]}"
    lock = WriterLock(store_path, range(store.num_layers), job=job).acquire()
    _ensure_expert_arrays(store, model_dir, list(range(store.num_layers)))
    workers, stages = [], []
    try:
        for i, (a, b) in enumerate(ranges):
            before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            w = StageWorker(StageArgs(model_dir=model_dir, start=a, stop=b, store=store_path, job=job,
                                      sink=store.meta.sink, reservoir=store.meta.reservoir,
                                      seqs_per_block=store.meta.seqs_per_block, dtype="bfloat16",
                                      device=dev.type, stage=i))
            resident = (torch.cuda.memory_allocated(dev) - before) if dev.type == "cuda" else None
            workers.append(w)
            stages.append({"stage": i, "layers": [a, b], "resident_bytes": resident, "peak_bytes": 0,
                           "load_seconds": w.stats.load_seconds, "loaded_keys": len(w.report.keys)})
        tokens, masks = store.group["tokens"], store.group["mask"]
        n_tok, t0 = 0, time.perf_counter()
        for blk in store.todo_blocks():
            tok, msk = tokens[blk], masks[blk]  # (S, T)
            rows = [r for r in range(msk.shape[0]) if msk[r].any()]
            n_seq = rows[-1] + 1 if rows else 1
            n_mb = -(-n_seq // micro_batch)
            for m in range(n_mb):
                lo, hi = m * micro_batch, min(n_seq, (m + 1) * micro_batch)
                x = {"input_ids": torch.from_numpy(tok[lo:hi].astype("int64")),
                     "mask": torch.from_numpy(msk[lo:hi].astype("int64"))}
                n_tok += int(x["mask"].sum())
                for i, w in enumerate(workers):
                    if dev.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(dev)
                    x = w.forward(blk, m, lo, x)
                    if dev.type == "cuda":  # this stage's working set on top of what was resident
                        others = sum(s["resident_bytes"] for j, s in enumerate(stages) if j != i)
                        stages[i]["peak_bytes"] = max(stages[i]["peak_bytes"],
                                                      torch.cuda.max_memory_allocated(dev) - others)
            for w in workers:
                w.commit(blk, n_mb)
        sync(dev)
        wall = time.perf_counter() - t0
        for s, w in zip(stages, workers):
            s["busy_seconds"] = w.stats.busy_seconds
        return {"ray": False, "tokens": n_tok, "wall_seconds": wall, "tokens_per_second": n_tok / wall,
                "stages": stages}
    finally:
        for w in workers:
            w.close()
        lock.release()


def calibrate_two_stages(model_dir: str, store: str, ranges, args, dev: torch.device) -> dict:
    """Calibrate `model_dir` into `store` on two stages of `ranges`: through Ray when it imports (and not
    --no-ray), else the same StageWorker objects driven in-process."""
    from oscar.cluster.pipeline import prepare_store
    from oscar.pipeline.calibrate import CalibConfig

    cc = CalibConfig(model=model_dir, store=store, seq_len=args.seq_len, seqs_per_block=args.seqs_per_block,
                     tokens=args.tokens, dtype="bfloat16", device=dev.type, batch_size=args.micro_batch,
                     overwrite=True)
    try:
        import ray  # noqa: F401  (late: optional on the GPU image)
        have_ray = not args.no_ray
    except ImportError:
        have_ray = False
    if have_ray:
        from oscar.cluster.pipeline import ClusterConfig, calibrate_on_ray

        ccl = ClusterConfig(stages=2, layers=",".join(f"{a}:{b}" for a, b in ranges),
                            gpus_per_stage=0.5 if dev.type == "cuda" else 0.0, cpus_per_stage=1.0)
        t1 = time.perf_counter()
        rep = calibrate_on_ray(cc, ccl, address=None, progress=False)
        return {"ray": True, "tokens": rep.tokens, "wall_seconds": time.perf_counter() - t1,
                "tokens_per_second": rep.tokens_per_second, "stages": rep.stage_stats}
    prepare_store(cc)
    return drive_in_process(store, model_dir, ranges, dev, args.micro_batch)


def store_difference(a: str, b: str) -> dict:
    """The largest relative difference between same-named arrays of two stores (max |x - y| / max |y|), and the
    array where it occurs; arrays only one store holds are listed."""
    import numpy as np

    from oscar.pipeline.store import CalibStore

    ga, gb = CalibStore(a).group, CalibStore(b).group
    names = lambda g: {f"{p}/{n}" if p else n for p, n in _arrays(g)}  # noqa: E731
    na, nb = names(ga), names(gb)
    worst, where = 0.0, None
    for name in sorted(na & nb):
        x, y = np.asarray(ga[name][:], dtype=np.float64), np.asarray(gb[name][:], dtype=np.float64)
        if x.shape != y.shape:
            return {"max_rel_diff": float("inf"), "where": f"{name}: shape {x.shape} vs {y.shape}"}
        d = float(np.abs(x - y).max(initial=0.0)) / max(float(np.abs(y).max(initial=0.0)), 1e-300)
        if d > worst:
            worst, where = d, name
    return {"max_rel_diff": worst, "where": where, "arrays": len(na & nb), "only_in_first": sorted(na - nb),
            "only_in_second": sorted(nb - na)}


def _arrays(group, prefix: str = ""):
    for name, arr in group.arrays():
        yield prefix, name
    for name, sub in group.groups():
        yield from _arrays(sub, f"{prefix}/{name}" if prefix else name)


def bench_calibrate_fp8(args, dev: torch.device) -> dict:
    from oscar.cluster.plan import balance_layers, param_bytes

    sys.path.insert(0, str(HERE.parent / "tests"))
    from helpers.fp8 import write_pair  # late: a test helper, found through tests/ on sys.path

    cfg = glm47_cut(args.layers, 1, args.dry_run)
    cfg.n_routed_experts = min(cfg.n_routed_experts, args.experts)
    cfg.num_experts_per_tok = min(cfg.num_experts_per_tok, cfg.n_routed_experts)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="oscar-gpu-fp8-"))
    src, fp8_dir, twin_dir = work / "bf16", work / "fp8", work / "twin"
    t0 = time.perf_counter()
    if not (twin_dir / "config.json").exists():
        src.mkdir(parents=True, exist_ok=True)
        save_random_model(cfg, str(src), dev)
        write_pair(str(src), str(fp8_dir), str(twin_dir), twin_dtype=torch.bfloat16)
    write_s = time.perf_counter() - t0
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    pb = param_bytes(cfg, 2)
    ranges = balance_layers(pb.layers, 2, pb.embed)
    runs = {name: calibrate_two_stages(str(d), str(work / f"{name}.zarr"), ranges, args, dev)
            for name, d in (("fp8", fp8_dir), ("twin", twin_dir))}
    return {"model": "glm-4.7 layer shapes, random init, block-FP8 and its dequantized bf16 twin",
            "layers": cfg.num_hidden_layers, "dense_layers": cfg.first_k_dense_replace,
            "experts": cfg.n_routed_experts, "top_k": cfg.num_experts_per_tok, "ranges": ranges,
            "write_seconds": write_s, "checkpoint_bytes": {"fp8": size(fp8_dir), "twin_bf16": size(twin_dir)},
            "stores": store_difference(str(work / "fp8.zarr"), str(work / "twin.zarr")), "runs": runs}


def bench_calibrate(args, dev: torch.device) -> dict:
    from oscar.cluster.pipeline import unused_experts
    from oscar.cluster.plan import PlanConfig, balance_layers, make_plan, param_bytes
    from oscar.pipeline.store import CalibStore

    cfg = glm47_cut(args.layers, min(3, args.layers - 1), args.dry_run)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="oscar-gpu-e2e-"))
    model_dir, store = work / "model", work / "calib.zarr"
    t0 = time.perf_counter()
    if not (model_dir / "config.json").exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        save_random_model(cfg, str(model_dir), dev)
    save_s = time.perf_counter() - t0
    pb = param_bytes(cfg, 2)
    ranges = balance_layers(pb.layers, 2, pb.embed)
    run = calibrate_two_stages(str(model_dir), str(store), ranges, args, dev)
    s = CalibStore(str(store))
    plan = make_plan(cfg, PlanConfig(stages=2, seq_len=args.seq_len, micro_batch=args.micro_batch,
                                     seqs_per_block=s.meta.seqs_per_block, num_blocks=s.num_blocks, dtype="bfloat16",
                                     layers=",".join(f"{a}:{b}" for a, b in ranges), name="glm-4.7 cut"))
    for st, sp in zip(run["stages"], plan.stages):
        st["plan_param_bytes"], st["plan_peak_bytes"] = sp.param_bytes, sp.peak_bytes
        if st.get("resident_bytes"):
            st["resident_vs_plan_params"] = st["resident_bytes"] / sp.param_bytes
        if st.get("peak_bytes"):
            st["peak_vs_plan_peak"] = st["peak_bytes"] / sp.peak_bytes
    moe = [l for l in range(cfg.num_hidden_layers) if l >= cfg.first_k_dense_replace]
    counts = {}
    for l in moe:
        name = f"layers/{l}/expert_tokens"
        if name in s.group:
            c = s.group[name][:].sum(0)
            counts[str(l)] = {"experts": int(c.size), "min": int(c.min()), "max": int(c.max()),
                              "total": int(c.sum()), "unused": int((c == 0).sum())}
    return {"model": "glm-4.7 layer shapes, random init", "layers": cfg.num_hidden_layers,
            "dense_layers": cfg.first_k_dense_replace, "experts": cfg.n_routed_experts,
            "top_k": cfg.num_experts_per_tok, "ranges": ranges, "blocks_done": int(s.done().all(1).sum()),
            "save_seconds": save_s, "expert_tokens": counts, "unused_experts": unused_experts(s, moe), **run}


def bench_needles(args, dev: torch.device) -> dict:
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from oscar.cluster.pipeline import ClusterConfig, stage_ranges
    from oscar.cluster.scoring import Calls, ScoreArgs, ScoreStage, StagedScorer, cache_needle_batch, needle_batch
    from oscar.scoring import engine
    from oscar.scoring.protocols import PROTOCOLS
    from oscar.validate.niah import decode_batch
    from oscar.scoring.prefill import PrefillPool

    cfg = glm47_cut(args.layers, args.layers, args.dry_run)  # dense layers: the attention is what is checked
    work = Path(args.workdir or tempfile.mkdtemp(prefix="oscar-gpu-needles-"))
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        save_random_model(cfg, str(model_dir), dev)
    art = random_artifact(cfg)
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    haystack = ids(args.context)  # the samples share their haystack up to a per-sample tail: prefixes reused
    samples = [SimpleNamespace(context_ids=haystack[:-32] + ids(32), question_ids=ids(12), max_new_tokens=args.new)
               for _ in range(args.samples)]
    names = [["bf16", "int2"]] * len(samples)
    eos: set[int] = set()  # random weights: every row decodes its whole budget (the decode time is per token)

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(dev).eval()
    t0 = time.perf_counter()
    groups = [[None, art]] * len(samples)
    with torch.no_grad():
        one = (engine.niah_answers(model, samples, groups, names, PROTOCOLS["serving"], eos) if args.engine == "cache"
               else decode_batch(model, samples, groups, PROTOCOLS["serving"], PrefillPool(model), eos))
    sync(dev)
    one_s = time.perf_counter() - t0
    del model
    cc = ClusterConfig(stages=2, cpus_per_stage=1.0, gpus_per_stage=0.5 if dev.type == "cuda" else 0.0,
                       dtype="bfloat16")
    arts = {"bf16": None, "int2": art}

    def timed(run) -> tuple:
        t1 = time.perf_counter()
        run(samples[:1], names[:1])  # warm-up: the stages' first kernels, not timed
        t2 = time.perf_counter()
        out, cost = run(samples, names)
        return out, cost, t2 - t1, time.perf_counter() - t2

    try:
        import ray  # noqa: F401  (late: optional on the GPU image)
        have_ray = not args.no_ray
    except ImportError:
        have_ray = False
    if have_ray:
        with StagedScorer(str(model_dir), cc, address=None) as sc:
            sc.load(arts)
            two, cost, warm_s, two_s = timed(lambda s_, n_: sc.needle_batch(s_, n_, "serving", eos, engine=args.engine))
            ranges = sc.ranges
    else:  # the same stage objects and driver, called in this process (what Ray transports is checked on CPU)
        ranges = stage_ranges(str(model_dir), cc, cfg.num_hidden_layers)
        stages = [ScoreStage(ScoreArgs(str(model_dir), a, b, stage=i, dtype="bfloat16", device=str(dev)))
                  for i, (a, b) in enumerate(ranges)]
        for st in stages:
            st.load(arts)
        run = cache_needle_batch if args.engine == "cache" else needle_batch
        two, cost, warm_s, two_s = timed(lambda s_, n_: run(stages, s_, n_, "serving", eos, Calls.direct()))
    rows = len(one)
    return {"model": "glm-4.7 attention shapes, random init, dense layers", "layers": cfg.num_hidden_layers,
            "ranges": ranges, "context": args.context, "samples": len(samples), "rows": rows, "new_tokens": args.new,
            "answers_equal": sum(a == b for a, b in zip(one, two)), "tokens_equal": sum(
                x == y for a, b in zip(one, two) for x, y in zip(a, b)), "tokens": sum(len(a) for a in one),
            "one_process_seconds": one_s, "stages_seconds": two_s, "stages_warmup_seconds": warm_s,
            "stages_cpu_seconds": cost["batch_cpu_s"], "ray": have_ray, "engine": args.engine,
            "note": "seconds per batch: prefill of every sample + the rows' greedy decode; answers of random weights "
                    "agree where both sides round alike (bfloat16)"}


def bench_latent(args, dev: torch.device) -> dict:
    """GLM-5's MLA shapes (64 heads, kv_lora_rank 512, a 64-value RoPE key, nope 192, v 256), random data: one decode
    step through the Triton latent kernel (INT2 history, exact sinks + recent window), un-rotated and projected by
    W_UV, against kernels/latent.py's absorbed-form torch reference on the same cache; both timed."""
    from oscar.kernels.latent import absorbed_attention, pack_latents
    from oscar.kernels.triton_latent import LatentDecodeInputs, latent_decode
    from oscar.quant import fake_quant
    from oscar.stats.artifact import LatentQuant

    H, r, P, dn, dv = (64, 512, 64, 192, 256) if dev.type == "cuda" else (4, 256, 32, 32, 32)
    spec, g = LatentQuant().spec(), torch.Generator(device="cpu").manual_seed(0)
    rot, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=torch.float64))
    rot, mean = rot.float().to(dev), (torch.randn(r, generator=g) * 0.1).to(dev)
    w_uk = (torch.randn(H, dn, r, generator=g) * r ** -0.5).to(dev)
    w_uv = (torch.randn(H, dv, r, generator=g) * r ** -0.5).to(dev)
    clip = torch.full((r // 128,), 0.8, device=dev)
    rows = []
    for ctx in [int(x) for x in args.contexts.split(",")]:
        M = min(ctx, 64 + 256)                                                     # sinks + the recent window
        N = ctx - M
        c_rot = torch.randn(1, ctx, r, generator=g).to(dev) * torch.linspace(0.3, 2.0, r, device=dev)
        k_pe = torch.randn(1, ctx, P, generator=g).to(dev).to(torch.bfloat16)
        codes, sc, zr = pack_latents(c_rot[:, M:], spec, clip)
        cache = LatentDecodeInputs(codes, sc.float(), zr.float(), k_pe[:, M:], torch.tensor([N], device=dev),
                                   c_rot[:, :M].contiguous(), k_pe[:, :M], torch.tensor([M], device=dev))
        stored = torch.cat([c_rot[:, :M], fake_quant(c_rot[:, M:], spec, clip)], 1)     # what the codes decode to
        q = torch.randn(1, H, 1, dn + P, generator=g).to(dev)
        kp = torch.cat([k_pe[:, :M], k_pe[:, M:]], 1).float()
        scale = (dn + P) ** -0.5
        mask = torch.ones(1, ctx, dtype=torch.bool, device=dev)

        def ref():
            return absorbed_attention(q, stored, kp, w_uk, w_uv, rot, mean, scale, mask)[:, 0]   # (1, H, v)

        def tri():
            qa = torch.einsum("bhd,hdr->bhr", q[:, :, 0, :dn], w_uk)
            o = latent_decode(qa @ rot, q[:, :, 0, dn:], qa @ mean, cache, scale)
            return torch.einsum("bhr,hvr->bhv", o @ rot.T + mean, w_uv)

        want, got = ref(), tri()
        err = float((got - want).abs().max() / want.abs().max())
        times = {}
        for name, fn in (("torch_reference", ref), ("triton", tri)):
            for _ in range(2 if dev.type == "cuda" else 0):
                fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            for _ in range(5 if dev.type == "cuda" else 1):
                fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times[name] = (time.perf_counter() - t) / (5 if dev.type == "cuda" else 1)
        rows.append({"context": ctx, "history_tokens": N, "max_rel_err": err, "ok": err < 1e-3,
                     "ms_per_step": {k: round(v * 1e3, 3) for k, v in times.items()}})
    return {"shapes": {"heads": H, "kv_lora_rank": r, "rope": P, "nope": dn, "v": dv}, "rows": rows,
            "all_ok": all(r_["ok"] for r_ in rows),
            "note": "one decode step of one layer; the reference reads the dequantized cache in float32 torch ops"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["decode", "calibrate", "calibrate-fp8", "needles", "latent"], help="which check to run")
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (the script's own test)")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers of the cut (default: decode 2 dense; calibrate 4 = 3 dense + 1 MoE; calibrate-fp8 2 = 1 + 1; dry run 2)")
    ap.add_argument("--contexts", default="32768,131072", help="decode: contexts (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=12, help="decode: timed decode steps (default: %(default)s)")
    ap.add_argument("--chunk", type=int, default=8192, help="decode: prefill chunk (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=2048, help="calibrate: tokens per sequence (default: %(default)s)")
    ap.add_argument("--seqs-per-block", type=int, default=4, help="calibrate: sequences per block (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=16384, help="calibrate: corpus tokens (default: %(default)s)")
    ap.add_argument("--micro-batch", type=int, default=1, help="calibrate: sequences per micro-batch (default: %(default)s)")
    ap.add_argument("--no-ray", action="store_true", help="calibrate, needles: drive the stages in-process even if ray imports")
    ap.add_argument("--experts", type=int, default=16,
                    help="calibrate-fp8: routed experts kept of GLM-4.7's 160 (default: %(default)s; bounds the disk)")
    ap.add_argument("--workdir", default=None, help="calibrate, needles: where the model (and store) go (default: a temp dir)")
    ap.add_argument("--context", type=int, default=8192, help="needles: prompt tokens per sample (default: %(default)s)")
    ap.add_argument("--samples", type=int, default=4, help="needles: samples in the batch (default: %(default)s)")
    ap.add_argument("--new", type=int, default=16, help="needles: greedy tokens per row (default: %(default)s)")
    ap.add_argument("--engine", default="simulate", choices=("simulate", "cache"),
                    help="needles: the simulator's row batch, or the product cache per row (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.dry_run:
        dev = torch.device("cpu")
        args.layers = args.layers or 2
        if args.what == "decode" and args.contexts == ap.get_default("contexts"):
            args.contexts, args.steps, args.chunk = "400,700", 3, 256
        if args.what.startswith("calibrate") and args.tokens == ap.get_default("tokens"):
            args.seq_len, args.seqs_per_block, args.tokens = 128, 2, 512
        if args.what == "needles" and args.context == ap.get_default("context"):
            args.context, args.samples, args.new = 300, 2, 4
        if args.what == "latent" and args.contexts == ap.get_default("contexts"):
            args.contexts = "300,500"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device (use --dry-run for the CPU smoke run)", file=sys.stderr)
            return 2
        dev = torch.device("cuda")
        args.layers = args.layers or {"decode": 2, "calibrate": 4, "calibrate-fp8": 2, "needles": 4, "latent": 1}[args.what]
    meta = {"commit": commit(), "torch": torch.__version__, "device": torch.cuda.get_device_name(dev)
            if dev.type == "cuda" else "cpu (dry run)", "argv": sys.argv[1:],
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    partial = lambda r: Path(args.out).write_text(json.dumps(dict(meta, **r, partial=True), indent=2, default=str))  # noqa: E731
    run = {"decode": lambda: bench_decode(args, dev, partial), "calibrate": lambda: bench_calibrate(args, dev),
           "calibrate-fp8": lambda: bench_calibrate_fp8(args, dev), "needles": lambda: bench_needles(args, dev),
           "latent": lambda: bench_latent(args, dev)}[args.what]
    result = dict(meta, **run())
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
