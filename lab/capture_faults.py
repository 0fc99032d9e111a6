"""Page faults and system time of a plain forward against the capture (`run_blocks`), SmolLM2-135M, 2 blocks of
8 x 2,048 tokens, alternating; `--keep` first calls oscar.common.keep_freed_memory (as `oscar calibrate` does).

    python lab/capture_faults.py [REPS] [--keep]      (under the AVX2 emulation: oscar.host.avx2_env())
"""
exec(open("lab/capture_stats_insitu.py").read().split("wrap(native")[0])
model, tok, info = load_model("smollm2-135m", attn_implementation="sdpa", dtype=torch.float32)
corpus = load_corpus("pydoc")
plan = make_blocks(tok, corpus.calibration, seq_len=2048, seqs_per_block=8)
tokens, mask = plan.tokens[:2], plan.mask[:2]
base = C.base_model(model)
ids = torch.from_numpy(tokens.reshape(-1, 2048).astype(np.int64)); am = torch.ones_like(ids)
tmp = Path(tempfile.mkdtemp())
meta = StoreMeta(model={k: getattr(info, k) for k in ("name", "fingerprint", "num_layers", "num_q_heads", "num_kv_heads", "head_dim")},
                 corpus=corpus.to_dict(), seq_len=2048, sink=64, num_blocks=2, seqs_per_block=8, reservoir=256, config={"seed": 0, "bench": True})
def plain():
    model.set_attn_implementation("sdpa"); t = time.perf_counter()
    with torch.no_grad():
        for s in range(ids.shape[0]): base(input_ids=ids[s:s+1], attention_mask=am[s:s+1], use_cache=False)
    return time.perf_counter() - t
norec = False
from oscar.common import keep_freed_memory
if "--keep" in sys.argv: print("keep_freed_memory", keep_freed_memory())
if norec:
    C.Capture.record = lambda self, *a, **k: None
    C.Capture.finish_block = lambda self, layers=None: {}
def calib(rep):
    model.set_attn_implementation("sdpa")
    path = tmp / f"s{rep}.zarr"
    with WriterLock(path, range(info.num_layers)):
        st = CalibStore.open_or_create(path, meta, tokens, mask)
        try:
            r = run_blocks(model, st, batch_size=1, progress=False)
        except Exception as e:
            return None, time.perf_counter()
    return r, 0
with torch.no_grad(): base(input_ids=ids[:1, :256], attention_mask=am[:1, :256], use_cache=False)
import resource
def ru():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_minflt, r.ru_stime, r.ru_utime
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 2):
    a = ru(); p = plain(); b = ru()
    print('plain faults %d sys %.1f user %.1f' % (b[0]-a[0], b[1]-a[1], b[2]-a[2]))
    if norec:
        import oscar.pipeline.calibrate as PC
        t = time.perf_counter()
        cap = C.Capture(C.CaptureSpec(9, 3, 64, range(30), sink=64, seqs_per_block=8)); C.install(model); cap.start_block(0)
        with torch.no_grad():
            for s in range(8):
                with cap.batch(am[s:s+1], s): base(input_ids=ids[s:s+1], attention_mask=am[s:s+1], use_cache=False)
        print(f"rep {rep}: plain {p:.2f}  capture-wrapper-no-stats {time.perf_counter()-t:.2f}")
    else:
        a = ru(); r, _ = calib(rep); b = ru()
        print('calib faults %d sys %.1f user %.1f maxrss %.0f MB' % (b[0]-a[0], b[1]-a[1], b[2]-a[2], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024))
        print(f"rep {rep}: plain {p:.2f}  calib wall {r.wall_s:.2f} forward {r.forward_s:.2f} stats {r.stats_s:.2f} forward-stats {r.forward_s - r.stats_s:.2f}")
shutil.rmtree(tmp)
