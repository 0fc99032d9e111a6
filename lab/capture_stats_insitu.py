import time, collections, tempfile, shutil, sys
from pathlib import Path
import numpy as np, torch
from oscar.common import set_threads
from oscar.pipeline import capture as C, native
from oscar.pipeline.calibrate import run_blocks
from oscar.pipeline.corpus import load_corpus, make_blocks
from oscar.pipeline.models import load_model
from oscar.pipeline.store import CalibStore, StoreMeta, WriterLock
set_threads()
T = collections.Counter(); N = collections.Counter()
import resource
F = collections.Counter()
def wrap(obj, name, key):
    f = getattr(obj, name)
    def w(*a, **k):
        m = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        t = time.perf_counter(); r = f(*a, **k); T[key] += time.perf_counter() - t; N[key] += 1
        F[key] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - m; return r
    setattr(obj, name, w)
wrap(native, "sequence", "sequence_kernel"); wrap(C.LayerAccumulator, "_sequence", "sequence")
wrap(C.LayerAccumulator, "update", "update"); wrap(C._BatchContext, "rows", "ctx.rows")
wrap(C.Capture, "record", "record"); wrap(C.Capture, "finish_block", "finish_block")
wrap(C.LayerAccumulator, "arrays", "arrays")
model, tok, info = load_model("smollm2-135m", attn_implementation="sdpa", dtype=torch.float32)
corpus = load_corpus("pydoc")
plan = make_blocks(tok, corpus.calibration, seq_len=2048, seqs_per_block=8)
tokens, mask = plan.tokens[:1], plan.mask[:1]
tmp = Path(tempfile.mkdtemp())
meta = StoreMeta(model={k: getattr(info, k) for k in ("name", "fingerprint", "num_layers", "num_q_heads", "num_kv_heads", "head_dim")},
                 corpus=corpus.to_dict(), seq_len=2048, sink=64, num_blocks=1, seqs_per_block=8, reservoir=256, config={"seed": 0, "bench": True})
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):
    T.clear(); N.clear(); F.clear(); ru0 = resource.getrusage(resource.RUSAGE_SELF)
    path = tmp / f"s{rep}.zarr"
    with WriterLock(path, range(info.num_layers)):
        st = CalibStore.open_or_create(path, meta, tokens, mask)
        r = run_blocks(model, st, batch_size=1, progress=False)
    print(f"wall {r.wall_s:.2f} forward {r.forward_s:.2f} stats {r.stats_s:.2f}  ({r.stats_s/240*1e3:.2f} ms per layer-seq)")
    ru1 = resource.getrusage(resource.RUSAGE_SELF); print("process faults", ru1.ru_minflt - ru0.ru_minflt, "sys s", ru1.ru_stime - ru0.ru_stime)
    for k in T: print(f"  {k:14s} {T[k]:7.3f} s  n={N[k]}  {T[k]/240*1e3:.2f} ms per layer-seq  faults {F[k]/240:.0f}")
shutil.rmtree(tmp)
