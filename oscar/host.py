"""The host a run lands on: its CPU's features, and the compute dtype chosen for it.

A CPU multiplies bfloat16 natively only with AVX-512 BF16 or AMX; elsewhere torch emulates bf16 GEMMs, 6-30x
slower than float32 (one thread of an AVX2-only AMD EPYC: 1.2 against 34.5 GFLOP/s for a 1024 x 576 x 1536
matmul, `python bench/native_paths.py`). The model's compute dtype `auto` is therefore bfloat16 on CUDA and on
CPUs with those units, float32 on every other CPU. Every figure the product writes names this host
(`describe()`), and run.json keeps `info()`.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16")
BF16_UNITS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 matrix arithmetic
FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve")  # the ones the kernels care about
# Variables that hold a run below what its CPU can do (how an AVX-512 host runs as an AVX2-only one): a run
# under any of them says so wherever it names its host.
RESTRICTIONS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "OSCAR_NATIVE_ISA",
                "OSCAR_CPU_BF16")
# Their values that run a job as an AVX2-only host does (torch, oneDNN and MKL held to AVX2, the native kernels
# built without AVX-512, no bfloat16 units): docs/speed.md, the benchmarks' --as-avx2.
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "OSCAR_NATIVE_ISA": "avx2", "OSCAR_CPU_BF16": "0"}
GEMM_PROBE = """
import time, torch
torch.set_num_threads(1)
a, b = torch.randn(2048, 576), torch.randn(576, 1536)
a @ b


def once():
    t = time.perf_counter()
    a @ b
    return time.perf_counter() - t


print(2 * 2048 * 576 * 1536 / min(once() for _ in range(20)) / 1e9)
"""


_IMPORTED = time.monotonic()  # where /proc is missing: the command's clock starts when oscar is first imported


def process_seconds() -> float:
    """Seconds since this process started (the command's wall time so far: interpreter start-up, imports, kernel
    builds and Ray's start included). Linux: CLOCK_BOOTTIME now minus the process's start in /proc/self/stat
    (clock ticks since boot, 10 ms); elsewhere, since oscar was first imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime (after the comm field)
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = val.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(val.split())
    except OSError:
        pass
    return model, flags


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    return _cpuinfo()[1]


def has_bf16_units() -> bool:
    """The CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX). OSCAR_CPU_BF16=1/0 overrides (tests)."""
    force = os.environ.get("OSCAR_CPU_BF16")
    if force in ("0", "1"):
        return force == "1"
    return any(f in cpu_flags() for f in BF16_UNITS)


def compute_dtype(dtype: str = "auto", device: str = "cpu") -> str:
    """The model compute dtype a run uses: `dtype` itself, or for "auto" the host's fast one (module docstring)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if str(device).startswith("cuda") or has_bf16_units() else "float32"


def info() -> dict:
    """What run.json and the benchmarks record of the host."""
    # late: keeps torch (2.1 s) out of `oscar --help`
    import torch  # a local import: the CLI's argument checks use this module before torch is needed

    model, flags = _cpuinfo()
    return {"cpu": model, "cpus": os.cpu_count(), "machine": platform.machine(),
            "features": [f for f in FEATURES if f in flags], "bf16_units": has_bf16_units(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "node": platform.node(), "restricted": restrictions()}


def restrictions() -> dict[str, str]:
    """The RESTRICTIONS set in this process's environment (empty on an unrestricted run)."""
    return {k: os.environ[k] for k in RESTRICTIONS if os.environ.get(k, "") not in ("", "native")}


def describe(i: dict | None = None) -> str:
    """One line naming the host: "AMD EPYC, 2 CPUs, AVX2 (no AVX-512)"."""
    i = i or info()
    f = set(i.get("features", []))
    isa = ("AVX-512" + (" BF16" if "avx512_bf16" in f else "") + (" + AMX" if "amx_bf16" in f else "")
           if "avx512f" in f else "AVX2 (no AVX-512)" if "avx2" in f else i.get("machine", "?"))
    r = i.get("restricted") or {}
    held = f", run as {_held_to(r)} ({' '.join(f'{k}={v}' for k, v in r.items())})" if r else ""
    return f"{i.get('cpu', '?')}, {i.get('cpus', '?')} CPUs, {isa}{held}"


def _held_to(r: dict[str, str]) -> str:
    """What a restricted run emulates, in words: "AVX2 only" when torch is held to AVX2, else "restricted"."""
    if r.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2" or r.get("OSCAR_NATIVE_ISA") == "avx2":
        return "AVX2 only (emulated)"
    return "restricted"


def gemm_gflops(env: dict | None = None) -> float:
    """One thread's float32 GEMM speed (2048 x 576 x 1536, best of 20) in a child process under `env` (default:
    this one's): how fast this machine is right now, recorded beside every speed figure of the benchmarks, so
    that two records of one host can be told apart by the host's own speed."""
    out = subprocess.run([sys.executable, "-c", GEMM_PROBE], env=env or dict(os.environ), check=True,
                         capture_output=True, text=True).stdout
    return round(float(out.strip().splitlines()[-1]), 1)


def avx2_env(env: dict | None = None) -> dict:
    """`env` (default: this process's) as an AVX2-only host runs (`AVX2`), with a kernel cache of its own so that
    the AVX2 build's kernels and their verdicts never mix with this host's native ones."""
    env = dict(env or os.environ)
    base = Path(env.get("OSCAR_CACHE") or Path.home() / ".cache" / "oscar-kv")
    env.update(AVX2, OSCAR_CACHE=str(base / "as-avx2"))
    return env


def is_avx2_env(env: dict | None = None) -> bool:
    """The environment already holds the AVX2 settings."""
    env = os.environ if env is None else env
    return all(env.get(k) == v for k, v in AVX2.items())
