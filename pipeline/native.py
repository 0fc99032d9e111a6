"""The capture's one-pass Gram + moments kernel (`_moments.c`), built with the system C compiler
(`compile_library`, also used by pipeline/cpu_attention.py).

Built on first use into a per-machine cache (`$OSCAR_CACHE`, default ~/.cache/oscar-kv) keyed by
the source, the compiler and the CPU, then loaded with ctypes: no Python or torch headers, no
build step at install time. Where no compiler works (or `OSCAR_NATIVE=0`), `available()` is
False and the capture uses torch ops instead (same statistics, a slower calibration on CPU).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

SRC = Path(__file__).with_name("_moments.c")
MAX_D = 512  # MAXD in _moments.c
FLAGS = ("-O3", "-std=gnu11", "-shared", "-fPIC", "-fopenmp")  # gnu11: FMA contraction on (never reassociation)
# Native vectorisation (512-bit where the CPU has it) first, then portable code if the compiler refuses.
MARCH = (("-march=native", "-mprefer-vector-width=512"), ("-march=native",), ())
# OSCAR_NATIVE_ISA picks the build: native (default, the ladder above), avx2 (this CPU without AVX-512: how an
# AVX-512 host runs the kernels an AVX2-only host gets) or portable (the compiler's baseline, SSE2 on x86-64).
ISA = {"native": MARCH, "avx2": (("-march=native", "-mno-avx512f"),), "portable": ((),)}
_LOCK = threading.Lock()
_LIB: "ctypes.CDLL | None | bool" = False  # False: not tried yet; None: unavailable
WHY_NOT = ""


class _Src(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("heads", ctypes.c_int64), ("s_head", ctypes.c_int64),
                ("s_row", ctypes.c_int64)]


def _cpu_tag() -> str:
    try:
        flags = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()}/{hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def _cache_dir() -> Path:
    return Path(os.environ.get("OSCAR_CACHE") or Path.home() / ".cache" / "oscar-kv") / "native"


def compile_library(src_path: Path, stem: str) -> tuple["ctypes.CDLL | None", str]:
    """Compile `src_path` (C11 + OpenMP) into the per-machine cache and load it: (library, "") or (None, why).

    Tries native vectorisation first, then portable code; the cache key is the source, the compiler,
    the flags and the CPU, and a finished file is published atomically (concurrent builders each
    write a complete file). `OSCAR_NATIVE=0` disables every native kernel.
    """
    if os.environ.get("OSCAR_NATIVE", "1") == "0":
        return None, "disabled by OSCAR_NATIVE=0"
    isa = os.environ.get("OSCAR_NATIVE_ISA", "native")
    if isa not in ISA:
        return None, f"unknown OSCAR_NATIVE_ISA={isa!r} (known: {', '.join(ISA)})"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (cc) on PATH"
    src = src_path.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cc} --version failed: {e}"
    errors = []
    for march in ISA[isa]:
        flags = FLAGS + march
        key = hashlib.sha256(src + version.encode() + " ".join(flags).encode() + _cpu_tag().encode()).hexdigest()[:20]
        so = _cache_dir() / f"{stem}-{key}.so"
        if not so.exists():
            try:
                so.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
                os.close(fd)
                r = subprocess.run([cc, *flags, str(src_path), "-o", tmp, "-lm"], capture_output=True, text=True,
                                   timeout=120)
                if r.returncode != 0:
                    os.unlink(tmp)
                    errors.append(f"{cc} {' '.join(flags)}: {r.stderr.strip()[-300:]}")
                    continue
                os.replace(tmp, so)
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(str(e))
                continue
        try:
            return ctypes.CDLL(str(so)), ""
        except OSError as e:
            errors.append(f"loading {so}: {e}")
    return None, "; ".join(errors)


def _build() -> "ctypes.CDLL | None":
    global WHY_NOT
    lib, WHY_NOT = compile_library(SRC, "moments")
    if lib is None:
        return None
    f = lib.oscar_gram_moments
    f.argtypes = [ctypes.POINTER(_Src), ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    f.restype = ctypes.c_int
    f = lib.oscar_value_target
    f.argtypes = [ctypes.POINTER(_Src), ctypes.POINTER(_Src), ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    f.restype = ctypes.c_int
    return lib


CHOICES: dict[str, dict] = {}  # native path -> its host choice (`measured_choice`), for run.json and the report


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measured_choice(name: str, lib: "ctypes.CDLL", native_fn, torch_fn, reps: int = 5) -> bool:
    """Whether native path `name` runs on this host: built, and no slower than the torch ops it replaces.

    The two are timed on a probe of the work they share (one thread, the best of `reps` alternating
    runs) once per machine, library build and torch version; the verdict is kept beside the library so
    that every process of the machine (Ray stage workers too) takes the same path. `OSCAR_NATIVE=force`
    takes the native path unmeasured (tests, benchmarks). The choice is recorded in CHOICES.
    """
    if os.environ.get("OSCAR_NATIVE", "1") == "force":
        CHOICES[name] = {"native": True, "why": "forced by OSCAR_NATIVE=force", "build": Path(lib._name).name}
        return True
    so = Path(lib._name)
    key = hashlib.sha256(f"{so.name} {torch.__version__}".encode()).hexdigest()[:12]
    path = so.with_name(f"{name}-{key}.choice.json")
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        prev = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            native_fn(), torch_fn()  # warm-up (first-touch allocations, torch's kernel selection)
            tn, tt = math.inf, math.inf
            for _ in range(reps):  # alternating: both sides see the same machine
                tn, tt = min(tn, _seconds(native_fn)), min(tt, _seconds(torch_fn))
        finally:
            torch.set_num_threads(prev)
        rec = {"native": tn <= tt, "native_s": tn, "torch_s": tt, "build": so.name, "torch": torch.__version__,
               "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        rec["why"] = (f"native {tn * 1e3:.2f} ms vs torch {tt * 1e3:.2f} ms on a probe, one thread "
                      f"({'native' if rec['native'] else 'torch'} chosen)")
        try:
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=so.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(rec, f)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache: measured again by the next process
    CHOICES[name] = rec
    return bool(rec["native"])


def available() -> bool:
    """Build/load the kernel once per process; warn once (with the reason) when it can't be used."""
    global _LIB
    with _LOCK:
        if _LIB is False:
            _LIB = _build()
            if _LIB is None and os.environ.get("OSCAR_NATIVE", "1") != "0":
                warnings.warn(f"oscar: native capture kernel unavailable ({WHY_NOT}); using torch ops "
                              "(same statistics, slower calibration)", stacklevel=2)
    return _LIB is not None


_CHOSEN: "bool | None" = None


def chosen() -> bool:
    """The capture uses the kernel: built, and measured no slower than its torch ops on this host
    (`measured_choice`; the probe: one sequence of SmolLM2's shape, 512 rows, through both)."""
    global _CHOSEN
    if not available():  # checked each call: the environment may switch it off
        return False
    if _CHOSEN is None:
        _CHOSEN = measured_choice("moments", _LIB, *_probe())
    return _CHOSEN


def _probe(rows: int = 512, heads: int = 24, kv: int = 3, D: int = 64):
    """(native, torch): the Gram + moments and the value target of one probe sequence, each way."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(heads, rows, D, generator=g)                                      # (Htot, T, D) float32
    k, v = x[heads - 2 * kv: heads - kv], x[heads - kv:]                              # (Hkv, T, D) each
    cq = torch.eye(D, dtype=torch.float64).expand(kv, D, D).contiguous()
    gram, mom, mx = torch.empty(heads, D, D, dtype=torch.float64), torch.empty(3, heads, D, dtype=torch.float64), \
        torch.empty(heads, D, dtype=torch.float64)
    vw, ws = torch.empty(kv, D, D, dtype=torch.float64), torch.empty(kv, dtype=torch.float64)

    def native_fn():
        gram_moments([x], 0, rows, gram, mom, mx, threads=1)
        value_target(k, v, 0, rows, cq, vw, ws, threads=1)

    def torch_fn():  # the capture's torch ops for the same sums (pipeline/capture.py, LayerAccumulator._torch_sums)
        for c0 in range(0, rows, 128):
            xd = x[:, c0:c0 + 128].double()                                           # (Htot, c, D)
            x2 = xd * xd
            torch.stack([xd, x2 * xd, x2 * x2]).sum(2), x2.amax(1)
            torch.baddbmm(gram, xd.mT, xd)
        kd, vd = k.double(), v.double()
        wt = ((kd @ cq) * kd).sum(-1)                                                 # (Hkv, T)
        (vd * wt[..., None]).mT @ vd

    return native_fn, torch_fn


def _check_src(src: list[torch.Tensor]) -> torch.dtype:
    dt = src[0].dtype
    assert dt in (torch.float32, torch.float64) and all(p.dtype == dt and p.device.type == "cpu" for p in src)
    assert all(p.stride(2) == 1 for p in src), "channels must be contiguous"
    return dt


def _check_out(*pairs) -> None:
    for t, shape in pairs:
        assert t.dtype == torch.float64 and t.is_contiguous() and tuple(t.shape) == shape, (tuple(t.shape), shape)


def _srcs(src: list[torch.Tensor]):
    return (_Src * len(src))(*[_Src(p.data_ptr(), p.shape[0], p.stride(0), p.stride(1)) for p in src])


def gram_moments(src: list[torch.Tensor], start: int, stop: int, gram: torch.Tensor, mom: torch.Tensor,
                 max2: torch.Tensor, threads: int | None = None) -> None:
    """Rows start:stop of src (each (heads, T, D), channels contiguous, one CPU float dtype), heads in order:
    gram (Htot, D, D) <- sum x x^T; mom (3, Htot, D) <- sums of x, x^3, x^4; max2 (Htot, D) <- max x^2.

    All three are overwritten (the caller checks them for NaN/Inf before adding them up).
    """
    assert available(), WHY_NOT
    dt = _check_src(src)
    D, htot = src[0].shape[2], sum(p.shape[0] for p in src)
    _check_out((gram, (htot, D, D)), (mom, (3, htot, D)), (max2, (htot, D)))
    rc = _LIB.oscar_gram_moments(_srcs(src), len(src), int(dt == torch.float64), start, stop - start, D,
                                 gram.data_ptr(), mom.data_ptr(), max2.data_ptr(), threads or torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"native gram_moments failed ({rc}) on {len(src)} sources with head_dim {D}")


def value_target(k: torch.Tensor, v: torch.Tensor, start: int, stop: int, cq: torch.Tensor, vw: torch.Tensor,
                 wsum: torch.Tensor, threads: int | None = None) -> None:
    """Rows start:stop of k, v (each (Hkv, T, D)), w_t = k_t^T cq[h] k_t:
    vw (Hkv, D, D) <- sum_t w_t v_t v_t^T, wsum (Hkv,) <- sum_t w_t (both overwritten)."""
    assert available(), WHY_NOT
    dt = _check_src([k, v])
    H, D = k.shape[0], k.shape[2]
    _check_out((cq, (H, D, D)), (vw, (H, D, D)), (wsum, (H,)))
    ks, vs = _srcs([k]), _srcs([v])
    rc = _LIB.oscar_value_target(ks, vs, int(dt == torch.float64), start, stop - start, D, cq.data_ptr(),
                                 vw.data_ptr(), wsum.data_ptr(), threads or torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"native value_target failed ({rc}) with head_dim {D}")
