"""How long a few Python steps take right after a large matmul (cold caches) against on their own: the capture's checks
before its C call, a tiny torch op and pure Python.

    python lab/cold_python.py          (as AVX2 only: under oscar.host.avx2_env())
"""
import time, torch, statistics
from oscar.common import set_threads
set_threads()
from oscar.pipeline.capture import _native_ok
from oscar.pipeline import native
native.chosen()
a = torch.randn(2048, 576); w = torch.randn(576, 1536)
src = [torch.randn(9, 2048, 64), torch.randn(3, 2048, 64), torch.randn(3, 2048, 64), torch.randn(2048, 9, 64).transpose(0, 1)]
def t(f, pre):
    xs = []
    for _ in range(50):
        pre()
        t0 = time.perf_counter(); f(); xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e6
nothing = lambda: None
mm = lambda: a @ w
sleep = lambda: time.sleep(0.001)
for name, f in (("native_ok", lambda: _native_ok(src)), ("arange", lambda: torch.arange(64, 2048)), ("py", lambda: sum(range(10)))):
    print(f"{name:10s} alone {t(f, nothing):8.1f} us  after matmul {t(f, mm):8.1f} us  after sleep {t(f, sleep):8.1f} us")
