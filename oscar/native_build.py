"""Native CPU kernels' shared build and choice machinery: the capture's moments kernel (pipeline/native.py,
`_moments.c`) and the CPU attention kernel (kernels/cpu_attention.py, `_flash_cpu.c`) both go through it.

`compile_library` builds a C source with the system compiler on first use into a per-machine cache
(`$OSCAR_CACHE`, default ~/.cache/oscar-kv) keyed by the source, the compiler, the flags and the CPU, then
loads it with ctypes: no Python or torch headers, no build step at install time. `measured_choice` times a
native path against the torch ops it replaces once per machine and keeps the verdict beside the library.
`OSCAR_NATIVE=0` disables every native kernel; `OSCAR_NATIVE=force` takes them unmeasured.
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
import time
from pathlib import Path

import torch

# The name the CPU attention kernel registers with transformers' attention registry (kernels/cpu_attention.py);
# the calibration capture looks its inner attention up under it (pipeline/capture.py), so it runs the native
# kernel wherever a caller registered it and SDPA otherwise. (A name containing "flash" would send
# transformers looking for flash-attn.)
CPU_ATTENTION = "oscar_cpu_causal"
FLAGS = ("-O3", "-std=gnu11", "-shared", "-fPIC", "-fopenmp")  # gnu11: FMA contraction on (never reassociation)
# Native vectorisation (512-bit where the CPU has it) first, then portable code if the compiler refuses.
MARCH = (("-march=native", "-mprefer-vector-width=512"), ("-march=native",), ())
# OSCAR_NATIVE_ISA picks the build: native (default, the ladder above), avx2 (this CPU without AVX-512: how an
# AVX-512 host runs the kernels an AVX2-only host gets) or portable (the compiler's baseline, SSE2 on x86-64).
ISA = {"native": MARCH, "avx2": (("-march=native", "-mno-avx512f"),), "portable": ((),)}


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




CHOICES: dict[str, dict] = {}  # native path -> its host choice (`measured_choice`), for run.json and the report


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measured_choice(name: str, lib: "ctypes.CDLL", native_fn, torch_fn, reps: int = 5, probe: str = "") -> bool:
    """Whether native path `name` runs on this host: built, and no slower than the torch ops it replaces.

    The two are timed on a probe of the work they share (one thread, the best of `reps` alternating
    runs) once per machine, library build and torch version; the verdict is kept beside the library so
    that every process of the machine (Ray stage workers too) takes the same path. `OSCAR_NATIVE=force`
    takes the native path unmeasured (tests, benchmarks). The choice is recorded in CHOICES. `probe` names the
    probe's shape: a verdict measured on another probe is measured again.
    """
    if os.environ.get("OSCAR_NATIVE", "1") == "force":
        CHOICES[name] = {"native": True, "why": "forced by OSCAR_NATIVE=force", "build": Path(lib._name).name}
        return True
    so = Path(lib._name)
    key = hashlib.sha256(f"{so.name} {torch.__version__}{' ' + probe if probe else ''}".encode()).hexdigest()[:12]
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
               "measured": time.strftime("%Y-%m-%dT%H:%M:%S"), **({"probe": probe} if probe else {})}
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
