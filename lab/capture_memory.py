"""Peak RSS, minor faults and system time after each block of a 5-block capture (SmolLM2-135M, 8 x 2,048 tokens per
block), with and without oscar.common.keep_freed_memory:

    python lab/capture_memory.py [--keep]
"""
exec(open("lab/capture_faults.py").read().split("def plain():")[0].replace("plan.tokens[:2], plan.mask[:2]", "plan.tokens[:5], plan.mask[:5]").replace("num_blocks=2", "num_blocks=5"))
import resource
from oscar.common import keep_freed_memory
print("keep", keep_freed_memory() if "--keep" in sys.argv else False)
fb = C.Capture.finish_block
def finish(self, layers=None):
    out = fb(self, layers)
    r = resource.getrusage(resource.RUSAGE_SELF)
    print(f"block done: maxrss {r.ru_maxrss/1024:.0f} MB faults {r.ru_minflt} sys {r.ru_stime:.1f}", flush=True)
    return out
C.Capture.finish_block = finish
path = tmp / "s.zarr"
with WriterLock(path, range(info.num_layers)):
    st = CalibStore.open_or_create(path, meta, tokens, mask)
    r = run_blocks(model, st, batch_size=1, progress=False)
print("wall", r.wall_s)
shutil.rmtree(tmp)
