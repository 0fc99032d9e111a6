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

from oscar import native_build
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
@pytest.mark.parametrize("H,G,D,T", [(2, 3, 64, 141), (1, 4, 10, 30)])
def test_sequence_is_the_separate_calls_added_up(H, G, D, T):
    """native.sequence (one call per layer and sequence) adds to running totals exactly what gram_moments and
    value_target (checked against loops above), the C_Q of the sequence's own query Grams and the torch adds
    give, bit for bit; NaN rows and an empty range add nothing."""
    g = torch.Generator().manual_seed(3)
    Hq, htot = H * G, 2 * H * G + 2 * H
    q, k, v = (torch.randn(h, T, D, generator=g) for h in (Hq, H, H))
    o = torch.randn(T, Hq, D, generator=g).transpose(0, 1)                  # token-major, as the model's output
    src, (a, b) = [q, k, v, o], (5, T - 2)
    tot = [torch.rand(s, generator=g, dtype=torch.float64) for s in ((htot, D, D), (3, htot, D), (htot, D), (H, D, D), (H,))]
    want = [t.clone() for t in tot]
    gram, mom, mx = torch.empty(htot, D, D, dtype=torch.float64), torch.empty(3, htot, D, dtype=torch.float64), \
        torch.empty(htot, D, dtype=torch.float64)
    native.gram_moments(src, a, b, gram, mom, mx)
    cq = gram[:Hq].view(H, G, D, D).sum(1) / ((b - a) * G)
    vw, ws = torch.empty(H, D, D, dtype=torch.float64), torch.empty(H, dtype=torch.float64)
    native.value_target(k, v, a, b, cq, vw, ws)
    want[0] += gram
    want[1] += mom
    torch.maximum(want[2], mx, out=want[2])
    want[3] += vw
    want[4] += ws
    scratch = torch.empty(native.sequence_scratch(htot, H, D), dtype=torch.float64)
    got = [t.clone() for t in tot]
    assert native.sequence(src, a, b, G, *got, scratch)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert native.sequence(src, 7, 7, G, *got, scratch)                     # no rows: nothing added (no 0/0)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    k[-1, 9, 2] = torch.nan
    assert not native.sequence(src, a, b, G, *got, scratch)                 # NaN: refused, nothing added
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert native.sequence(src, 10, b, G, *got, scratch)                    # rows past the NaN row are fine


@needs_kernel
@pytest.mark.parametrize("H,G,D,T,R", [(2, 3, 64, 141, 16), (1, 4, 10, 30, 500)])
def test_sequence_chooses_the_reservoir_as_the_separate_call(H, G, D, T, R):
    """native.sequence with a SequenceReservoir chooses, for its sequence's slot, the candidates native.reservoir
    (checked against a sort below) chooses on its own, both kinds; a NaN sequence leaves its slot empty."""
    g = torch.Generator().manual_seed(5)
    Hq, htot, S, (a, b) = H * G, 2 * H * G + 2 * H, 3, (5, T - 2)
    q, k, v = (torch.randn(h, T, D, generator=g) for h in (Hq, H, H))
    o = torch.randn(T, Hq, D, generator=g).transpose(0, 1)
    kkv, kqo = torch.rand(S, T, generator=g, dtype=torch.float64), torch.rand(S, T, G, generator=g, dtype=torch.float64)
    res = native.SequenceReservoir(kkv, kqo, R, H, D)
    tot = [torch.zeros(s, dtype=torch.float64) for s in ((htot, D, D), (3, htot, D), (htot, D), (H, D, D), (H,))]
    scratch = torch.empty(native.sequence_scratch(htot, H, D), dtype=torch.float64)
    assert native.sequence([q, k, v, o], a, b, G, *tot, scratch, (res, 1))
    for kind, want in enumerate((native.reservoir(kkv[1, a:b].contiguous(), 1, R, k, v, a, H),
                                 native.reservoir(kqo[1, a:b].reshape(-1), G, R, q, o, a, H))):
        (got_k, got_r), = res.candidates(kind)                                # sequence 1 only
        assert got_k.numel() == min(R, (b - a) * (G if kind else 1))
        i, j = got_k.argsort(), want[0].argsort()
        assert torch.equal(got_k[i], want[0][j]) and torch.equal(got_r[i], want[1][j])
    k[0, 9, 1] = torch.nan
    assert not native.sequence([q, k, v, o], a, b, G, *tot, scratch, (res, 2))
    assert res.count[:, 2].tolist() == [0, 0] and len(res.candidates(0)) == 1


@needs_kernel
@pytest.mark.parametrize("G,n,R,dtype", [(1, 50, 7, torch.float32), (3, 41, 16, torch.float64), (2, 5, 16, torch.float32),
                                         (4, 300, 1, torch.float32)])
def test_reservoir_picks_the_smallest_keys_rows(G, n, R, dtype):
    """native.reservoir against a sort: the R smallest of the n*G keys (all when fewer), each with its row's
    heads h*G + g of both sources, as float32."""
    g = torch.Generator().manual_seed(G * n)
    H, D, T, row0 = 2, 10, n + 9, 4
    a = torch.randn(H * G, T, D, generator=g, dtype=dtype)
    b = torch.randn(T, H * G, D, generator=g, dtype=dtype).transpose(0, 1)  # token-major
    keys = torch.rand(n * G, generator=g, dtype=torch.float64)
    got_k, got_r = native.reservoir(keys, G, R, a, b, row0, H)
    order = got_k.argsort()
    want = keys.argsort()[:R]
    assert torch.equal(got_k[order], keys[want])
    t, gi = row0 + want // G, want % G                                      # (m,) each
    h = torch.arange(H)[None] * G + gi[:, None]                             # (m, H)
    rows = torch.cat([a[h, t[:, None]], b[h, t[:, None]]], dim=1).float()   # (m, 2H, D)
    assert torch.equal(got_r[order], rows)


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


_CHOICE = """
import json, torch
from oscar import native_build
from oscar.kernels import cpu_attention as CA
from oscar.pipeline import capture as C, native
ok = (native.chosen(), CA.chosen(), CA.chosen(torch.bfloat16))
x = torch.randn(2, 8, 64)
q, k = torch.randn(1, 3, 8, 64), torch.randn(1, 1, 8, 64)
print("CHOICE", json.dumps({"moments": ok[0], "flash": ok[1], "flash_bf16": ok[2], "native_ok": C._native_ok([x]),
                            "supports": CA.supports(q, k), "supports_bf16": CA.supports(q.bfloat16(), k.bfloat16()),
                            "choices": native_build.CHOICES}))
"""


def _choice(tmp_path, **env) -> dict:
    import json

    e = {**os.environ, "OSCAR_CACHE": str(tmp_path), **env}
    r = subprocess.run([sys.executable, "-c", _CHOICE], env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.split("CHOICE", 1)[1])


@needs_kernel
def test_host_choice_measured_once_and_shared(tmp_path):
    """Unforced, each native path runs only where its probe was no slower than the torch ops it replaces; the
    verdict is measured once per machine and build, and every later process (Ray workers too) reads it."""
    first = _choice(tmp_path, OSCAR_NATIVE="1")
    for name, key in (("moments", "moments"), ("flash_cpu", "flash"), ("flash_cpu_bf16", "flash_bf16")):
        rec = first["choices"][name]
        assert rec["native"] == (rec["native_s"] <= rec["torch_s"]) == first[key]
        assert rec["native_s"] > 0 and rec["torch_s"] > 0 and "chosen" in rec["why"]
    assert first["native_ok"] == first["moments"] and first["supports"] == first["flash"]
    assert first["supports_bf16"] == first["flash_bf16"]  # each input dtype takes its own verdict
    # the attention verdicts are measured at the calibration sequences' length (a verdict of another probe is not read)
    assert first["choices"]["flash_cpu"]["probe"] == first["choices"]["flash_cpu_bf16"]["probe"] == "T=2048"
    files = sorted(tmp_path.rglob("*.choice.json"))
    assert len(files) == 3
    again = _choice(tmp_path, OSCAR_NATIVE="1")
    assert again["choices"] == first["choices"]  # read, not re-measured (same timestamps and times)


@needs_kernel
def test_host_choice_slower_falls_back_to_torch(tmp_path):
    """A host where the kernels measured slower than torch takes torch's path for both; OSCAR_NATIVE=force
    takes the native one regardless."""
    import json

    _choice(tmp_path, OSCAR_NATIVE="1")
    for f in tmp_path.rglob("*.choice.json"):
        rec = json.loads(f.read_text())
        f.write_text(json.dumps({**rec, "native": False, "native_s": 2 * rec["torch_s"]}))
    slow = _choice(tmp_path, OSCAR_NATIVE="1")
    assert not slow["moments"] and not slow["flash"] and not slow["native_ok"] and not slow["supports"]
    assert not slow["flash_bf16"] and not slow["supports_bf16"]
    forced = _choice(tmp_path, OSCAR_NATIVE="force")
    assert forced["moments"] and forced["flash"] and forced["native_ok"] and forced["supports"]
    assert forced["flash_bf16"] and forced["supports_bf16"]


@needs_kernel
def test_host_choice_per_dtype(tmp_path):
    """A host where the kernel lost in bfloat16 only (torch's bfloat16 SDPA on matrix units) keeps it for float32
    inputs and hands bfloat16 inputs, and a bfloat16 model's prefill, to torch."""
    import json

    _choice(tmp_path, OSCAR_NATIVE="1")
    (f,) = [f for f in tmp_path.rglob("flash_cpu_bf16-*.choice.json")]
    rec = json.loads(f.read_text())
    f.write_text(json.dumps({**rec, "native": False}))
    (g,) = [g for g in tmp_path.rglob("flash_cpu-*.choice.json")]
    g.write_text(json.dumps({**json.loads(g.read_text()), "native": True}))
    mixed = _choice(tmp_path, OSCAR_NATIVE="1")
    assert mixed["flash"] and mixed["supports"] and not mixed["flash_bf16"] and not mixed["supports_bf16"]


_SUMS = """
import sys, torch
from oscar.kernels import cpu_attention as CA
from oscar.pipeline import native
g = torch.Generator().manual_seed(0)
src = [torch.randn(5, 200, 64, generator=g) * 2 + 0.3, torch.randn(3, 200, 128, generator=g)]
out = []
for s in src:
    H, T, D = s.shape
    gram, mom, mx = torch.empty(H, D, D, dtype=torch.float64), torch.empty(3, H, D, dtype=torch.float64), torch.empty(H, D, dtype=torch.float64)
    native.gram_moments([s], 1, T, gram, mom, mx, threads=1)
    cq = (s[:2].double().mT @ s[:2].double()) / T
    vw, ws = torch.empty(2, D, D, dtype=torch.float64), torch.empty(2, dtype=torch.float64)
    native.value_target(s[:2], s[-2:], 1, T, cq.contiguous(), vw, ws, threads=1)
    out += [gram, mom, mx, vw, ws]
q, k, v = torch.randn(1, 6, 200, 64, generator=g), torch.randn(1, 2, 200, 64, generator=g), torch.randn(1, 2, 200, 64, generator=g)
out += list(CA.causal_attention(q, k, v, threads=1))
torch.save(out, sys.argv[1])
"""


@needs_kernel
@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_isa_builds_agree(tmp_path, isa):
    """The kernels built for another instruction set (OSCAR_NATIVE_ISA; on an AVX-512 host "avx2" is what an
    AVX2-only host runs) against this host's build. With FMA on both sides (avx2) the Gram and the moments are
    bit-identical: every sum runs in row order at any vector width. The portable build rounds each product
    before adding it, so there each sum of n terms is within 2 n u of the sum of its absolute terms (u = 2^-53,
    both sides' error). The value target's weights reorder their lanes; with C positive definite and w > 0 its
    error is within 2 (2D + n) u of its largest entry (Cauchy-Schwarz bounds an entry by the diagonal)."""
    outs = []
    for which in ("native", isa):
        f = tmp_path / f"{which}.pt"
        env = {**os.environ, "OSCAR_CACHE": str(tmp_path / "cache"), "OSCAR_NATIVE": "force", "OSCAR_NATIVE_ISA": which}
        r = subprocess.run([sys.executable, "-c", _SUMS, str(f)], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        outs.append(torch.load(f))
    a, b = outs
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(5, 200, 64, generator=g) * 2 + 0.3, torch.randn(3, 200, 128, generator=g)]
    u, n = 2.0 ** -53, 199
    for i, s_ in zip((0, 5), src):
        x = s_[:, 1:].double().abs()                                                   # (H, n, D)
        absums = [x.mT @ x, torch.stack([x.sum(1), (x ** 3).sum(1), (x ** 4).sum(1)]), None]
        for j in (0, 1, 2):  # gram, mom, max2 (max x^2: exact either way)
            if isa == "avx2" or j == 2:
                assert torch.equal(a[i + j], b[i + j])
            else:
                assert ((a[i + j] - b[i + j]).abs() <= 2 * n * u * absums[j]).all()
        D = s_.shape[-1]
        for j in (3, 4):
            assert rel(a[i + j], b[i + j]) <= 2 * (2 * D + n) * u
    # attention (float32): the row sum of up to 200 probabilities reordered: 200 u32 relative at worst
    assert (a[10] - b[10]).abs().max() <= 2 * 200 * 2 ** -24 * a[10].abs().max()
    assert (a[11] - b[11]).abs().max() <= 2 * 200 * 2 ** -24 * a[11].abs().max()


def test_unknown_isa_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_NATIVE_ISA", "avx1024")
    monkeypatch.setenv("OSCAR_CACHE", str(tmp_path))
    lib, why = native_build.compile_library(native.SRC, "moments")
    assert lib is None and "unknown OSCAR_NATIVE_ISA='avx1024'" in why
