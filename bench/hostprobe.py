"""What the benchmarks record about the host beside every speed figure: a one-thread float32 GEMM's speed under the
run's environment, and the environment that runs a job as an AVX2-only host does (torch, oneDNN and MKL held to
AVX2, the native kernels built without AVX-512 in a cache directory of their own, no bfloat16 units).

    from hostprobe import AVX2, avx2_env, gemm_gflops   # bench/ scripts run with bench/ on sys.path
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "OSCAR_NATIVE_ISA": "avx2", "OSCAR_CPU_BF16": "0"}

PROBE = """
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


def gemm_gflops(env: dict | None = None) -> float:
    """One thread's float32 GEMM speed (2048 x 576 x 1536, best of 20) under `env` (default: this process's): how
    fast this VM is right now, so that two records of one host can be told apart by the host's own speed."""
    out = subprocess.run([sys.executable, "-c", PROBE], env=env or dict(os.environ), check=True, capture_output=True,
                         text=True).stdout
    return round(float(out.strip().splitlines()[-1]), 1)


def avx2_env(env: dict | None = None) -> dict:
    """`env` (default: this process's) as an AVX2-only host runs: the AVX2 settings, and a kernel cache of its own so
    that the AVX2 build's kernels and their verdicts never mix with this host's native ones."""
    env = dict(env or os.environ)
    base = Path(env.get("OSCAR_CACHE") or Path.home() / ".cache" / "oscar-kv")
    env.update(AVX2, OSCAR_CACHE=str(base / "as-avx2"))
    return env


def is_avx2_env(env: dict | None = None) -> bool:
    """This environment already holds the AVX2 settings."""
    env = env or os.environ
    return all(env.get(k) == v for k, v in AVX2.items())
