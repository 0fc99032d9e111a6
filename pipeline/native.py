"""The capture's one-pass Gram + moments kernel (`_moments.c`), built with the system C compiler
(`oscar.native_build.compile_library`, shared with kernels/cpu_attention.py).

Built on first use into a per-machine cache (`$OSCAR_CACHE`, default ~/.cache/oscar-kv) keyed by
the source, the compiler and the CPU, then loaded with ctypes: no Python or torch headers, no
build step at install time. Where no compiler works (or `OSCAR_NATIVE=0`), `available()` is
False and the capture uses torch ops instead (same statistics, a slower calibration on CPU).
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from pathlib import Path

import torch

from oscar.native_build import compile_library, measured_choice

SRC = Path(__file__).with_name("_moments.c")
MAX_D = 512  # MAXD in _moments.c
_LOCK = threading.Lock()
_LIB: "ctypes.CDLL | None | bool" = False  # False: not tried yet; None: unavailable
WHY_NOT = ""


class _Src(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("heads", ctypes.c_int64), ("s_head", ctypes.c_int64),
                ("s_row", ctypes.c_int64)]


class _Res(ctypes.Structure):  # oscar_res in _moments.c
    _fields_ = [("key", ctypes.c_void_p), ("G", ctypes.c_int64), ("R", ctypes.c_int64), ("idx", ctypes.c_void_p),
                ("out_key", ctypes.c_void_p), ("out_rows", ctypes.c_void_p), ("count", ctypes.c_int64)]


def _build() -> "ctypes.CDLL | None":
    global WHY_NOT
    lib, WHY_NOT = compile_library(SRC, "moments")
    if lib is None:
        return None
    f = lib.oscar_gram_moments
    f.argtypes = [ctypes.POINTER(_Src), ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    f.restype = ctypes.c_int
    f = lib.oscar_sequence
    f.argtypes = [ctypes.POINTER(_Src), ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_int64, *[ctypes.c_void_p] * 6, ctypes.POINTER(_Res), ctypes.c_int]
    f.restype = ctypes.c_int
    f = lib.oscar_reservoir
    f.argtypes = [ctypes.POINTER(_Res), ctypes.c_int64, ctypes.POINTER(_Src), ctypes.POINTER(_Src), ctypes.c_int,
                  ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    f.restype = ctypes.c_int64
    f = lib.oscar_value_target
    f.argtypes = [ctypes.POINTER(_Src), ctypes.POINTER(_Src), ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    f.restype = ctypes.c_int
    return lib


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


def sequence_scratch(htot: int, kv_heads: int, D: int) -> int:
    """float64 elements of `sequence`'s scratch."""
    return htot * D * D + 4 * htot * D + 2 * kv_heads * D * D + kv_heads


class SequenceReservoir:
    """Where `sequence` puts the reservoir candidates of a block's sequences, for one layer: the block's keys
    kv (S, T) and qo (S, T, G) float64, and per kind (0: k/v, 1: q/o) and sequence the R chosen keys and their rows
    (float32, (R, 2*Hkv, D)). Checked once here; a call then passes pointers into these buffers, no torch op."""

    def __init__(self, keys_kv: torch.Tensor, keys_qo: torch.Tensor, R: int, kv_heads: int, D: int):
        S, T, G = keys_qo.shape
        assert keys_kv.shape == (S, T) and keys_kv.dtype == keys_qo.dtype == torch.float64
        assert keys_kv.is_contiguous() and keys_qo.is_contiguous() and keys_kv.device.type == "cpu" and R > 0
        self.keys_kv, self.keys_qo, self.R, self.G, self.T = keys_kv, keys_qo, R, G, T
        self.out_keys = torch.empty(2, S, R, dtype=torch.float64)                       # (kind, S, R)
        self.out_rows = torch.empty(2, S, R, 2 * kv_heads, D, dtype=torch.float32)      # (kind, S, R, 2*Hkv, D)
        self.idx = torch.empty(T + T * G, dtype=torch.int64)  # selection scratch: k/v's T, then q/o's (in parallel)
        self.count = torch.zeros(2, S, dtype=torch.int64).numpy()                       # chosen per (kind, seq)
        self._row = 2 * kv_heads * D * 4  # bytes of one candidate row

    def slots(self, seq: int, row0: int) -> "ctypes.Array":
        """The two oscar_res of sequence `seq`, rows from row0: pointers into the buffers."""
        R, G, T = self.R, self.G, self.T
        k0, r0, i0 = self.out_keys.data_ptr(), self.out_rows.data_ptr(), self.idx.data_ptr()
        S = self.out_keys.shape[1]
        return (_Res * 2)(
            _Res(self.keys_kv.data_ptr() + 8 * (seq * T + row0), 1, R, i0, k0 + 8 * seq * R, r0 + self._row * seq * R, 0),
            _Res(self.keys_qo.data_ptr() + 8 * (seq * T + row0) * G, G, R, i0 + 8 * T, k0 + 8 * (S + seq) * R,
                 r0 + self._row * (S + seq) * R, 0))

    def candidates(self, kind: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys (m,), rows (m, 2*Hkv, D)) of every sequence with candidates of `kind`."""
        return [(self.out_keys[kind, s, :m], self.out_rows[kind, s, :m]) for s, m in enumerate(self.count[kind]) if m]


def sequence(src: list[torch.Tensor], start: int, stop: int, group: int, gram: torch.Tensor, mom: torch.Tensor,
             max2: torch.Tensor, vw: torch.Tensor, wsum: torch.Tensor, scratch: torch.Tensor,
             res: "tuple[SequenceReservoir, int] | None" = None, threads: int | None = None) -> bool:
    """One sequence's rows start:stop of src = [q (Hq, T, D), k, v (Hkv, T, D), o (Hq, T, D)] added to a layer's
    running totals in one call (`oscar_sequence` in _moments.c): gram (Htot, D, D) and mom (3, Htot, D) +=, max2
    (Htot, D) <- max with x^2, and the value target with this sequence's C_Q, vw (Hkv, D, D) and wsum (Hkv,) +=;
    with res = (reservoir, seq), the sequence's reservoir candidates of both kinds into the reservoir's slots.
    False, with nothing added or chosen, when the rows hold NaN/Inf."""
    assert available(), WHY_NOT
    dt = _check_src(src)
    H, D = src[1].shape[0], src[0].shape[2]
    htot = 2 * H * group + 2 * H
    assert len(src) == 4 and [p.shape[0] for p in src] == [H * group, H, H, H * group], [p.shape for p in src]
    _check_out((gram, (htot, D, D)), (mom, (3, htot, D)), (max2, (htot, D)), (vw, (H, D, D)), (wsum, (H,)),
               (scratch, (sequence_scratch(htot, H, D),)))
    slots = None
    if res is not None:
        r, seq = res
        assert r.G == group and r.out_rows.shape[3:] == (2 * H, D) and stop <= r.T, (r.G, r.out_rows.shape, stop)
        slots = r.slots(seq, start)
    rc = _LIB.oscar_sequence(_srcs(src), int(dt == torch.float64), start, stop - start, D, H, group,
                             gram.data_ptr(), mom.data_ptr(), max2.data_ptr(), vw.data_ptr(), wsum.data_ptr(),
                             scratch.data_ptr(), slots, threads or torch.get_num_threads())
    if rc < 0:
        raise ValueError(f"native sequence failed ({rc}) with head_dim {D}, {H} KV heads of group {group}")
    if slots is not None and rc == 0:
        r.count[0, seq], r.count[1, seq] = slots[0].count, slots[1].count
    return rc == 0


def reservoir(keys: torch.Tensor, group: int, R: int, a: torch.Tensor, b: torch.Tensor, row0: int,
              kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's reservoir candidates of one kind on their own (`oscar_reservoir` in _moments.c; `sequence`
    picks both kinds inside its call): of keys (n*group,) float64 (key i: row row0 + i // group, group member
    i % group), the R smallest (all when fewer), in no particular order, and their rows as float32:
    (m, 2*Hkv, D) = heads h*group + g of a, then of b, for h < Hkv (k, v: group 1; q, o: the query group).
    Returns (keys (m,), rows (m, 2*Hkv, D))."""
    assert available(), WHY_NOT
    dt = _check_src([a, b])
    assert keys.dtype == torch.float64 and keys.is_contiguous() and keys.dim() == 1 and keys.numel() % group == 0
    D, n, H = a.shape[2], keys.numel() // group, kv_heads
    assert a.shape[0] == b.shape[0] == H * group and row0 + n <= a.shape[1], (a.shape, b.shape, row0, n)
    m = min(R, keys.numel())
    idx = torch.empty(keys.numel(), dtype=torch.int64)
    out_keys, rows = torch.empty(max(m, 1), dtype=torch.float64), torch.empty(max(m, 1), 2 * H, D, dtype=torch.float32)
    r = _Res(keys.data_ptr(), group, R, idx.data_ptr(), out_keys.data_ptr(), rows.data_ptr(), 0)
    got = _LIB.oscar_reservoir(ctypes.byref(r), n, _srcs([a]), _srcs([b]), int(dt == torch.float64), row0, H, D)
    assert got == m, (got, m)
    return out_keys[:m], rows[:m]
