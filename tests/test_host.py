"""The host's compute dtype and description (oscar/host.py): bfloat16 only where it is fast."""

import json
import os
import platform
import resource
import subprocess
import sys

import pytest

from oscar import host


def test_auto_dtype_follows_the_bf16_units(monkeypatch):
    monkeypatch.setenv("OSCAR_CPU_BF16", "0")
    assert host.compute_dtype("auto", "cpu") == "float32"
    assert host.compute_dtype("auto", "cuda:1") == "bfloat16"  # GPUs multiply bfloat16 natively
    monkeypatch.setenv("OSCAR_CPU_BF16", "1")
    assert host.compute_dtype("auto", "cpu") == "bfloat16"
    for d in ("float32", "bfloat16"):  # an explicit dtype is kept
        assert host.compute_dtype(d, "cpu") == d
    with pytest.raises(ValueError, match="unknown dtype 'float16'"):
        host.compute_dtype("float16")


def test_auto_dtype_reads_the_cpu_flags(monkeypatch):
    monkeypatch.delenv("OSCAR_CPU_BF16", raising=False)
    want = "bfloat16" if {"avx512_bf16", "amx_bf16"} & host.cpu_flags() else "float32"
    assert host.compute_dtype("auto", "cpu") == want


def test_describe_names_the_instruction_set():
    base = {"cpu": "X", "cpus": 2, "machine": "x86_64"}
    assert host.describe({**base, "features": ["avx2", "fma"]}) == "X, 2 CPUs, AVX2 (no AVX-512)"
    assert host.describe({**base, "features": ["avx2", "avx512f", "avx512_bf16"]}) == "X, 2 CPUs, AVX-512 BF16"
    assert host.describe({**base, "features": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]}) == "X, 2 CPUs, AVX-512 BF16 + AMX"
    avx2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert host.describe({**base, "features": ["avx2", "avx512f"], "restricted": avx2}) == (
        "X, 2 CPUs, AVX-512, run as AVX2 only (emulated) (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)")
    assert host.describe({**base, "features": ["avx2"], "restricted": {"OSCAR_CPU_BF16": "0"}}).endswith(
        ", run as restricted (OSCAR_CPU_BF16=0)")
    i = host.info()
    assert i["cpus"] >= 1 and i["torch_cpu_capability"] and set(i["features"]) <= set(host.FEATURES)


def test_model_follows_auto(monkeypatch):
    """validate's with_dtype resolves "auto" for the model's device."""
    import torch

    from oscar.scoring.dtype import with_dtype

    m = torch.nn.Linear(2, 2)
    monkeypatch.setenv("OSCAR_CPU_BF16", "1")
    assert next(with_dtype(m, "auto").parameters()).dtype == torch.bfloat16
    monkeypatch.setenv("OSCAR_CPU_BF16", "0")
    assert next(with_dtype(m, "auto").parameters()).dtype == torch.float32


def test_a_restricted_run_names_its_restrictions(monkeypatch):
    for k in host.RESTRICTIONS:
        monkeypatch.delenv(k, raising=False)
    assert host.restrictions() == {} and "emulated" not in host.describe()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("OSCAR_NATIVE_ISA", "native")  # the default build: no restriction
    assert host.restrictions() == {"ATEN_CPU_CAPABILITY": "avx2"}
    assert host.describe().endswith("run as AVX2 only (emulated) (ATEN_CPU_CAPABILITY=avx2)")


def test_process_seconds_counts_from_the_process_start():
    """The command's clock (oscar run's wall time) starts with its process, not when oscar is imported."""
    import subprocess
    import sys
    import time

    code = "import time; time.sleep(1.0); from oscar.host import process_seconds; print(process_seconds())"
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    outer = time.monotonic() - t
    s = float(r.stdout)
    tick = 1 / os.sysconf("SC_CLK_TCK")  # the start time is kept in whole clock ticks, rounded down
    assert 1.0 <= s <= outer + tick, (s, outer, tick)  # the sleep before the import is counted
    assert 0 <= host.process_seconds() < 1e6  # this process's clock too


def test_avx2_environment_and_the_gemm_probe(tmp_path):
    """The benchmarks' --as-avx2: every restriction set to AVX2 and a kernel cache of its own; the GEMM probe runs
    in a child process under the environment it is given."""
    env = host.avx2_env({"OSCAR_CACHE": str(tmp_path), "PATH": os.environ.get("PATH", "")})
    assert host.is_avx2_env(env) and not host.is_avx2_env({})
    assert env["OSCAR_CACHE"] == str(tmp_path / "as-avx2") and set(host.AVX2) <= set(host.RESTRICTIONS)
    assert host.gemm_gflops() > 0


FREED = """
import ctypes, resource, sys
from oscar.common import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n, faults = 24 << 20, []
for _ in range(3):  # the same 24 MiB allocated, written and freed three times
    f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
print(kept, faults)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_kept_freed_memory_is_reused_without_page_faults():
    """After keep_freed_memory a freed 24 MiB block is reused as it is; glibc's default hands it back to the kernel
    (munmap) and the next allocation faults all of its 6,144 pages in again."""
    def run(mode):
        out = subprocess.run([sys.executable, "-c", FREED, mode], capture_output=True, text=True, check=True).stdout
        kept, faults = out.split(None, 1)  # "True [6132, 0, 0]"
        return kept, json.loads(faults)
    pages = (24 << 20) // resource.getpagesize()
    kept, faults = run("keep")
    assert kept == "True" and faults[0] >= pages * 0.9 and max(faults[1:]) < pages * 0.05, faults
    _, faults = run("default")  # the thresholds matter: without them the second round faults again
    assert faults[1] >= pages * 0.9, faults
