"""The capture's C kernel (pipeline/_moments.c) against brute-force float64 loops, and its fallback.

Shapes sweep the kernel's paths: head dims that take the 16-wide tiles (16, 48, 64, 128) and the
plain loops (10, 24), row counts that are not multiples of the 64-row block or the 8-row weight
tile, float32 and float64 rows, head-major and token-major (strided) sources.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from oscar.pipeline import capture as C
from oscar.pipeline import native

HAVE_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
needs_kernel = pytest.mark.skipif(not HAVE_CC or os.environ.get("OSCAR_NATIVE") == "0",
                                  reason="no C compiler here: the capture uses torch ops")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def sources(D: int, T: int, dtype, seed: int = 0) -> list[torch.Tensor]:
    """q (3 heads, head-major), k (1 head), o (2 heads, token-major view as the model's output is)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, T, D, generator=g, dtype=dtype) * 2 + 0.5
    k = torch.randn(1, T, D, generator=g, dtype=dtype)
    o = torch.randn(T, 2, D, generator=g, dtype=dtype).transpose(0, 1)     # (2, T, D), row stride 2*D
    return [q, k, o]


@needs_kernel
def test_kernel_builds_here():
    assert native.available(), native.WHY_NOT


@needs_kernel
@pytest.mark.parametrize("D,T,dtype", [(16, 140, torch.float32), (48, 70, torch.float64), (64, 75, torch.float32),
                                       (128, 23, torch.float32), (10, 70, torch.float64), (24, 65, torch.float32)])
def test_gram_moments_vs_loops(D, T, dtype):
    src = sources(D, T, dtype)
    start, stop = 3, T - 1
    H = sum(p.shape[0] for p in src)
    gram, mom, mx = (torch.full(s, torch.nan, dtype=torch.float64) for s in ((H, D, D), (3, H, D), (H, D)))
    native.gram_moments(src, start, stop, gram, mom, mx, threads=2)
    h = 0
    for p in src:
        for hs in range(p.shape[0]):
            rows = [p[hs, t].double().tolist() for t in range(start, stop)]
            G = np.zeros((D, D))
            s1, s3, s4, m2 = np.zeros(D), np.zeros(D), np.zeros(D), np.zeros(D)
            for x in rows:                              # explicit loops over rows and channels
                for i in range(D):
                    s1[i] += x[i]
                    s3[i] += x[i] ** 3
                    s4[i] += x[i] ** 4
                    m2[i] = max(m2[i], x[i] * x[i])
                    for j in range(D):
                        G[i, j] += x[i] * x[j]
            assert rel(gram[h], G) < 1e-13, (h, rel(gram[h], G))
            for got, want in ((mom[0, h], s1), (mom[1, h], s3), (mom[2, h], s4), (mx[h], m2)):
                assert rel(got, want) < 1e-13
            h += 1
    assert torch.equal(gram, gram.mT)


@needs_kernel
@pytest.mark.parametrize("D,T,dtype", [(64, 141, torch.float32), (16, 7, torch.float64), (10, 30, torch.float32)])
def test_value_target_vs_loops(D, T, dtype):
    g = torch.Generator().manual_seed(1)
    H = 2
    k = torch.randn(T, H, D, generator=g, dtype=dtype).transpose(0, 1)      # strided like the model's
    v = torch.randn(H, T, D, generator=g, dtype=dtype)
    a = torch.randn(H, D, D, generator=g, dtype=torch.float64)
    cq = (a @ a.mT / D).contiguous()                                        # symmetric PSD like C_Q
    vw, ws = torch.empty(H, D, D, dtype=torch.float64), torch.empty(H, dtype=torch.float64)
    native.value_target(k, v, 2, T, cq, vw, ws, threads=2)
    for h in range(H):
        W = np.zeros((D, D))
        wsum = 0.0
        C = cq[h].numpy()
        for t in range(2, T):
            kt, vt = k[h, t].double().numpy(), v[h, t].double().numpy()
            w = sum(kt[i] * C[i, j] * kt[j] for i in range(D) for j in range(D))
            wsum += w
            W += w * np.outer(vt, vt)
        assert rel(vw[h], W) < 1e-12 and abs(ws[h].item() - wsum) <= 1e-12 * abs(wsum)


@needs_kernel
@pytest.mark.parametrize("nan", [False, True])
def test_native_and_torch_paths_agree(monkeypatch, nan):
    """The accumulator's two paths (C kernel; torch ops) give the same block, NaN rows included."""
    Hq, H, D, T = 6, 2, 64, 150
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, T, D, generator=g) for h in (Hq, H, H))
    o = torch.randn(1, T, Hq, D, generator=g)
    if nan:
        k[0, 1, 77, 5] = torch.nan
        o[0, 90, 3, 0] = torch.inf
    spec = C.CaptureSpec(Hq, H, D, layers=(0,), sink=4, reservoir=7, seqs_per_block=1)
    rows = C._Rows([slice(4, T)], 0)
    fast = C.LayerAccumulator(spec, 0, 0, torch.device("cpu"))
    fast.update(q, k, v, o, rows)
    monkeypatch.setattr(C, "_native_ok", lambda src: False)
    slow = C.LayerAccumulator(spec, 0, 0, torch.device("cpu"))
    slow.update(q, k, v, o, rows)
    a, b = fast.arrays(), slow.arrays()
    assert a.keys() == b.keys()
    for name in a:
        if a[name].dtype.kind == "f":
            assert np.isfinite(a[name]).all(), name
            assert rel(a[name], b[name]) < 1e-13, (name, rel(a[name], b[name]))
        else:
            assert np.array_equal(a[name], b[name]), name
    assert int(a["nonfinite"]) == (2 if nan else 0)


def test_unavailable_compiler_falls_back(tmp_path):
    """No working compiler: one warning naming the reason, and the capture still computes (torch ops)."""
    code = """
import warnings, torch
from oscar.pipeline import capture as C, native
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    assert not native.available()
print("WARN", [str(x.message) for x in w])
spec = C.CaptureSpec(2, 1, 16, layers=(0,), sink=0, reservoir=0, seqs_per_block=1)
a = C.LayerAccumulator(spec, 0, 0, torch.device("cpu"))
x = torch.randn(1, 2, 5, 16)
a.update(x, x[:, :1], x[:, 1:], x.transpose(1, 2), C._Rows([slice(0, 5)], 0))
print("COUNT", int(a.arrays()["kv_count"]))
"""
    env = {**os.environ, "CC": "/bin/false", "OSCAR_CACHE": str(tmp_path)}
    env.pop("OSCAR_NATIVE", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "native capture kernel unavailable" in r.stdout and "COUNT 5" in r.stdout
    assert not list(tmp_path.rglob("*.so"))
